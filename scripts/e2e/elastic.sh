#!/usr/bin/env bash
# Elastic compression through real clients: a volume created with the
# default codec policy (auto) takes real data from nbdcopy at full speed
# (lz4 while busy), then, once clients are idle, background recompression
# rewrites it with zstd: stored_bytes must fall by at least 10% and the data
# must read back exact, also after a restart; random data is written raw by
# the probe; cvol check passes; stat reports bytes per codec.
#
#   E2E_ELASTIC_MB   real-data size in MiB (default 48)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy
need tar
need_nbd_python
need_server
is_cvol || skip "cvol only: elastic compression has no stand-in"

MB=${E2E_ELASTIC_MB:-48}
BYTES=$((MB * 1024 * 1024))
VOL=$E2E_TMP/vol.cvol
tar_image elastic "$MB" /usr/include /usr/share/doc /usr/bin
IMG=$TAR_IMAGE
RND=$E2E_TMP/random.bin
head -c $((4 * 1024 * 1024)) /dev/urandom >"$RND"

stat_get() { cvol_stat_json "$VOL" "$E2E_TMP/stat.json"; json_get "$E2E_TMP/stat.json" "$1"; }

step "write $MB MiB of real data at full speed (nbdcopy, 4 connections)"
make_volume "$VOL" $((MB * 2 + 16))M
[[ $("$CVOL" stat "$VOL" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["codec"])') == auto ]] ||
    fail "the default codec policy is not auto"
start_server "$VOL"
nbdcopy "$IMG" "$SRV_URI" || fail "nbdcopy in"
"$NBD_PY" - "$SRV_URI" "$RND" "$BYTES" <<'EOF' || fail "writing random data after the image"
import nbd, sys
h = nbd.NBD(); h.connect_uri(sys.argv[1])
data = open(sys.argv[2], "rb").read()
h.pwrite(data, int(sys.argv[3])); h.flush(); h.shutdown()
EOF
busy_stored=$(stat_get stored_bytes)
lz4=$(json_get "$E2E_TMP/stat.json" codec_lz4_blocks)
raw=$(json_get "$E2E_TMP/stat.json" probe_raw_blocks)
log "after the busy phase: stored $busy_stored bytes, $lz4 lz4 blocks, probe wrote $raw blocks raw"
((raw >= 1000)) || fail "the probe wrote only $raw of 1024 random blocks raw"

step "idle: background recompression rewrites the lz4 data with zstd"
recompressed() { (($(stat_get recompressed_blocks) * 10 >= lz4 * 9)); }
wait_until 180 "recompression of 90% of $lz4 lz4 blocks" recompressed
idle_stored=$(stat_get stored_bytes)
log "after idle: stored $idle_stored bytes ($(json_get "$E2E_TMP/stat.json" recompressed_blocks) blocks recompressed," \
    "zstd $(json_get "$E2E_TMP/stat.json" codec_zstd_bytes) B, lz4 $(json_get "$E2E_TMP/stat.json" codec_lz4_bytes) B)"
((idle_stored * 10 < busy_stored * 9)) || fail "stored bytes fell only from $busy_stored to $idle_stored"

step "read back exact, before and after a restart; cvol check"
verify() {
    nbdcopy "$SRV_URI" "$E2E_TMP/out.img" || fail "nbdcopy out"
    cmp -n "$BYTES" "$IMG" "$E2E_TMP/out.img" || fail "real data reads back wrong"
    cmp -n $((4 * 1024 * 1024)) -i 0:"$BYTES" "$RND" "$E2E_TMP/out.img" || fail "random data reads back wrong"
    rm -f "$E2E_TMP/out.img"
}
verify
stop_server
cvol_check "$VOL"
start_server "$VOL"
verify
stop_server
pass
