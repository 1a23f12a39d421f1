#!/usr/bin/env bash
# Deduplication: write twenty clones of one real image (a tar of
# /usr/share/doc) at different offsets through libnbd; they must cost about
# one copy (stored_bytes within 10% of one clone's) and read back exact.
# Overwrite one clone; the others stay intact across a restart; cvol check
# passes.  A volume created with --dedup off stores every copy.
#
#   E2E_DEDUP_MB      image size in MiB (default 16)
#   E2E_DEDUP_CLONES  number of clones (default 20)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need tar
need_nbd_python
need_server

MB=${E2E_DEDUP_MB:-16}
CLONES=${E2E_DEDUP_CLONES:-20}
BYTES=$((MB * 1024 * 1024))
VOL=$E2E_TMP/vol.cvol
CLIENT=$E2E_DIR/py/clones_client.py
LAST=$((CLONES - 1))
SIZE=$(((CLONES + 1) * (MB + 1)))M

tar_image doc "$MB" /usr/share/doc /usr/share
IMG=$TAR_IMAGE

stored() { cvol_stat_json "$VOL" "$E2E_TMP/stat.json"; json_get "$E2E_TMP/stat.json" stored_bytes; }

step "$CLONES clones of a $MB MiB image, dedup on (default)"
make_volume "$VOL" "$SIZE"
start_server "$VOL"
"$NBD_PY" "$CLIENT" write "$SRV_URI" "$IMG" 0 0 || fail "writing clone 0"
if is_cvol; then one=$(stored); fi
"$NBD_PY" "$CLIENT" write "$SRV_URI" "$IMG" 1 "$LAST" || fail "writing clones"
if is_cvol; then
    all=$(stored)
    saved=$(json_get "$E2E_TMP/stat.json" dedup_saved_bytes)
    log "stored_bytes: one clone $one, $CLONES clones $all; dedup_saved_bytes $saved"
    ((all * 10 < one * 11)) || fail "$CLONES clones stored $all bytes, one clone $one: dedup is not working"
    ((saved > (CLONES - 2) * BYTES)) || fail "dedup_saved_bytes $saved < $((CLONES - 2)) copies"
else
    skip_step "stored_bytes of $CLONES clones vs one"
fi
"$NBD_PY" "$CLIENT" verify "$SRV_URI" "$IMG" 0 "$LAST" || fail "clones read back wrong"

step "overwrite clone 0, the others stay intact across a restart"
"$NBD_PY" "$CLIENT" overwrite "$SRV_URI" "$IMG" 0 || fail "overwriting clone 0"
"$NBD_PY" "$CLIENT" verify "$SRV_URI" "$IMG" 1 "$LAST" || fail "clones wrong after overwriting clone 0"
stop_server
cvol_check "$VOL"
start_server "$VOL"
"$NBD_PY" "$CLIENT" verify-overwritten "$SRV_URI" "$IMG" 0 || fail "clone 0 wrong after restart"
"$NBD_PY" "$CLIENT" verify "$SRV_URI" "$IMG" 1 "$LAST" || fail "clones wrong after restart"
stop_server

if is_cvol; then
    step "--dedup off stores every copy"
    rm -f "$VOL"
    make_volume "$VOL" "$SIZE" --dedup off
    start_server "$VOL"
    "$NBD_PY" "$CLIENT" write "$SRV_URI" "$IMG" 0 3 || fail "writing 4 clones"
    four=$(stored)
    "$NBD_PY" "$CLIENT" verify "$SRV_URI" "$IMG" 0 3 || fail "clones read back wrong (dedup off)"
    stop_server
    log "dedup off: 4 clones stored $four bytes"
    ((four > 3 * one)) || fail "dedup off stored only $four bytes for 4 clones (one: $one)"
    cvol_check "$VOL"
    pass "$CLONES x $MB MiB clones stored in $all bytes (one clone: $one; dedup off, 4 clones: $four)"
else
    pass "$CLONES x $MB MiB clones read back exact"
fi
