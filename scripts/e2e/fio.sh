#!/usr/bin/env bash
# fio (ioengine=nbd): random writes with a 4k/64k block-size mix at iodepth 16
# with crc32c verification, then a separate verify-only read pass after the
# server has been restarted.
#
#   E2E_FIO_SIZE  amount of data written/verified (default 256M)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need fio
fio --enghelp=nbd >/dev/null 2>&1 || skip "this fio has no nbd ioengine"
need_server

SIZE=${E2E_FIO_SIZE:-256M}
VOL=$E2E_TMP/vol.cvol

# Identical job parameters for both passes: the verify-only pass regenerates
# the same offsets, block sizes and buffer contents from the fixed seed.
run_fio() {
    local name=$1 rc=0
    shift
    fio --name="$name" --ioengine=nbd --uri="$SRV_URI" \
        --rw=randwrite --bssplit=4k/50:64k/50 --iodepth=16 --size="$SIZE" \
        --randrepeat=1 --randseed=20240611 \
        --buffer_compress_percentage=50 --buffer_compress_chunk=4k \
        --verify=crc32c --verify_fatal=1 --verify_dump=0 --do_verify=1 \
        --verify_state_save=0 \
        --output="$E2E_TMP/$name.txt" "$@" || rc=$?
    grep -E 'IOPS|READ:|WRITE:|err=' "$E2E_TMP/$name.txt" | sed 's/^/    /' || true
    if [[ $rc -ne 0 ]] || grep -qiE 'verify: bad|verify failed|bad magic|err= *[1-9]' "$E2E_TMP/$name.txt"; then
        cat "$E2E_TMP/$name.txt"
        fail "fio $name failed (exit $rc)"
    fi
}

# Physical size 1.5x the logical size: fio's buffers are only 50% compressible
# and a volume whose backing store equals its logical size cannot hold a full
# logical size of poorly compressible data plus metadata.
make_volume "$VOL" "$SIZE" --physical-size "$(($(to_bytes "$SIZE") * 3 / 2 / 1048576))M"
start_server "$VOL"

step "fio randwrite + verify=crc32c, bs 4k/64k, iodepth 16, $SIZE"
t0=$(date +%s)
run_fio pass1-randwrite
log "write+verify pass took $(($(date +%s) - t0))s"

step "restart the server, verify-only pass"
stop_server
start_server "$VOL"
t0=$(date +%s)
run_fio pass2-readcheck --verify_only=1
log "verify-only pass took $(($(date +%s) - t0))s"
stop_server
cvol_check "$VOL"
pass
