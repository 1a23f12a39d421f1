#!/usr/bin/env bash
# idle-space: the space the host sees gets better with idle time, not worse.
# Real data (a tar of /usr) goes into a fresh volume with default flags by
# nbdcopy at full speed (lz4 while busy); then the clients go idle, and
# background recompression and idle cleaning run. Checked, with `du` of the
# backing file and `cvol stat --json`:
#   - `du` never rises more than one segment above its value at the end of
#     the copy while the idle pass runs (sampled every second);
#   - after idle, physical_used_bytes and du are lower than right after the
#     copy, and within 10% of stored_bytes plus metadata (the metadata area,
#     the open segment and the current checkpoint: 3 segments);
#   - a second nbdcopy of the very same image after idle adds under 2% to
#     physical_used_bytes (dedup found every block where background work
#     moved it; identical overwrites append nothing);
#   - the data reads back exact; cvol check passes.
# `du` is sampled every second from the end of the copy until background
# work settles; its peak (checked) and when it last changed are logged (the
# table in docs/BENCHMARKING.md "`du` while the idle pass runs").
#
#   E2E_IDLE_MB     real-data size in MiB (default 160)
#   E2E_IDLE_IMAGE  copy this file instead of the tar of /usr (e.g. the
#                   ext4 image of a source tree scripts/bench/elastic makes
#                   in /tmp/cvol-bench-cache); E2E_IDLE_MB sizes the volume
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy
need tar
need du
need_server
is_cvol || skip "cvol only: idle cleaning and recompression have no stand-in"

MB=${E2E_IDLE_MB:-160}
VOL=$E2E_TMP/vol.cvol
if [[ -n "${E2E_IDLE_IMAGE:-}" ]]; then
    IMG=$E2E_IDLE_IMAGE
    [[ -s "$IMG" ]] || fail "E2E_IDLE_IMAGE $IMG: no such file"
else
    tar_image idle-usr "$MB" /usr/share /usr/lib /usr/include
    IMG=$TAR_IMAGE
fi

snap() {
    cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
    PU=$(json_get "$E2E_TMP/stat.json" physical_used_bytes)
    ST=$(json_get "$E2E_TMP/stat.json" stored_bytes)
    DEAD=$(json_get "$E2E_TMP/stat.json" dead_bytes)
    RB=$(json_get "$E2E_TMP/stat.json" recompressed_blocks)
    LZ=$(json_get "$E2E_TMP/stat.json" codec_lz4_bytes)
    ZS=$(json_get "$E2E_TMP/stat.json" codec_zstd_bytes)
    SEG=$(json_get "$E2E_TMP/stat.json" segment_size_bytes)
    HITS=$(json_get "$E2E_TMP/stat.json" dedup_hits)
    LOOKUPS=$(json_get "$E2E_TMP/stat.json" dedup_lookups)
    DU=$(($(du -B1 "$VOL" | cut -f1)))
}
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }
row() { log "$(printf '%-22s physical_used %9s  stored %9s  dead %9s  du %9s  lz4/zstd %s / %s' \
    "$1" "$(mib "$PU")" "$(mib "$ST")" "$(mib "$DEAD")" "$(mib "$DU")" "$(mib "$LZ")" "$(mib "$ZS")")"; }

step "nbdcopy $MB MiB of real data into a fresh volume (default flags)"
make_volume "$VOL" $((MB * 3))M
start_server "$VOL"
nbdcopy "$IMG" "$SRV_URI" || fail "nbdcopy in"
snap
row "after the copy"
copy_pu=$PU copy_du=$DU

step "idle: recompression, then the idle cleaning that collects its gain"
t_copy=$(date +%s)
(while :; do
    echo "$(($(date +%s) - t_copy)) $(du -B1 "$VOL" | cut -f1)"
    sleep 1
done) >"$E2E_TMP/du.log" &
du_pid=$!
reg_pid "$du_pid"
last=""
settled() {
    snap
    local now="$PU $ST $RB"
    [[ "$now" == "$last" ]] && return 0
    last=$now
    return 1
}
# Settled: two polls 5 s apart see the same numbers.
wait_until 240 "background work to settle" eval 'sleep 5; settled'
row "after idle"
kill "$du_pid" 2>/dev/null || true
# Peak, and the second du last changed (settled), from the samples.
read -r du_peak du_settled_at < <(awk 'NR == 1 || $2 != v { v = $2; at = $1 } $2 > p { p = $2 }
    END { print p + 0, at + 0 }' "$E2E_TMP/du.log")
log "du while idle: end of copy $(mib "$copy_du"), peak $(mib "$du_peak") ($(awk -v p="$du_peak" -v c="$copy_du" 'BEGIN { printf "%+.1f%%", (p - c) * 100 / c }')), settled $(mib "$DU") after ${du_settled_at} s"
idle_pu=$PU idle_st=$ST idle_hits=$HITS idle_lookups=$LOOKUPS
# Background work appends only what the segments it emptied gave back,
# besides its first pass's rewrite of one segment (written before the
# segment can be given back): the host never holds more than at the end of
# the copy plus one segment.
((du_peak <= copy_du + SEG)) || fail "du rose while idle: $(mib "$copy_du") at the end of the copy, peak $(mib "$du_peak") (more than one segment above)"
allow=$((ST + ST / 10 + 3 * SEG))
((PU <= allow)) || fail "after idle, physical_used $(mib "$PU") > stored + 10% + 3 segments ($(mib "$allow"))"
((DU <= allow)) || fail "after idle, du $(mib "$DU") > stored + 10% + 3 segments ($(mib "$allow"))"
((PU < copy_pu)) || fail "physical_used did not fall with idle time: $(mib "$copy_pu") -> $(mib "$PU")"
((DU < copy_du)) || fail "du did not fall with idle time: $(mib "$copy_du") -> $(mib "$DU")"

step "the very same image again: dedup finds every block wherever background work moved it"
nbdcopy "$IMG" "$SRV_URI" || fail "nbdcopy again"
snap
row "after a second copy"
log "second copy: $((HITS - idle_hits)) of $((LOOKUPS - idle_lookups)) non-zero blocks deduplicated"
grow=$((PU - idle_pu))
((grow * 50 < idle_pu)) || fail "a second identical copy added $(mib "$grow") (>= 2% of $(mib "$idle_pu"))"
# A few blocks miss dedup (their records being moved by background work at
# that moment: 46-90 of 40960 in recent runs) and are stored again; stored
# bytes may grow by that, at most 1%. (Strictly "no more" failed once, by
# less than 0.1%: the copy also frees nothing to make up for them then.)
((ST * 100 <= idle_st * 101)) || fail "a second identical copy stored more than 1% more: $(mib "$idle_st") -> $(mib "$ST")"

step "read back exact; cvol check"
nbdcopy "$SRV_URI" "$E2E_TMP/out.img" || fail "nbdcopy out"
cmp -n "$(stat -c %s "$IMG")" "$IMG" "$E2E_TMP/out.img" || fail "data reads back wrong"
rm -f "$E2E_TMP/out.img"
stop_server
cvol_check "$VOL"
pass
