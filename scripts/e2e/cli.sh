#!/usr/bin/env bash
# CLI contract: create/--force, size parsing, serve locking, stat --json
# (served and offline), SIGTERM/SIGINT exit 0, --read-only, --export,
# --listen, check/serve on garbage.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need qemu-io nbdinfo
need_server

VOL=$E2E_TMP/vol.cvol
SIZE=64M
STAT_KEYS=(logical_size_bytes physical_size_bytes mapped_bytes zero_bytes
    stored_bytes physical_used_bytes reduction_ratio)

# expect_fail DESCRIPTION CMD... -- CMD must exit non-zero within 20s; its
# combined output is left in $E2E_TMP/last.out
expect_fail() {
    local desc=$1 rc=0
    shift
    timeout 20 "$@" >"$E2E_TMP/last.out" 2>&1 || rc=$?
    ((rc == 124)) && fail "$desc: '$*' did not finish within 20s"
    if ((rc == 0)); then
        cat "$E2E_TMP/last.out"
        fail "$desc: '$*' succeeded, expected an error"
    fi
    log "ok: $desc (exit $rc: $(head -n 1 "$E2E_TMP/last.out"))"
}

# check_stat_keys FILE -- all documented keys present and numeric
check_stat_keys() {
    "$PY" - "$1" "${STAT_KEYS[@]}" <<'PYEOF' || fail "cvol stat --json: missing/invalid keys (see above)"
import json, sys
d = json.load(open(sys.argv[1]))
bad = []
for k in sys.argv[2:]:
    if k not in d:
        bad.append("missing key %s" % k)
    elif isinstance(d[k], bool) or not isinstance(d[k], (int, float)):
        bad.append("key %s is not a number: %r" % (k, d[k]))
def paths(o, p=""):
    if isinstance(o, dict):
        for k, v in o.items():
            yield p + "." + k
            yield from paths(v, p + "." + k)
codec = [p for p in paths(d) if any(w in p.lower() for w in ("codec", "lz4", "zstd"))]
if not codec:
    bad.append("no per-codec block counts (no key mentioning codec/lz4/zstd)")
for b in bad:
    print("  stat --json:", b)
print("  stat --json keys ok; codec keys:", ", ".join(codec[:6]))
sys.exit(1 if bad else 0)
PYEOF
}

# ------------------------------------------------------------ create ----
if is_cvol; then
    step "create: sizes, refuse overwrite without --force"
    make_volume "$VOL" "$SIZE"
    [[ -f "$VOL" ]] || fail "cvol create did not create $VOL"
    sum_before=$(sha256sum "$VOL" | cut -d' ' -f1)
    expect_fail "create refuses to overwrite an existing volume" \
        "$CVOL" create "$VOL" --size 32M
    [[ $(sha256sum "$VOL" | cut -d' ' -f1) == "$sum_before" ]] ||
        fail "refused create still modified $VOL"
    "$CVOL" create "$VOL" --size "$SIZE" --force || fail "create --force over an existing volume failed"

    # (a 512K volume needs a bigger backing store for metadata + segments)
    for s in 512K 64M 3G; do
        v=$E2E_TMP/size-$s.cvol
        extra=()
        [[ $s == 512K ]] && extra=(--physical-size 16M)
        "$CVOL" create "$v" --size "$s" "${extra[@]}" || fail "cvol create --size $s ${extra[*]} failed"
        "$CVOL" stat "$v" --json >"$E2E_TMP/st.json" || fail "cvol stat on a fresh $s volume failed"
        [[ $(json_get "$E2E_TMP/st.json" logical_size_bytes) -eq $(to_bytes "$s") ]] ||
            fail "--size $s: logical_size_bytes is $(json_get "$E2E_TMP/st.json" logical_size_bytes)"
        rm -f "$v"
    done
    "$CVOL" create "$E2E_TMP/phys.cvol" --size 1G --physical-size 64M --codec zstd:3 ||
        fail "create with --physical-size 64M --codec zstd:3 failed"
    "$CVOL" create "$E2E_TMP/none.cvol" --size 16M --codec none || fail "create --codec none failed"
    "$CVOL" create "$E2E_TMP/lz4.cvol" --size 16M --codec lz4 || fail "create --codec lz4 failed"

    step "create: invalid sizes and options give a clear error"
    i=0
    for s in 12Q abc "" -5M 1.5.3G 10MB/s; do
        i=$((i + 1))
        v=$E2E_TMP/bad-$i.cvol
        expect_fail "--size='$s' rejected" "$CVOL" create "$v" --size="$s"
        grep -qiE 'size|invalid|parse' "$E2E_TMP/last.out" ||
            fail "error for --size '$s' does not explain itself: $(cat "$E2E_TMP/last.out")"
        [[ ! -e "$v" ]] || fail "a volume file was left behind after rejecting --size '$s'"
    done
    expect_fail "--physical-size 'lots' rejected" "$CVOL" create "$E2E_TMP/bad-p.cvol" --size 16M --physical-size lots
    expect_fail "--codec 'gzip' rejected" "$CVOL" create "$E2E_TMP/bad-c.cvol" --size 16M --codec gzip
    expect_fail "create without --size rejected" "$CVOL" create "$E2E_TMP/bad-n.cvol"
    expect_fail "stat of a missing volume fails" "$CVOL" stat "$E2E_TMP/missing.cvol" --json
else
    skip_step "create/--force/size parsing checks"
    make_volume "$VOL" "$SIZE"
fi

# ------------------------------------------------------------- serve ----
step "serve, write data, stat --json while serving"
start_server "$VOL"
qemu-io -f raw -c "write -q -P 0x5a 1048576 1048576" -c flush "$SRV_URI" ||
    fail "qemu-io write to the served volume failed"
if is_cvol; then
    "$CVOL" stat "$VOL" --json >"$E2E_TMP/stat-online.json" || fail "cvol stat --json while serving failed"
    check_stat_keys "$E2E_TMP/stat-online.json"

    step "stat --watch: a line per refresh with --json, rates from the second, ends on --count or a closed pipe"
    # Writes during the watch, so the second sample's write rate is not 0.
    qemu-io -f raw -c "write -q -P 0x33 8388608 4194304" -c flush "$SRV_URI" &
    writer=$!
    timeout 20 "$CVOL" stat "$VOL" --watch 0.5 --count 3 --json >"$E2E_TMP/watch.jsonl" ||
        fail "cvol stat --watch 0.5 --count 3 --json failed"
    wait "$writer" || fail "qemu-io write during stat --watch failed"
    "$PY" - "$E2E_TMP/watch.jsonl" <<'PYEOF' || fail "stat --watch --json lines are wrong (see above)"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == 3, f"{len(lines)} lines for --count 3"
assert "write_bytes_per_second" not in lines[0], "a rate in the first sample"
for l in lines[1:]:
    assert l["write_bytes_per_second"] >= 0 and l["read_bytes_per_second"] >= 0, l
    assert l["served"] is True and "logical_size_bytes" in l
PYEOF
    rc=0
    timeout 20 "$CVOL" stat "$VOL" --watch 0.2 2>"$E2E_TMP/watch.err" | head -3 >/dev/null || rc=$?
    ((rc == 0)) || fail "stat --watch into a closed pipe: exit $rc ($(cat "$E2E_TMP/watch.err"))"
    ! grep -q panicked "$E2E_TMP/watch.err" || fail "stat --watch panicked on a closed pipe"
    expect_fail "stat --watch 0 rejected" "$CVOL" stat "$VOL" --watch 0
    expect_fail "stat --watch of a missing volume" "$CVOL" stat "$E2E_TMP/missing.cvol" --watch
    grep -q "no such file" "$E2E_TMP/last.out" ||
        fail "stat --watch of a missing path does not say so: $(cat "$E2E_TMP/last.out")"

    step "second serve of the same volume must fail fast with a lock message"
    t0=$(date +%s)
    expect_fail "second serve refused" "$CVOL" serve "$VOL" --socket "$E2E_TMP/second.sock"
    (($(date +%s) - t0 <= 5)) || fail "second serve took $(($(date +%s) - t0))s to fail (expected at once)"
    grep -qiE 'lock|in use|busy' "$E2E_TMP/last.out" ||
        fail "second serve error does not mention lock/in use: $(cat "$E2E_TMP/last.out")"
    # the first server must be unaffected
    qemu-io -f raw -c "read -q -P 0x5a 1048576 1048576" "$SRV_URI" ||
        fail "first server broken after the refused second serve"
else
    skip_step "stat while serving / lock checks"
fi

step "SIGTERM -> exit 0, then stat offline"
stop_server
if is_cvol; then
    "$CVOL" stat "$VOL" --json >"$E2E_TMP/stat-offline.json" || fail "cvol stat --json offline failed"
    check_stat_keys "$E2E_TMP/stat-offline.json"
    cat "$E2E_TMP/stat-offline.json"
    echo
    [[ $(json_get "$E2E_TMP/stat-offline.json" logical_size_bytes) -eq $(to_bytes "$SIZE") ]] ||
        fail "logical_size_bytes != $SIZE"
    mapped=$(json_get "$E2E_TMP/stat-offline.json" mapped_bytes)
    ((mapped >= 1048576)) || fail "mapped_bytes=$mapped after writing 1 MiB of data"
    cvol_check "$VOL"
fi

# -------------------------------------------------------------- SIGINT ----
if is_cvol; then
    step "SIGINT -> exit 0"
    # A background job of a non-interactive shell starts with SIGINT ignored;
    # exec through python to restore the default disposition, like a terminal.
    "$PY" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
        "$CVOL" serve "$VOL" --socket "$E2E_TMP/int.sock" >"$E2E_TMP/int.out" 2>"$E2E_TMP/int.err" &
    pid=$!
    reg_pid "$pid"
    wait_until 30 "serve to print its URI" grep -q '^nbd+unix://' "$E2E_TMP/int.out"
    kill -INT "$pid"
    wait_until 30 "serve to exit on SIGINT" bash -c "! kill -0 $pid 2>/dev/null || grep -q '^State:.*Z' /proc/$pid/status"
    rc=0
    wait "$pid" || rc=$?
    unreg_pid "$pid"
    ((rc == 0)) || fail "serve exited $rc on SIGINT (expected 0): $(tail -n 5 "$E2E_TMP/int.err")"
    log "ok: SIGINT -> exit 0"
fi

# ----------------------------------------------------------- read-only ----
step "--read-only refuses writes"
start_server "$VOL" --read-only
nbdinfo --json --no-content "$SRV_URI" >"$E2E_TMP/ro.json"
ro=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["exports"][0]["is_read_only"])' "$E2E_TMP/ro.json")
[[ "$ro" == True ]] || fail "nbdinfo: is_read_only=$ro on a --read-only export"
expect_fail "qemu-io write to a read-only export" \
    qemu-io -f raw -c "write -P 0xee 1048576 4096" "$SRV_URI"
expect_fail "qemu-io write -z to a read-only export" \
    qemu-io -f raw -c "write -z 0 65536" "$SRV_URI"
if find_nbd_python; then
    # strict mode off: libnbd sends the commands anyway, so the *server* must
    # refuse them (EPERM) rather than the client library.
    for cmd in 'h.pwrite(b"\xee" * 4096, 1048576)' 'h.zero(65536, 1048576)' 'h.trim(65536, 1048576)'; do
        expect_fail "server refuses $cmd on a read-only export" "$NBD_PY" -c '
import nbd, sys
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
try:
    '"$cmd"'
except nbd.Error as e:
    print("refused:", e)
    sys.exit(1)
print("server accepted the write")' "$SRV_URI"
        grep -q '^refused:' "$E2E_TMP/last.out" || fail "$(cat "$E2E_TMP/last.out")"
    done
fi
qemu-io -f raw -r -c "read -q -P 0x5a 1048576 1048576" "$SRV_URI" ||
    fail "data changed or unreadable on the read-only export"
stop_server

# ------------------------------------------------------ export / listen ----
step "--export NAME"
start_server "$VOL" --export vol0
[[ "$SRV_URI" == nbd+unix:///vol0\?* ]] || fail "URI '$SRV_URI' does not carry the export name vol0"
nbdinfo --size "$SRV_URI" | grep -qx "$(to_bytes "$SIZE")" || fail "nbdinfo --size via $SRV_URI"
stop_server

if is_cvol; then
    step "--listen 127.0.0.1:PORT prints an nbd:// URI that works"
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    start_server "$VOL" --listen "127.0.0.1:$port"
    tcp=$(grep -m1 -E '^nbd://' "$SRV_OUT" || true)
    [[ "$tcp" == "nbd://127.0.0.1:$port/"* ]] || fail "no nbd://127.0.0.1:$port/ URI on stdout: $(cat "$SRV_OUT")"
    nbdinfo --size "$tcp" | grep -qx "$(to_bytes "$SIZE")" || fail "nbdinfo --size $tcp"
    qemu-io -f raw -r -c "read -q -P 0x5a 1048576 1048576" "$tcp" || fail "read over TCP failed"
    stop_server

    step "check/serve on non-volumes fail cleanly"
    : >"$E2E_TMP/empty.cvol"
    head -c 1048576 /dev/urandom >"$E2E_TMP/garbage.cvol"
    for v in empty garbage; do
        expect_fail "check of a $v file" "$CVOL" check "$E2E_TMP/$v.cvol"
        expect_fail "serve of a $v file" "$CVOL" serve "$E2E_TMP/$v.cvol" --socket "$E2E_TMP/$v.sock"
    done
fi

# ------------------------------------------- create --force while served ----
if is_cvol; then
    step "create --force on a served volume must be refused without touching it"
    VOL2=$E2E_TMP/vol2.cvol
    make_volume "$VOL2" "$SIZE"
    start_server "$VOL2"
    qemu-io -f raw -c "write -q -P 0x6b 0 1048576" -c flush "$SRV_URI" || fail "write to $VOL2 failed"
    expect_fail "create --force on a served volume refused" \
        "$CVOL" create "$VOL2" --size "$SIZE" --force
    grep -qiE 'lock|in use|busy|served' "$E2E_TMP/last.out" ||
        fail "create --force error does not mention lock/in use: $(cat "$E2E_TMP/last.out")"
    stop_server
    rc=0
    "$CVOL" check "$VOL2" >"$E2E_TMP/check-after-force.out" 2>&1 || rc=$?
    if ((rc != 0)); then
        sed 's/\x1b\[[0-9;]*m//g' "$E2E_TMP/check-after-force.out"
        fail "the refused 'cvol create --force' destroyed the served volume: cvol check exits $rc after the server stopped"
    fi
    start_server "$VOL2"
    qemu-io -f raw -r -c "read -q -P 0x6b 0 1048576" "$SRV_URI" ||
        fail "data lost after the refused create --force"
    stop_server
fi

pass
