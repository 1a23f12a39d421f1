#!/usr/bin/env bash
# TRIM returns space to the host: after a volume full of incompressible data
# is discarded and flushed, the cleaner reclaims its segments and punches
# holes in the backing file, so `du` of the file falls. Then the volume takes
# new data again and `cvol check` is clean.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need qemu-io
need_server
is_cvol || skip "checks cvol's backing file"

VOL=$E2E_TMP/vol.cvol
make_volume "$VOL" 256M
start_server "$VOL"

du_kib() { du -k "$VOL" | cut -f1; }

step "fill 160 MiB with incompressible data"
head -c $((160 << 20)) /dev/urandom >"$E2E_TMP/random.bin"
nbdcopy "$E2E_TMP/random.bin" "$SRV_URI" || fail "nbdcopy failed"
full=$(du_kib)
log "backing file uses $((full >> 10)) MiB"
((full > 150 * 1024)) || fail "expected at least 150 MiB allocated, got $((full >> 10)) MiB"

step "discard everything and flush"
qemu-io -f raw -c 'discard 0 256M' -c 'flush' "$SRV_URI" >/dev/null || fail "discard failed"
# shellcheck disable=SC2016
wait_until 10 "du of the backing file to fall below $((full >> 12)) MiB" \
    bash -c '(( $(du -k "$0" | cut -f1) < $1 ))' "$VOL" $((full / 4))
log "after TRIM the backing file uses $(($(du_kib) >> 10)) MiB"
cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
mapped=$(json_get "$E2E_TMP/stat.json" mapped_bytes)
((mapped == 0)) || fail "mapped_bytes $mapped after discarding everything"

step "the freed space takes new data"
nbdcopy "$E2E_TMP/random.bin" "$SRV_URI" || fail "second nbdcopy failed"
nbdcopy "$SRV_URI" "$E2E_TMP/out.bin" || fail "reading back failed"
cmp -n $((160 << 20)) "$E2E_TMP/out.bin" "$E2E_TMP/random.bin" || fail "data differs"
stop_server
cvol_check "$VOL"

step "block device backing: discards reach the device (a loop device over a sparse file)"
if ! command -v losetup >/dev/null || [[ $(id -u) -ne 0 ]]; then
    log "skipped: needs root and losetup"
else
    truncate -s 128M "$E2E_TMP/disk.img"
    LOOP=$(losetup -f --show "$E2E_TMP/disk.img") || fail "losetup failed"
    reg_loop "$LOOP"
    "$CVOL" create "$LOOP" --size 256M >/dev/null || fail "cvol create on $LOOP failed"
    start_server "$LOOP"
    head -c $((64 << 20)) "$E2E_TMP/random.bin" >"$E2E_TMP/random64.bin"
    nbdcopy "$E2E_TMP/random64.bin" "$SRV_URI" || fail "nbdcopy to the block device volume failed"
    sync
    disk_full=$(du -k "$E2E_TMP/disk.img" | cut -f1)
    qemu-io -f raw -c 'discard 0 256M' -c 'flush' "$SRV_URI" >/dev/null || fail "discard failed"
    # shellcheck disable=SC2016
    wait_until 10 "the loop device's file to shrink below $((disk_full >> 12)) MiB" \
        bash -c 'sync; (( $(du -k "$0" | cut -f1) < $1 ))' "$E2E_TMP/disk.img" $((disk_full / 4))
    log "loop device file: $((disk_full >> 10)) MiB -> $(($(du -k "$E2E_TMP/disk.img" | cut -f1) >> 10)) MiB"
    stop_server
    cvol_check "$LOOP"
    losetup -d "$LOOP" || fail "losetup -d failed"
    unreg_loop "$LOOP"
fi
pass "du $((full >> 10)) MiB -> reclaimed after TRIM; discards passed to a block device"
