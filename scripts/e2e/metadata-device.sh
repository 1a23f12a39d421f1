#!/usr/bin/env bash
# `cvol create --metadata-device`: the volume's map, checkpoints
# and fingerprint tables on a second file. Checks, through real clients:
# - kill9.sh's rounds (kill -9 under flushed writes, restart, every flushed
#   write survives, `cvol check` passes) on a volume with a small metadata
#   device, so that it is cleaned as it fills;
# - qemu-io writes and reads back a pattern; `stat --json` reports the
#   metadata device (path, size, use) and its bytes are in use;
# - a moved metadata device: serve and check refuse with a message naming
#   --metadata-device, and work when given it; another volume's metadata
#   device and the volume itself are refused; nothing is written to them.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol only"
need qemu-io
need_server

step "kill -9 rounds with the metadata on a 24 MiB device"
E2E_KILL9_METADATA=24M E2E_KILL9_ROUNDS=2 E2E_KILL9_SYNC_ROUND=0 E2E_KILL9_TERM_ROUND=0 \
    bash "$E2E_DIR/kill9.sh" || fail "kill9 rounds with a metadata device failed"

VOL=$E2E_TMP/vol.cvol
META=$E2E_TMP/meta.img
step "create with --metadata-device, write and read back through qemu-io"
make_volume "$VOL" 256M --metadata-device "$META"
start_server "$VOL"
qemu-io -f raw -c "write -P 0x3c 0 32M" -c flush "$SRV_URI" >/dev/null || fail "qemu-io write"
qemu-io -f raw -c "read -P 0x3c 0 32M" "$SRV_URI" >/dev/null || fail "qemu-io read-back"
stop_server
cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
"$PY" - "$E2E_TMP/stat.json" "$META" <<'PY' || fail "stat --json does not report the metadata device"
import json, os, sys
s = json.load(open(sys.argv[1]))
assert s["metadata_device"] == os.path.abspath(sys.argv[2]), s["metadata_device"]
assert s["metadata_size_bytes"] == os.path.getsize(sys.argv[2]), s["metadata_size_bytes"]
assert 0 < s["metadata_used_bytes"] <= s["metadata_size_bytes"], s
assert s["metadata_free_bytes"] > 0, s
assert s["physical_used_bytes"] > s["metadata_used_bytes"], s
PY
cvol_check "$VOL"

step "a moved metadata device is refused, then found with --metadata-device"
mv "$META" "$META.moved"
rc=0
"$CVOL" check "$VOL" >"$E2E_TMP/moved.log" 2>&1 || rc=$?
((rc == 2)) || fail "check of a volume whose metadata device moved exited $rc"
grep -q -- "--metadata-device" "$E2E_TMP/moved.log" || fail "no hint: $(cat "$E2E_TMP/moved.log")"
"$CVOL" check "$VOL" --metadata-device "$META.moved" >/dev/null || fail "check --metadata-device"
start_server "$VOL" --metadata-device "$META.moved"
qemu-io -f raw -c "read -P 0x3c 0 32M" "$SRV_URI" >/dev/null || fail "read-back after the move"
"$CVOL" stat "$VOL" --json >"$E2E_TMP/moved.json" || fail "stat of the served volume"
"$PY" - "$E2E_TMP/moved.json" "$META.moved" <<'PY' || fail "stat does not name the device it was opened at"
import json, os, sys
assert json.load(open(sys.argv[1]))["metadata_device"] == os.path.abspath(sys.argv[2])
PY
stop_server

step "another volume's metadata device, and the volume itself, are refused untouched"
make_volume "$E2E_TMP/other.cvol" 64M --metadata-device "$E2E_TMP/other-meta.img"
before=$(sha256sum "$E2E_TMP/other-meta.img" | cut -d' ' -f1)
rc=0
"$CVOL" serve "$VOL" --socket "$E2E_TMP/x.sock" --metadata-device "$E2E_TMP/other-meta.img" \
    >"$E2E_TMP/other.log" 2>&1 || rc=$?
((rc == 2)) || fail "serve with another volume's metadata device exited $rc"
grep -q "another volume" "$E2E_TMP/other.log" || fail "unclear refusal: $(cat "$E2E_TMP/other.log")"
[[ $(sha256sum "$E2E_TMP/other-meta.img" | cut -d' ' -f1) == "$before" ]] ||
    fail "the other volume's metadata device was written"
rc=0
"$CVOL" check "$VOL" --metadata-device "$VOL" >"$E2E_TMP/self.log" 2>&1 || rc=$?
((rc == 2)) || fail "the volume as its own metadata device: exit $rc"
cvol_check "$E2E_TMP/other.cvol"
pass "kill -9 rounds, qemu-io, stat keys, a moved device, refusals"
