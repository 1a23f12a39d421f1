#!/usr/bin/env bash
# nbdcopy: copy a few hundred MB of real, compressible data into a volume and
# back out; sha256 must match; the volume must achieve a reduction ratio > 1.3
# and pass `cvol check`.  Throughput is printed, and compared (informational
# only) against qemu-nbd serving a raw file.
#
#   E2E_COPY_MB       data size in MiB (default 300)
#   E2E_COPY_SRC      directories tarred to make the data (default "/usr/share /usr/lib")
#   E2E_COPY_COMPARE  0 to skip the qemu-nbd comparison (default 1)
#   E2E_MIN_RATIO     minimum reduction_ratio (default 1.3)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy tar sha256sum
need_server

MB=${E2E_COPY_MB:-300}
SRC_DIRS=${E2E_COPY_SRC:-/usr/share /usr/lib}
COMPARE=${E2E_COPY_COMPARE:-1}
MIN_RATIO=${E2E_MIN_RATIO:-1.3}
BYTES=$((MB * 1024 * 1024))
VOL=$E2E_TMP/vol.cvol
OUT=$E2E_TMP/out.bin

# ------------------------------------------------------------ test data ----
mkdir -p "$E2E_CACHE_DIR"
DATA=$E2E_CACHE_DIR/data-${MB}M.bin
if [[ ! -s "$DATA" || $(stat -c %s "$DATA") -ne $BYTES ]]; then
    step "generating ${MB} MiB of data: tar of $SRC_DIRS, truncated"
    tmp=$(mktemp "$E2E_CACHE_DIR/data.XXXXXX")
    # tar is cut off by head (SIGPIPE), so ignore the pipeline status.
    # shellcheck disable=SC2086  # word splitting of SRC_DIRS is intended
    (set +o pipefail; tar -cf - --sort=name $SRC_DIRS 2>/dev/null | head -c "$BYTES" >"$tmp") || true
    got=$(stat -c %s "$tmp")
    if ((got != BYTES)); then
        rm -f "$tmp"
        fail "only $got bytes of data available from '$SRC_DIRS' (wanted $BYTES); set E2E_COPY_SRC or E2E_COPY_MB"
    fi
    mv "$tmp" "$DATA"
    sha256sum "$DATA" | cut -d' ' -f1 >"$DATA.sha256"
fi
[[ -s "$DATA.sha256" ]] || sha256sum "$DATA" | cut -d' ' -f1 >"$DATA.sha256"
WANT_SHA=$(cat "$DATA.sha256")
log "data: $DATA ($MB MiB, sha256 $WANT_SHA)"

# copy_in_out -- copies $DATA into $SRV_URI and back into $OUT; sets RATE_IN,
# RATE_OUT (MiB/s) and checks the sha256.
copy_in_out() {
    local label=$1 t0 t1 got
    t0=$(now)
    nbdcopy --flush "$DATA" "$SRV_URI" || fail "$label: nbdcopy $DATA -> $SRV_URI failed"
    t1=$(now)
    RATE_IN=$(mbps "$BYTES" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')")
    rm -f "$OUT"
    t0=$(now)
    nbdcopy "$SRV_URI" "$OUT" || fail "$label: nbdcopy $SRV_URI -> $OUT failed"
    t1=$(now)
    RATE_OUT=$(mbps "$BYTES" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')")
    got=$(sha256sum "$OUT" | cut -d' ' -f1)
    rm -f "$OUT"
    [[ "$got" == "$WANT_SHA" ]] || fail "$label: sha256 of data read back ($got) != source ($WANT_SHA)"
    log "$label: in $RATE_IN MiB/s, out $RATE_OUT MiB/s, sha256 identical"
}

# ----------------------------------------------------------------- cvol ----
step "copy into and out of $E2E_SERVER"
make_volume "$VOL" "${MB}M"
if is_cvol; then
    # The ratio is checked right after the copy, with no idle time: with
    # deferred compression (a copy at full speed can spend the inline CPU
    # budget) part of it would still be raw, waiting for background
    # recompression. This checks inline compression.
    start_server "$VOL" --inline-cpu off
else
    start_server "$VOL"
fi
copy_in_out "$E2E_SERVER"
CVOL_IN=$RATE_IN
CVOL_OUT=$RATE_OUT
stop_server

if is_cvol; then
    step "cvol stat --json / cvol check after SIGTERM"
    cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
    cat "$E2E_TMP/stat.json"
    echo
    [[ $(json_get "$E2E_TMP/stat.json" logical_size_bytes) -eq $BYTES ]] ||
        fail "logical_size_bytes != $BYTES"
    ratio=$(json_get "$E2E_TMP/stat.json" reduction_ratio)
    log "reduction_ratio $ratio (file uses $(du -k "$VOL" | cut -f1) KiB on disk for $MB MiB of data)"
    awk -v r="$ratio" -v m="$MIN_RATIO" 'BEGIN { exit !(r > m) }' ||
        fail "reduction_ratio $ratio is not > $MIN_RATIO"
    cvol_check "$VOL"
else
    skip_step "cvol stat reduction_ratio / cvol check"
fi
rm -f "$VOL"

# ------------------------------------------------------------- qemu-nbd ----
if [[ "$COMPARE" == 1 ]] && command -v qemu-nbd >/dev/null; then
    step "same copy against qemu-nbd serving a raw file (informational)"
    RAW=$E2E_TMP/raw.img
    truncate -s "$BYTES" "$RAW"
    start_qemu_nbd "$RAW"
    copy_in_out qemu-nbd
    stop_server
    rm -f "$RAW"
    log "$(printf '%-10s %10s %10s' '' 'in MiB/s' 'out MiB/s')"
    log "$(printf '%-10s %10s %10s' "$E2E_SERVER" "$CVOL_IN" "$CVOL_OUT")"
    log "$(printf '%-10s %10s %10s' qemu-nbd "$RATE_IN" "$RATE_OUT")"
    log "$(printf '%-10s %10s %10s' ratio \
        "$(awk -v a="$CVOL_IN" -v b="$RATE_IN" 'BEGIN{printf "%.2f", a/b}')" \
        "$(awk -v a="$CVOL_OUT" -v b="$RATE_OUT" 'BEGIN{printf "%.2f", a/b}')")"
fi

pass "in $CVOL_IN MiB/s, out $CVOL_OUT MiB/s"
