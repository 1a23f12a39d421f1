#!/usr/bin/env bash
# A thin volume (physical size below the logical size) accepts the writes it
# has room for: data that fits compressed is taken, whatever inline
# compression deferred and however live the log is (the reported shapes, scaled down).
#
#   copy  default flags: nbdcopy --flush of real data (a tar of /usr, ~1.8x
#         the physical size, stored in ~62% of it when compressed inline: the
#         physical size is derived from a measured --inline-cpu off copy) must
#         succeed and read back exact; cvol check.
#   copy-defer  the same served --inline-cpu 0: every unit is written raw
#         while the client is busy (the worst case of deferral, whatever the
#         machine's speed): still must fit.
#   4k    a 2G volume of 600M, --inline-cpu off --unit-size 4K: fio fills 60%-compressible data to
#         ~80% of the physical size live, then random 4 KiB overwrites of that
#         range at iodepth 32 for E2E_THIN_SECONDS: no error; IOPS and write
#         amplification printed; then a bounded random-overwrite pass with
#         fio's crc32c verify (every block's last write read back after the
#         cleaner moved data around), again after a restart, cvol check.
#   16k   the same with the default 16 KiB units; besides: live_bytes after
#         the overwrites at most 1.15x live_bytes after the fill (a unit with
#         one block overwritten must not stay wholly live).
#
#   E2E_THIN_PARTS     parts to run (default "copy copy-defer 4k 16k")
#   E2E_THIN_MB        real data for the copy, MiB (default 480)
#   E2E_THIN_SECONDS   random-overwrite time per unit size (default 30)
#   E2E_THIN_LIVE      live percentage of the physical size to fill to (default 80)
#   E2E_THIN_VERIFY    bytes of the verified overwrite pass (default 64M)
#   E2E_THIN_GROWTH    16k: live after the overwrites at most this percentage
#                      of live after the fill (default 115)
#   E2E_THIN_LOGICAL   logical size of the copy's volumes (default 1G)
#   E2E_THIN_OW_LOGICAL, E2E_THIN_PHYS_MB  logical size and physical MiB of
#                      the 4k/16k volumes (default 2G and 600, the reported
#                      shape: at 1G/300M one build passed that failed here)
#   E2E_THIN_MIN_IOPS  floor for the overwrites' IOPS (default 200; a roomy
#                      volume does tens of thousands here: below the floor the
#                      volume is stuck, not slow)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy fio tar cmp
fio --enghelp=nbd >/dev/null 2>&1 || skip "this fio has no nbd ioengine"
need_server
is_cvol || skip "cvol only: a thin volume has no stand-in"

PARTS=${E2E_THIN_PARTS:-copy copy-defer 4k 16k}
MB=${E2E_THIN_MB:-480}
SECS=${E2E_THIN_SECONDS:-30}
LIVE_PCT=${E2E_THIN_LIVE:-80}
VERIFY_SIZE=${E2E_THIN_VERIFY:-64M}
MIN_IOPS=${E2E_THIN_MIN_IOPS:-200}
GROWTH=${E2E_THIN_GROWTH:-115}
LOGICAL=${E2E_THIN_LOGICAL:-1G}
OW_LOGICAL=${E2E_THIN_OW_LOGICAL:-2G}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# stat_to FILE -- cvol stat --json of $VOL into FILE (no fail: used on failure paths too)
stat_to() { "$CVOL" stat "$VOL" --json >"$1" 2>"$1.err"; }

# show_stat LABEL FILE -- one line of the space figures
show_stat() {
    "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[2]))
m = lambda k: "%.1f" % (d.get(k, 0) / 2**20)
print("    %s: physical %s MiB, used %s, live %s, dead %s, stored %s, free segments %s, "
      "deferred units %s, cleaned segments %s, cleaner relocated %s MiB, WA %.2f, "
      "space waits %s, refusals %s, pressure %s"
      % (sys.argv[1], m("physical_size_bytes"), m("physical_used_bytes"), m("live_bytes"),
         m("dead_bytes"), m("stored_bytes"), d.get("segments_free"), d.get("deferred_units"),
         d.get("cleaner_segments_cleaned"), m("cleaner_bytes_relocated"),
         d.get("write_amplification", 0), d.get("space_waits"), d.get("space_refusals"),
         d.get("space_pressure")))
PYEOF
}

# fail_at STEP MESSAGE -- print the volume's stat and the server's warnings
# and errors (why a request failed: the engine error behind an EIO, a
# panic, a write refused for space), and fail naming the step
fail_at() {
    local st=$E2E_TMP/fail-stat.json
    if stat_to "$st"; then
        show_stat "stat at the failure" "$st"
    else
        log "cvol stat failed too: $(cat "$st.err")"
    fi
    if [[ -n "${SRV_ERR:-}" && -s "$SRV_ERR" ]]; then
        grep -E 'WARN|ERROR|panick' "$SRV_ERR" | head -n 20 | sed 's/^/    server: /' || true
    fi
    fail "$1: $2"
}

# fio_run NAME STEP fio-args... -- fio through the current server, json output
# in $E2E_TMP/NAME.json; fails naming STEP with fio's error lines. Give every
# run its own --randseed: the seed also makes the buffer contents, and runs
# with the same seed write the same data (which dedup would then store once).
fio_run() {
    local name=$1 stepname=$2 rc=0
    shift 2
    fio --name="$name" --ioengine=nbd --uri="$SRV_URI" \
        --buffer_compress_percentage=60 --refill_buffers \
        --output-format=json --output="$E2E_TMP/$name.json" "$@" \
        2>"$E2E_TMP/$name.err" || rc=$?
    if ((rc != 0)) || grep -qiE 'verify: bad|bad magic|crc32c: verify failed' "$E2E_TMP/$name.err"; then
        grep -vE '^\s*$' "$E2E_TMP/$name.err" | head -n 15 | sed 's/^/    fio: /'
        local done_
        done_=$(fio_field "$name" '"%.1f MiB written in %.1f s" % (j["write"]["io_bytes"] / 2**20, j["write"]["runtime"] / 1000)' 2>/dev/null) ||
            done_="fio wrote no report"
        fail_at "$stepname" "fio exited $rc ($done_)"
    fi
}

# fio_field NAME EXPR -- a figure of jobs[0] of a fio json output (python expr on j)
fio_field() {
    "$PY" - "$E2E_TMP/$1.json" "$2" <<'PYEOF'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
j = d["jobs"][0]
print(eval(sys.argv[2]))
PYEOF
}

# ------------------------------------------------------------------ copy ----
COPY_IMG="" COPY_PHYS_MB=""
# copy_measure -- make the data and size the copy's volume (once)
copy_measure() {
    [[ -z "$COPY_IMG" ]] || return 0
    local dirs=() d
    for d in /usr/include /usr/share/javascript /usr/share/package-lists /usr/share/doc \
        /usr/lib/python3* /usr/share/perl /usr/share/vim /usr/share/i18n /usr/share/locale \
        /usr/share /usr/lib; do
        [[ -d "$d" ]] && dirs+=("$d")
    done
    tar_image thin-usr "$MB" "${dirs[@]}"
    COPY_IMG=$TAR_IMAGE

    step "copy: measure what $MB MiB of real data takes compressed inline (--inline-cpu off)"
    VOL=$E2E_TMP/measure.cvol
    make_volume "$VOL" "$LOGICAL"
    start_server "$VOL" --inline-cpu off
    nbdcopy --flush "$COPY_IMG" "$SRV_URI" || fail_at "copy (measuring)" "nbdcopy into a roomy volume failed"
    stat_to "$E2E_TMP/measure.json" || fail "cvol stat: $(cat "$E2E_TMP/measure.json.err")"
    show_stat "compressed inline" "$E2E_TMP/measure.json"
    local used
    used=$(json_get "$E2E_TMP/measure.json" physical_used_bytes)
    stop_server
    rm -f "$VOL"
    # Physical size: the inline-compressed copy takes 62% of it.
    COPY_PHYS_MB=$(((used * 100 / 62 + 1048575) / 1048576))
    local ratio
    ratio=$(awk -v a="$((MB * 1048576))" -v p="$COPY_PHYS_MB" 'BEGIN { printf "%.2f", a / (p * 1048576) }')
    log "copy: physical size ${COPY_PHYS_MB} MiB: the data is ${ratio}x it, compressed inline $(mib "$used")"
    awk -v r="$ratio" 'BEGIN { exit !(r >= 1.5) }' ||
        log "note: this machine's /usr compresses poorly; the copy puts less pressure on the volume than intended"
}

# part_copy NAME [serve args...] -- the copy into the thin volume, read back, check
part_copy() {
    local name=$1
    shift
    copy_measure
    local img=$COPY_IMG phys_mb=$COPY_PHYS_MB bytes=$((MB * 1048576)) flags=${*:-default flags}
    step "$name: $MB MiB into a $LOGICAL volume of ${phys_mb} MiB, $flags, nbdcopy --flush"
    VOL=$E2E_TMP/$name.cvol
    make_volume "$VOL" "$LOGICAL" --physical-size "${phys_mb}M"
    start_server "$VOL" "$@"
    local t0 t1 rc=0
    t0=$(now)
    nbdcopy --flush "$img" "$SRV_URI" 2>"$E2E_TMP/nbdcopy.err" || rc=$?
    t1=$(now)
    if ((rc != 0)); then
        sed 's/^/    /' "$E2E_TMP/nbdcopy.err"
        fail_at "$name (nbdcopy --flush of $MB MiB into ${phys_mb} MiB, $flags)" "nbdcopy exited $rc"
    fi
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    stat_to "$E2E_TMP/copy.json" || fail "cvol stat: $(cat "$E2E_TMP/copy.json.err")"
    show_stat "after the copy" "$E2E_TMP/copy.json"
    log "RESULT $name: $MB MiB in ${secs}s ($(mbps "$bytes" "$secs") MiB/s), $(json_get "$E2E_TMP/copy.json" deferred_units) units deferred"

    step "$name: read back exact"
    nbdcopy "$SRV_URI" "$E2E_TMP/out.img" || fail_at "$name (read back)" "nbdcopy out failed"
    cmp -n "$bytes" "$img" "$E2E_TMP/out.img" || fail "$name: data reads back wrong"
    rm -f "$E2E_TMP/out.img"
    stop_server
    cvol_check "$VOL"
    rm -f "$VOL"
    log "$name: passed"
}

# --------------------------------------------------- random overwrites ----
# part_overwrite UNIT [--unit-size UNIT]
part_overwrite() {
    local unit=$1
    shift
    local phys_mb=${E2E_THIN_PHYS_MB:-600} phys
    phys=$((phys_mb * 1048576))
    VOL=$E2E_TMP/ow-$unit.cvol
    step "$unit: $OW_LOGICAL volume of ${phys_mb} MiB, --inline-cpu off $*, fill to ${LIVE_PCT}% live"
    make_volume "$VOL" "$OW_LOGICAL" --physical-size "${phys_mb}M"
    start_server "$VOL" --inline-cpu off "$@"

    # Fill in rounds, each sized from the live bytes per byte written in the
    # round before (the first one: 64 MiB), until live is within 2% of the
    # target.
    local target=$((phys * LIVE_PCT / 100)) fill=0 next=$((64 * 1048576)) live=0 prev_fill=0 prev_live=0 round
    for round in 1 2 3 4 5 6; do
        fio_run "fill$round-$unit" "$unit (fill)" --rw=write --bs=128k --iodepth=8 \
            --offset="$fill" --size=$((next - fill)) --randseed=$((4600 + round))
        prev_fill=$fill prev_live=$live fill=$next
        stat_to "$E2E_TMP/fill.json" || fail "cvol stat: $(cat "$E2E_TMP/fill.json.err")"
        live=$(json_get "$E2E_TMP/fill.json" live_bytes)
        next=$(awk -v f="$fill" -v l="$live" -v pf="$prev_fill" -v pl="$prev_live" -v t="$target" \
            'BEGIN { r = (l - pl) / (f - pf); if (r <= 0) r = l / f
                     n = f + (t - l) / r; n = int(n / 4194304) * 4194304; print n }')
        ((next <= $(to_bytes "$OW_LOGICAL"))) || next=$(to_bytes "$OW_LOGICAL")
        log "$unit: filled $(mib "$fill"): $(mib "$live") live"
        ((live * 100 < target * 98 && next > fill)) || break
    done
    stat_to "$E2E_TMP/fill.json" || fail "cvol stat: $(cat "$E2E_TMP/fill.json.err")"
    show_stat "after filling $(mib "$fill")" "$E2E_TMP/fill.json"
    local live_fill media0 client0 reloc0
    live_fill=$(json_get "$E2E_TMP/fill.json" live_bytes)
    media0=$(json_get "$E2E_TMP/fill.json" media_bytes_written)
    client0=$(json_get "$E2E_TMP/fill.json" client_bytes_written)
    reloc0=$(json_get "$E2E_TMP/fill.json" cleaner_bytes_relocated)
    log "$unit: live after the fill $(mib "$live_fill") ($((live_fill * 100 / phys))% of the physical size)"

    step "$unit: random 4 KiB overwrites of the $(mib "$fill") for ${SECS}s at iodepth 32"
    local t0 secs
    t0=$(date +%s)
    fio_run "ow-$unit" "$unit (random overwrites at ${LIVE_PCT}% live)" --rw=randwrite --bs=4k \
        --iodepth=32 --offset=0 --size="$fill" --time_based --runtime="$SECS" --norandommap --randseed=4610
    stat_to "$E2E_TMP/ow.json" || fail "cvol stat: $(cat "$E2E_TMP/ow.json.err")"
    secs=$(($(date +%s) - t0))
    show_stat "after the overwrites" "$E2E_TMP/ow.json"
    local iops wbytes maxlat live_ow media1 client1 reloc1
    iops=$(fio_field "ow-$unit" 'int(j["write"]["iops"])')
    wbytes=$(fio_field "ow-$unit" 'j["write"]["io_bytes"]')
    maxlat=$(fio_field "ow-$unit" '"%.2f" % (j["write"]["clat_ns"]["max"] / 1e9)')
    live_ow=$(json_get "$E2E_TMP/ow.json" live_bytes)
    media1=$(json_get "$E2E_TMP/ow.json" media_bytes_written)
    client1=$(json_get "$E2E_TMP/ow.json" client_bytes_written)
    reloc1=$(json_get "$E2E_TMP/ow.json" cleaner_bytes_relocated)
    local res
    res=$(awk -v m0="$media0" -v m1="$media1" -v c0="$client0" -v c1="$client1" \
        -v r0="$reloc0" -v r1="$reloc1" -v l0="$live_fill" -v l1="$live_ow" 'BEGIN {
            dm = m1 - m0; dc = c1 - c0; dr = r1 - r0
            wa = dc > 0 ? dm / dc : 0
            cwa = dm - dr > 0 ? dm / (dm - dr) : 0
            printf "media/client %.2f, cleaner %.2f (media written per byte of new records), live %.2fx", wa, cwa, l1 / l0 }')
    log "RESULT $unit: $iops IOPS of 4 KiB random overwrites at ${LIVE_PCT}% live, $(mib "$wbytes") written in ${SECS}s;" \
        "write amplification: $res ($(mib "$live_fill") -> $(mib "$live_ow")); slowest write ${maxlat}s, fio took ${secs}s"
    ((iops >= MIN_IOPS)) ||
        fail "$unit: only $iops IOPS of random overwrites at ${LIVE_PCT}% live (floor $MIN_IOPS; slowest write ${maxlat}s): the volume is stuck cleaning"

    if [[ "$unit" == 16k ]]; then
        ((live_ow * 100 <= live_fill * GROWTH)) ||
            fail "$unit: live bytes grew from $(mib "$live_fill") to $(mib "$live_ow") (more than $GROWTH%) while the logical data stayed the same: partly overwritten units stay wholly live"
    fi

    step "$unit: $VERIFY_SIZE of random 4 KiB overwrites, then fio verifies every block's last write"
    local vargs=(--rw=randwrite --bs=4k --iodepth=32 --offset=0 --size="$fill" --io_size="$VERIFY_SIZE"
        --randseed=46 --verify=crc32c --verify_fatal=1 --verify_dump=0 --do_verify=1 --verify_state_save=0)
    fio_run "verify-$unit" "$unit (verified overwrites)" "${vargs[@]}"
    log "$unit: verified $(fio_field "verify-$unit" 'j["read"]["total_ios"]') blocks"
    step "$unit: restart, the same blocks verified again"
    stop_server
    start_server "$VOL" --inline-cpu off "$@"
    fio_run "reverify-$unit" "$unit (verify after a restart)" "${vargs[@]}" --verify_only=1
    log "$unit: verified $(fio_field "reverify-$unit" 'j["read"]["total_ios"]') blocks after the restart"
    stop_server
    cvol_check "$VOL"
    rm -f "$VOL"
    log "$unit: passed"
}

for p in $PARTS; do
    case $p in
        copy) part_copy copy ;;
        copy-defer) part_copy copy-defer --inline-cpu 0 ;;
        4k) part_overwrite 4k --unit-size 4K ;;
        16k) part_overwrite 16k ;;
        *) fail "unknown part '$p' in E2E_THIN_PARTS (known: copy copy-defer 4k 16k)" ;;
    esac
done
pass "$PARTS"
