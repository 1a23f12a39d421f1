#!/usr/bin/env bash
# Dedup window: a copy of data written long before, far past what the
# exact index holds (`--dedup-memory 1M`: about 32 MiB of blocks), is
# still deduplicated through the sampled hooks and the fingerprint tables;
# also after a restart (the hook index loaded back). Written with nbdcopy
# and libnbd, read back with nbdcopy and compared byte for byte; cvol check
# passes.
#
#   E2E_DW_MB   MiB of distinct data written first (default 256; the copies
#               are a quarter of it each)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy cmp
need_nbd_python
need_server
is_cvol || skip "the dedup window is cvol's (a stand-in server has none)"

MB=${E2E_DW_MB:-256}
Q=$((MB / 4))
MIB=1048576
VOL=$E2E_TMP/vol.cvol
DATA=$E2E_TMP/data.img
FIRST_COPY=$((2 * MB))
LAST_COPY=$((3 * MB))

step "$MB MiB of distinct, 60%-compressible blocks"
"$PY" - "$DATA" "$MB" <<'EOF'
import hashlib, sys
out, mb = sys.argv[1], int(sys.argv[2])
with open(out, "wb") as f:
    for i in range(mb * 256):
        head = hashlib.shake_128(i.to_bytes(8, "little")).digest(1638)
        f.write(head + bytes(4096 - 1638))
EOF

# write_at FILE_OFFSET_MIB LEN_MIB DEST_OFFSET_MIB: one 1 MiB request at a time.
write_at() {
    "$NBD_PY" - "$SRV_URI" "$DATA" "$1" "$2" "$3" <<'EOF' || fail "writing a copy"
import nbd, sys
uri, data, src, n, dst = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
h = nbd.NBD()
h.connect_uri(uri)
with open(data, "rb") as f:
    f.seek(src << 20)
    for k in range(n):
        h.pwrite(f.read(1 << 20), (dst + k) << 20)
h.flush()
h.shutdown()
EOF
}

hits() { cvol_stat_json "$VOL" "$E2E_TMP/stat.json"; json_get "$E2E_TMP/stat.json" dedup_hits; }

# copy_found WHAT SRC_MIB DST_MIB: copies a quarter, asserts >= 90% found.
copy_found() {
    local before after found
    before=$(hits)
    write_at "$2" "$Q" "$3"
    after=$(hits)
    found=$((after - before))
    log "$1: $found of $((Q * 256)) blocks deduplicated"
    ((found * 10 >= Q * 256 * 9)) || fail "$1: only $found of $((Q * 256)) blocks deduplicated"
}

make_volume "$VOL" "$((4 * MB))M" --physical-size "$((2 * MB))M"
start_server "$VOL" --dedup-memory 1M
nbdcopy --flush "$DATA" "$SRV_URI" || fail "nbdcopy into the volume"

step "a copy of the oldest quarter"
copy_found "copy of the first $Q MiB" 0 "$FIRST_COPY"
stop_server
cvol_check "$VOL"

step "after a restart: a copy of the newest quarter"
start_server "$VOL" --dedup-memory 1M
loaded() {
    cvol_stat_json "$VOL" "$E2E_TMP/load.json"
    [[ $(json_get "$E2E_TMP/load.json" dedup_hook_load) == ready ]]
}
wait_until 60 "the hook index loaded" loaded
copy_found "copy of the last $Q MiB" "$((MB - Q))" "$LAST_COPY"

step "read back"
OUT=$E2E_TMP/out.img
nbdcopy "$SRV_URI" "$OUT" || fail "nbdcopy out of the volume"
cmp -n $((MB * MIB)) "$DATA" "$OUT" || fail "the original reads back wrong"
cmp -i 0:$((FIRST_COPY * MIB)) -n $((Q * MIB)) "$DATA" "$OUT" || fail "the first copy reads back wrong"
cmp -i $(((MB - Q) * MIB)):$((LAST_COPY * MIB)) -n $((Q * MIB)) "$DATA" "$OUT" ||
    fail "the last copy reads back wrong"
stop_server
cvol_check "$VOL"
pass "copies of $Q MiB of old data deduplicated (>= 90%), before and after a restart, read back exact"
