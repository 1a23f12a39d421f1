#!/usr/bin/env bash
# estimate: `cvol estimate` on real data with known duplicates (a tar of
# /usr/share/doc and /usr/lib, a second copy of its first quarter, zeros),
# from a 0444 file and over NBD (qemu-nbd -r, else nbdkit -r): the JSON keys
# are there, both agree, the source is unchanged (also read by an
# unprivileged user when run as root); refusals exit 2 without a panic; then
# the data is copied into a real volume with nbdcopy and, once background
# work settles, the estimate must be within 25% of what the volume stores.
#
#   E2E_ESTIMATE_MB   MiB of tar data (default 48; the file is 1.25x + 8 MiB)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy tar sha256sum
MB=${E2E_ESTIMATE_MB:-48}

# ------------------------------------------------------------ test data ----
tar_image estimate "$MB" /usr/share/doc /usr/lib
DIR=$E2E_TMP/pub
mkdir -p "$DIR"
chmod 755 "$E2E_TMP" "$DIR"
DATA=$DIR/data.img
{
    cat "$TAR_IMAGE"
    head -c $((MB / 4 * 1048576)) "$TAR_IMAGE"
    head -c $((8 * 1048576)) /dev/zero
} >"$DATA"
chmod 444 "$DATA"
SUM=$(sha256sum <"$DATA")
BYTES=$(stat -c %s "$DATA")

KEYS=(source source_bytes logical_bytes sampled_bytes sampled_fraction zero_bytes
    nonzero_bytes distinct_bytes_estimate dedup_ratio compression_ratio
    stored_bytes_estimate metadata_bytes_estimate du_bytes_estimate reduction_ratio
    compression_ratio_lz4 stored_bytes_estimate_lz4 du_bytes_estimate_lz4
    whole_source_read dedup_ratio_is_lower_bound codec unit_bytes seconds)

# estimate_json SOURCE OUT [args...] -- run, check exit 0 and the keys
estimate_json() {
    local src=$1 out=$2 k
    shift 2
    "$CVOL" estimate "$src" --json "$@" >"$out" 2>"$out.err" ||
        fail "cvol estimate $src $* failed: $(cat "$out.err")"
    for k in "${KEYS[@]}"; do json_get "$out" "$k" >/dev/null || fail "estimate of $src: no key $k"; done
}

step "estimate of a 0444 file ($BYTES bytes)"
t0=$(now)
estimate_json "$DATA" "$E2E_TMP/file.json"
t_file=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }')
F=$E2E_TMP/file.json
[[ $(json_get "$F" logical_bytes) -eq $BYTES ]] || fail "logical_bytes $(json_get "$F" logical_bytes) != $BYTES"
[[ $(json_get "$F" zero_bytes) -eq $((8 * 1048576)) ]] || fail "zero_bytes $(json_get "$F" zero_bytes) != 8 MiB"
[[ $(json_get "$F" whole_source_read) == True ]] || fail "a small source is read whole"
dd=$(json_get "$F" dedup_ratio)
# The quarter copied again: at least 1.25x (the tar repeats itself a little).
awk -v d="$dd" 'BEGIN { exit !(d >= 1.24 && d < 1.6) }' || fail "dedup_ratio $dd, expected ~1.25"
log "file: $(cat "$F")"

step "the same over NBD (read-only export)"
SOCK=$E2E_TMP/src.sock
if command -v qemu-nbd >/dev/null; then
    qemu-nbd -r -f raw -t -k "$SOCK" "$DATA" >"$E2E_TMP/qnbd.log" 2>&1 &
else
    need nbdkit
    nbdkit -f -r -U "$SOCK" file "$DATA" >"$E2E_TMP/qnbd.log" 2>&1 &
fi
NBD_PID=$!
reg_pid "$NBD_PID"
URI="nbd+unix:///?socket=$SOCK"
wait_until 20 "the source's NBD server" nbdinfo --size "$URI"
estimate_json "$URI" "$E2E_TMP/nbd.json"
for k in logical_bytes zero_bytes distinct_bytes_estimate dedup_ratio compression_ratio \
    stored_bytes_estimate du_bytes_estimate compression_ratio_lz4; do
    a=$(json_get "$F" "$k") b=$(json_get "$E2E_TMP/nbd.json" "$k")
    [[ "$a" == "$b" ]] || fail "$k: file $a, NBD $b"
done
step "sampled: 25% of the file, in regions"
estimate_json "$DATA" "$E2E_TMP/s.json" --sample 25
[[ $(json_get "$E2E_TMP/s.json" dedup_ratio_is_lower_bound) == True ]] || fail "a sample is a lower bound"
r=$(json_get "$E2E_TMP/s.json" sampled_fraction)
awk -v r="$r" 'BEGIN { exit !(r >= 0.24 && r <= 0.30) }' || fail "sampled_fraction $r for --sample 25"

if [[ $(id -u) -eq 0 ]] && id nobody >/dev/null 2>&1 && command -v setpriv >/dev/null; then
    step "an unprivileged user reads it too"
    setpriv --reuid=nobody --regid=nogroup --clear-groups "$CVOL" estimate "$DATA" --json \
        >"$E2E_TMP/nobody.json" 2>"$E2E_TMP/nobody.err" || fail "estimate as nobody: $(cat "$E2E_TMP/nobody.err")"
    [[ $(json_get "$E2E_TMP/nobody.json" du_bytes_estimate) == $(json_get "$F" du_bytes_estimate) ]] ||
        fail "nobody's estimate differs"
fi
[[ $(sha256sum <"$DATA") == "$SUM" ]] || fail "the source changed"

step "refusals: exit 2, a message, no panic"
: >"$E2E_TMP/empty"
refuse() {
    local want=$1 rc=0
    shift
    "$CVOL" estimate "$@" >"$E2E_TMP/r.out" 2>"$E2E_TMP/r.err" || rc=$?
    [[ $rc -eq 2 ]] || fail "cvol estimate $*: exit $rc, expected 2"
    grep -q "$want" "$E2E_TMP/r.err" || fail "cvol estimate $*: '$(cat "$E2E_TMP/r.err")' lacks '$want'"
    ! grep -qi panick "$E2E_TMP/r.err" || fail "cvol estimate $* panicked"
}
refuse "No such file" "$E2E_TMP/missing"
refuse "is a directory" "$E2E_TMP"
refuse "is empty" "$E2E_TMP/empty"
refuse "nbd+unix" "nbd+unix:///?socket=$E2E_TMP/none.sock"
refuse "sample" "$DATA" --sample 0
refuse "codec" "$DATA" --codec gzip
refuse "unit-size" "$DATA" --unit-size 3K

if ! is_cvol; then
    pass "estimate from file and NBD agree (${t_file}s)"
fi
step "what a volume really stores"
VOL=$E2E_TMP/vol.cvol
make_volume "$VOL" 256M
start_server "$VOL"
nbdcopy "$DATA" "$SRV_URI" || fail "nbdcopy into the volume"
# Settled: stored_bytes unchanged over 3 s (background recompression done).
prev=-1 same=0
for _ in $(seq 1 40); do
    sleep 1
    cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
    cur=$(json_get "$E2E_TMP/stat.json" stored_bytes)
    if [[ $cur == "$prev" ]]; then same=$((same + 1)); else same=0; fi
    prev=$cur
    ((same < 3)) || break
done
((same >= 3)) || fail "stored_bytes still changing 40 s after the copy (last $prev): background work did not settle"
S=$E2E_TMP/stat.json
stored=$(json_get "$S" stored_bytes) used=$(json_get "$S" physical_used_bytes)
est=$(json_get "$F" stored_bytes_estimate) du=$(json_get "$F" du_bytes_estimate)
log "stored: estimate $est, volume $stored; du: estimate $du, physical_used $used;" \
    "dedup: estimate $dd, volume $(json_get "$S" dedup_ratio);" \
    "compression: estimate $(json_get "$F" compression_ratio), volume $(json_get "$S" compression_ratio)"
within() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= 0.75 * b && a <= 1.25 * b) }'; }
within "$est" "$stored" || fail "stored_bytes_estimate $est not within 25% of stored_bytes $stored"
within "$du" "$used" || fail "du_bytes_estimate $du not within 25% of physical_used_bytes $used"
stop_server
pass "file and NBD agree; stored estimate $est vs $stored, du $du vs $used (${t_file}s)"
