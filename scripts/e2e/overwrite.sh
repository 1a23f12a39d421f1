#!/usr/bin/env bash
# Space reclamation: overwrite the whole volume several times with
# compressible (~4x) data on a volume whose physical size equals its logical
# size.  Live data stays ~1/4 of the backing store, so every pass must fit;
# running out of space means overwritten data is never reclaimed.  Then
# verify, restart, verify again, cvol check.
#
#   E2E_OVERWRITE_SIZE    volume size (default 64M)
#   E2E_OVERWRITE_PASSES  full overwrites (default 4)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need_nbd_python
need_server

SIZE=${E2E_OVERWRITE_SIZE:-64M}
PASSES=${E2E_OVERWRITE_PASSES:-4}
VOL=$E2E_TMP/vol.cvol
CLIENT=$E2E_DIR/py/overwrite_client.py

make_volume "$VOL" "$SIZE"
start_server "$VOL"

step "overwrite the whole $SIZE volume $PASSES times"
rc=0
"$NBD_PY" "$CLIENT" write "$SRV_URI" "$PASSES" || rc=$?
if is_cvol; then
    if "$CVOL" stat "$VOL" --json >"$E2E_TMP/stat.json" 2>/dev/null; then
        "$PY" - "$E2E_TMP/stat.json" <<'PYEOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("  stat: stored_bytes %.1f MiB, physical_used_bytes %.1f MiB of %.1f MiB"
      % (d.get("stored_bytes", 0) / 2**20, d.get("physical_used_bytes", 0) / 2**20,
         d.get("physical_size_bytes", 0) / 2**20))
PYEOF
    fi
fi
((rc == 0)) || fail "overwriting failed (live data is far below the physical size: space is not reclaimed)"
"$NBD_PY" "$CLIENT" verify "$SRV_URI" "$PASSES" || fail "data wrong after $PASSES overwrites"

step "restart and verify again"
stop_server
start_server "$VOL"
"$NBD_PY" "$CLIENT" verify "$SRV_URI" "$PASSES" || fail "data wrong after restart"
stop_server
cvol_check "$VOL"
pass "$PASSES x $SIZE"
