#!/usr/bin/env bash
# NBD over TLS (`cvol serve --tls off|on|require --tls-certificates DIR
# [--tls-verify-peer] [--allow CIDR,...]`), with the stock clients (libnbd's
# nbdinfo/nbdcopy, qemu-img: GnuTLS) and a small STARTTLS probe on Python's
# ssl module (OpenSSL), against a test PKI made by scripts/tls-certs.
# Every server listens on a unix socket and on 127.0.0.1:PORT (a free port).
#
#   require    --tls require: 8 MiB of random data in by nbdcopy over
#              nbds://localhost:PORT and back out, identical; qemu-img
#              convert/compare over TCP with tls-creds-x509; nbdinfo over
#              nbds+unix:// (export size, "TLS": true); the probe sees the
#              server's certificate over both; a client with no certificate
#              is served (no --tls-verify-peer). Plain clients (nbd://,
#              nbd+unix://) are refused, nbdinfo saying "TLS"; nbdinfo --list
#              shows no export; the probe: NBD_OPT_LIST and NBD_OPT_GO answer
#              NBD_REP_ERR_TLS_REQD.
#   verify     --tls-verify-peer: client/ (nbdinfo, qemu-img compare, the
#              probe) is served; rogue-client/ (another CA), expired-client/
#              and noca-client/ (no certificate) are refused; the server
#              still serves client/ afterwards
#   on         --tls on: plain and TLS clients both served, the same data;
#              the default (no --tls): nbds:// refused, nbd:// served
#   badconf    refused at start (exit 2 for cvol, message naming the
#              problem): a missing certificate directory, a garbage
#              server-key.pem, --tls bogus; (cvol) --tls on with
#              --tls-verify-peer (plain clients would skip the certificate
#              check: "use --tls require")
#   rotate     (cvol) SIGHUP re-reads the certificates: a copy of
#              server-rotated/ over the served directory, kill -HUP: new
#              connections get the new certificate (the probe's fingerprint),
#              a connection opened before keeps working (python3-libnbd, if
#              there); a garbage server-key.pem + HUP: the server keeps
#              serving with the certificate it had and logs an error naming
#              TLS/the certificate/the key; restored + HUP: the first
#              certificate again
#   allow      (cvol) --allow 10.0.0.0/8: TCP from 127.0.0.1 refused, the unix
#              socket still served; --allow 10.0.0.0/8,127.0.0.0/8 served;
#              --allow nonsense and 10.0.0.0/33 refused at start (exit 2,
#              message naming --allow)
#   warn       (cvol) a network listener (--listen 0.0.0.0:PORT) whose clients
#              are not authenticated warns on stderr: without TLS (a line
#              with "warning" and "TLS", recommending --tls-verify-peer), with
#              --tls require but no --tls-verify-peer ("no client
#              certificates"); with --tls require --tls-verify-peer: no
#              warning, and a client with a certificate is served
#   ctl        (cvol) the control socket (cvol-*.ctl in $CVOL_RUN_DIR, a 0755
#              temp dir here) is mode 0600, or sits in a 0700 directory of
#              its own
#
#   E2E_TLS_STEPS   steps to run (default: all, in the order above)
#   E2E_TLS_KEY     rsa (default) or ec: the PKI's keys (scripts/tls-certs --key)
#
# Under E2E_SERVER=nbdkit (nbdkit --tls=..., two processes for the socket
# and the port) the steps marked (cvol) are skipped: nbdkit does not reload
# certificates, its ip filter (1.32) cannot parse IPv4 CIDRs, and it does
# not warn.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdinfo nbdcopy qemu-img openssl cmp
need_server

STEPS=${E2E_TLS_STEPS:-require verify on badconf rotate allow warn ctl}
TLS_CERTS=$E2E_REPO_ROOT/scripts/tls-certs
PKI=$E2E_TMP/pki
CERTS=$E2E_TMP/srvcerts # the served certificate directory (rotated in place)
VOL=$E2E_TMP/vol.cvol
SIZE=64M
PROBE=$E2E_TMP/nbdtls.py
export CVOL_RUN_DIR=$E2E_TMP/run
mkdir -p "$CVOL_RUN_DIR"
chmod 0755 "$CVOL_RUN_DIR"

step "test PKI (scripts/tls-certs --key ${E2E_TLS_KEY:-rsa})"
"$TLS_CERTS" --key "${E2E_TLS_KEY:-rsa}" "$PKI" || fail "scripts/tls-certs $PKI failed"
mkdir -p "$CERTS"
cp "$PKI"/server/*.pem "$CERTS/"

# fp CERT.pem -- sha256 of the certificate's DER (what the probe prints)
fp() { openssl x509 -in "$1" -outform DER | sha256sum | cut -d' ' -f1; }
FP_SERVER=$(fp "$PKI/server/server-cert.pem")
FP_ROTATED=$(fp "$PKI/server-rotated/server-cert.pem")

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The probe: a minimal NBD client on Python's ssl module.
cat >"$PROBE" <<'PYEOF'
# nbdtls.py -- a minimal NBD client (fixed newstyle) on Python's ssl module.
#   cert ADDR CERTDIR   NBD_OPT_STARTTLS, a TLS handshake trusting
#                       CERTDIR/ca-cert.pem (presenting CERTDIR/client-cert.pem
#                       and client-key.pem if there; hostname "localhost"),
#                       NBD_OPT_LIST over TLS; prints the sha256 of the
#                       server's certificate (DER), the TLS version and the
#                       number of exports listed. Exit 1 if refused.
#   notls ADDR          no STARTTLS: NBD_OPT_LIST and NBD_OPT_GO must both be
#                       answered NBD_REP_ERR_TLS_REQD, with no export named.
# ADDR is HOST:PORT or unix:PATH.
import hashlib, os, socket, ssl, struct, sys

IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_GO = 2, 3, 5, 7
REP_ACK, REP_SERVER, REP_INFO = 1, 2, 3
ERR = 1 << 31
TLS_REQD = ERR + 5
NAMES = {ERR + 1: "ERR_UNSUP", ERR + 2: "ERR_POLICY", ERR + 3: "ERR_INVALID", TLS_REQD: "ERR_TLS_REQD",
         ERR + 6: "ERR_UNKNOWN", REP_ACK: "ACK", REP_SERVER: "SERVER", REP_INFO: "INFO"}


def recvall(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError("server closed the connection after %d of %d bytes" % (len(b), n))
        b += c
    return b


def connect(addr):
    if addr.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(addr[5:])
    else:
        host, _, port = addr.rpartition(":")
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    magic, opt, flags = struct.unpack(">8s8sH", recvall(s, 18))
    if magic != b"NBDMAGIC" or opt != b"IHAVEOPT" or not flags & 1:
        sys.exit("not a fixed-newstyle NBD server: %r %r %#x" % (magic, opt, flags))
    s.sendall(struct.pack(">I", 1 | (flags & 2)))  # FIXED_NEWSTYLE (+ NO_ZEROES if offered)
    return s


def option(s, opt, data=b""):
    s.sendall(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)


def replies(s, opt):
    """Every reply to one option, up to its final one."""
    out = []
    while True:
        magic, o, typ, n = struct.unpack(">QIII", recvall(s, 20))
        if magic != REPLY_MAGIC or o != opt:
            sys.exit("bad option reply: magic %#x option %d (sent %d)" % (magic, o, opt))
        out.append((typ, recvall(s, n)))
        if typ not in (REP_SERVER, REP_INFO):
            return out


def cert(addr, certdir):
    s = connect(addr)
    option(s, OPT_STARTTLS)
    typ, data = replies(s, OPT_STARTTLS)[-1]
    if typ != REP_ACK:
        print("STARTTLS refused: %s %r" % (NAMES.get(typ, typ), data[:200]))
        return 1
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.path.join(certdir, "ca-cert.pem"))
    crt = os.path.join(certdir, "client-cert.pem")
    if os.path.exists(crt):
        ctx.load_cert_chain(crt, os.path.join(certdir, "client-key.pem"))
    try:
        t = ctx.wrap_socket(s, server_hostname="localhost")
        der = t.getpeercert(binary_form=True)
        version = t.version()
        # Under TLS 1.3 the server checks the client's certificate after the
        # client's side of the handshake is done: one round trip tells.
        option(t, OPT_LIST)
        rs = replies(t, OPT_LIST)
        option(t, OPT_ABORT)
    except (ssl.SSLError, OSError, EOFError) as e:
        print("TLS refused: %s" % e)
        return 1
    print("%s %s exports=%d" % (hashlib.sha256(der).hexdigest(), version,
                                sum(1 for typ, _ in rs if typ == REP_SERVER)))
    return 0 if rs[-1][0] == REP_ACK else 1


def notls(addr):
    s = connect(addr)
    bad = 0
    option(s, OPT_LIST)
    rs = replies(s, OPT_LIST)
    print("NBD_OPT_LIST ->", ", ".join(NAMES.get(t, str(t)) for t, _ in rs))
    bad |= rs[-1][0] != TLS_REQD or any(t == REP_SERVER for t, _ in rs)
    option(s, OPT_GO, struct.pack(">IH", 0, 0))  # the default export "", no info requests
    rs = replies(s, OPT_GO)
    print("NBD_OPT_GO   ->", ", ".join(NAMES.get(t, str(t)) for t, _ in rs))
    bad |= rs[-1][0] != TLS_REQD or any(t == REP_INFO for t, _ in rs)
    return 1 if bad else 0


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) == 3 and a[0] == "cert":
        sys.exit(cert(a[1], a[2]))
    if len(a) == 2 and a[0] == "notls":
        sys.exit(notls(a[1]))
    sys.exit("usage: nbdtls.py cert ADDR CERTDIR | notls ADDR")
PYEOF

# ------------------------------------------------------------- servers ----

SOCK="" # the current server's unix socket
PORT="" # ... and its TCP port on 127.0.0.1
SRV_PIDS=()

# nbdkit_args ARGS... -- cvol serve's TLS flags as nbdkit's (sets NK_ARGS)
nbdkit_args() {
    NK_ARGS=()
    while (($#)); do
        case "$1" in
            --tls) NK_ARGS+=("--tls=$2"); shift ;;
            --tls-certificates) NK_ARGS+=("--tls-certificates=$2"); shift ;;
            --tls-verify-peer) NK_ARGS+=(--tls-verify-peer) ;;
            *) fail "tls_server: '$1' has no nbdkit equivalent here" ;;
        esac
        shift
    done
}

# tls_server [cvol serve args...] -- serve $VOL on a fresh unix socket ($SOCK)
# and 127.0.0.1:$PORT; cvol: one process, nbdkit: one per listener.
tls_server() {
    _E2E_SRV_SEQ=$((_E2E_SRV_SEQ + 1))
    local n=$_E2E_SRV_SEQ deadline line
    SOCK=$E2E_TMP/srv$n.sock
    PORT=$(free_port)
    SRV_OUT=$E2E_TMP/srv$n.out
    SRV_ERR=$E2E_TMP/srv$n.err
    SRV_PIDS=()
    if is_cvol; then
        local extra=()
        read -ra extra <<<"${E2E_SERVE_ARGS:-}"
        "$CVOL" serve "$VOL" --socket "$SOCK" --listen "127.0.0.1:$PORT" "${extra[@]}" "$@" \
            >"$SRV_OUT" 2>"$SRV_ERR" &
        SRV_PID=$!
        reg_pid "$SRV_PID"
        SRV_PIDS=("$SRV_PID")
        deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
        # Ready once it printed its URIs (nbd+unix:// or nbds+unix://).
        until grep -qE '^nbds?\+unix://' "$SRV_OUT" 2>/dev/null && grep -qE '^nbds?://' "$SRV_OUT"; do
            _alive "$SRV_PID" || fail "cvol serve $* exited before printing its URIs: $(tail -n 20 "$SRV_ERR")"
            (($(date +%s) < deadline)) || fail "cvol serve $* printed no URIs in ${E2E_READY_TIMEOUT}s"
            sleep 0.05
        done
        line=$(grep -m1 -E '^nbds?\+unix://' "$SRV_OUT")
        [[ "$line" == *"socket=$SOCK"* ]] || fail "URI '$line' does not name the socket $SOCK"
        log "cvol pid $SRV_PID: $(tr '\n' ' ' <"$SRV_OUT")"
    else
        nbdkit_args "$@"
        nbdkit -f -P "$E2E_TMP/srv$n.pid" -U "$SOCK" "${NK_ARGS[@]}" file "$VOL" >"$SRV_OUT" 2>"$SRV_ERR" &
        SRV_PIDS+=($!)
        reg_pid $!
        nbdkit -f -P "$E2E_TMP/srv$n.tcp.pid" -i 127.0.0.1 -p "$PORT" "${NK_ARGS[@]}" file "$VOL" \
            >"$SRV_OUT.tcp" 2>"$SRV_ERR.tcp" &
        SRV_PIDS+=($!)
        reg_pid $!
        SRV_PID=${SRV_PIDS[0]}
        deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
        until [[ -s "$E2E_TMP/srv$n.pid" && -s "$E2E_TMP/srv$n.tcp.pid" ]]; do
            if ! _alive "${SRV_PIDS[0]}" || ! _alive "${SRV_PIDS[1]}"; then
                fail "nbdkit ${NK_ARGS[*]} exited early: $(cat "$SRV_ERR" "$SRV_ERR.tcp")"
            fi
            (($(date +%s) < deadline)) || fail "nbdkit not ready after ${E2E_READY_TIMEOUT}s"
            sleep 0.05
        done
        log "nbdkit pids ${SRV_PIDS[*]} ready on $SOCK and 127.0.0.1:$PORT (${NK_ARGS[*]})"
    fi
}

tls_stop() {
    local p
    for p in "${SRV_PIDS[@]}"; do stop_server "$p"; done
    SRV_PIDS=()
}

# URIs of the current server; CERTDIR is a directory of $PKI (client, ...)
tcp_tls() { echo "nbds://localhost:$PORT/?tls-certificates=$PKI/$1"; }
unix_tls() { echo "nbds+unix:///?socket=$SOCK&tls-certificates=$PKI/$1"; }
tcp_plain() { echo "nbd://127.0.0.1:$PORT/"; }
unix_plain() { echo "nbd+unix:///?socket=$SOCK"; }
QEMU_TLS=(--object "tls-creds-x509,id=tls0,dir=$PKI/client,endpoint=client")
qemu_nbd_opts() { echo "driver=nbd,server.type=inet,server.host=localhost,server.port=$PORT,tls-creds=tls0"; }

# served DESC URI -- nbdinfo --size must give the volume's size
served() {
    local out rc=0
    out=$(timeout 20 nbdinfo --size "$2" 2>&1) || rc=$?
    ((rc == 0)) || fail "$1: nbdinfo --size $2 failed (exit $rc): $out"
    [[ "$out" == "$(to_bytes "$SIZE")" ]] || fail "$1: nbdinfo --size $2 printed '$out'"
    log "ok: $1 is served"
}

# refused DESC URI -- nbdinfo must fail (within 20 s); its stderr in $E2E_TMP/refused.err
refused() {
    local rc=0
    timeout 20 nbdinfo --size "$2" >"$E2E_TMP/refused.out" 2>"$E2E_TMP/refused.err" || rc=$?
    ((rc != 124)) || fail "$1: nbdinfo $2 hung (no answer in 20 s)"
    ((rc != 0)) || fail "$1: nbdinfo --size $2 succeeded ($(cat "$E2E_TMP/refused.out")), expected a refusal"
    log "ok: $1 is refused (exit $rc: $(head -n 1 "$E2E_TMP/refused.err"))"
}

# probe_fp ADDR CERTDIR -- the server certificate's fingerprint seen by the probe
probe_fp() {
    local out
    out=$(timeout 20 "$PY" "$PROBE" cert "$1" "$PKI/$2" 2>&1) || { echo "REFUSED: $out"; return 1; }
    echo "${out%% *}"
}

# expect_fp DESC ADDR CERTDIR FP
expect_fp() {
    local got
    got=$(probe_fp "$2" "$3") || fail "$1: the probe was refused: $got"
    [[ "$got" == "$4" ]] || fail "$1: the server presented certificate $got, expected $4"
    log "ok: $1: server certificate ${got:0:16}…"
}

# start_refused DESC PHRASE ARGS... -- the server must not start with ARGS:
# exit != 0 (2 for cvol) within 20 s and, for cvol, output matching PHRASE
start_refused() {
    local desc=$1 phrase=$2 rc=0 port
    shift 2
    port=$(free_port)
    if is_cvol; then
        timeout 20 "$CVOL" serve "$VOL" --socket "$E2E_TMP/refused.sock" --listen "127.0.0.1:$port" "$@" \
            >"$E2E_TMP/start.out" 2>&1 || rc=$?
    else
        nbdkit_args "$@"
        timeout 20 nbdkit -f -U "$E2E_TMP/refused.sock" "${NK_ARGS[@]}" file "$VOL" >"$E2E_TMP/start.out" 2>&1 || rc=$?
    fi
    ((rc != 124)) || fail "$desc: the server started (still running after 20 s) with $*"
    ((rc != 0)) || fail "$desc: the server exited 0 with $*: $(cat "$E2E_TMP/start.out")"
    if is_cvol; then
        ((rc == 2)) || fail "$desc: cvol serve $* exited $rc, expected 2: $(cat "$E2E_TMP/start.out")"
        grep -qiE -- "$phrase" "$E2E_TMP/start.out" ||
            fail "$desc: cvol serve $* does not say /$phrase/: $(cat "$E2E_TMP/start.out")"
    fi
    [[ ! -e "$E2E_TMP/refused.sock" ]] || fail "$desc: a refused start left its socket behind"
    log "ok: $desc (exit $rc: $(grep -v '^$' "$E2E_TMP/start.out" | head -n 1 | cut -c1-160))"
}

make_volume "$VOL" "$SIZE"
head -c 8M /dev/urandom >"$E2E_TMP/a.bin"
head -c 8M /dev/urandom >"$E2E_TMP/b.bin"

# --------------------------------------------------------------- steps ----

step_require() {
    step "require: TLS clients round-trip data"
    tls_server --tls require --tls-certificates "$CERTS"
    if is_cvol && ! grep -q '^nbds+unix://' "$SRV_OUT"; then
        log "note: cvol --tls require printed '$(grep -m1 '+unix://' "$SRV_OUT")' (nbdkit prints nbds+unix://)"
    fi
    nbdinfo --json "$(unix_tls client)" >"$E2E_TMP/info.json" || fail "nbdinfo --json $(unix_tls client) failed"
    "$PY" - "$E2E_TMP/info.json" "$(to_bytes "$SIZE")" <<'PYEOF' || fail "nbdinfo over TLS: wrong answers (above)"
import json, sys
info = json.load(open(sys.argv[1]))
e = (info.get("exports") or [{}])[0]
bad = []
if info.get("TLS") is not True:
    bad.append("TLS is %r" % info.get("TLS"))
if e.get("export-size") != int(sys.argv[2]):
    bad.append("export-size %r" % e.get("export-size"))
for b in bad:
    print("  nbdinfo:", b)
sys.exit(1 if bad else 0)
PYEOF
    log "ok: nbdinfo over nbds+unix://: TLS true, size $SIZE"

    timeout 60 nbdcopy "$E2E_TMP/a.bin" "$(tcp_tls client)" || fail "nbdcopy a.bin -> $(tcp_tls client) failed"
    timeout 60 nbdcopy "$(tcp_tls client)" "$E2E_TMP/out.bin" || fail "nbdcopy $(tcp_tls client) -> out.bin failed"
    cmp -n 8388608 "$E2E_TMP/a.bin" "$E2E_TMP/out.bin" || fail "8 MiB through nbdcopy over TLS came back different"
    rm -f "$E2E_TMP/out.bin"
    log "ok: 8 MiB in and out by nbdcopy over nbds://localhost:$PORT, identical"

    timeout 60 qemu-img convert -n -f raw "${QEMU_TLS[@]}" "$E2E_TMP/b.bin" \
        --target-image-opts "driver=raw,file.$(qemu_nbd_opts | sed 's/,/,file./g')" ||
        fail "qemu-img convert b.bin -> NBD over TLS failed"
    # b.bin is 8 MiB: compare also checks that the rest of the export is zero
    timeout 60 qemu-img compare "${QEMU_TLS[@]}" --image-opts "driver=file,filename=$E2E_TMP/b.bin" \
        "$(qemu_nbd_opts)" >"$E2E_TMP/compare.out" 2>&1 ||
        fail "qemu-img compare over TLS: $(cat "$E2E_TMP/compare.out")"
    log "ok: qemu-img convert + compare over TLS (tls-creds-x509)"

    expect_fp "the probe over the unix socket" "unix:$SOCK" client "$FP_SERVER"
    expect_fp "the probe over TCP" "127.0.0.1:$PORT" client "$FP_SERVER"
    log "probe: $("$PY" "$PROBE" cert "127.0.0.1:$PORT" "$PKI/client" | cut -d' ' -f2-)"
    served "no --tls-verify-peer: a client without a certificate" "$(unix_tls noca-client)"

    step "require: plain clients refused"
    refused "nbd+unix:// without TLS" "$(unix_plain)"
    grep -qi tls "$E2E_TMP/refused.err" || fail "nbdinfo's error does not mention TLS: $(cat "$E2E_TMP/refused.err")"
    refused "nbd:// without TLS" "$(tcp_plain)"
    grep -qi tls "$E2E_TMP/refused.err" || fail "nbdinfo's error does not mention TLS: $(cat "$E2E_TMP/refused.err")"
    local rc=0
    timeout 20 nbdinfo --list --json "$(unix_plain)" >"$E2E_TMP/list.json" 2>"$E2E_TMP/list.err" || rc=$?
    ((rc != 124)) || fail "nbdinfo --list without TLS hung"
    if ((rc == 0)); then
        "$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])).get("exports") or []; sys.exit(1 if e else 0)' \
            "$E2E_TMP/list.json" || fail "nbdinfo --list without TLS lists exports: $(cat "$E2E_TMP/list.json")"
    fi
    ! grep -q '"export-name"' "$E2E_TMP/list.json" || fail "nbdinfo --list without TLS named an export"
    log "ok: nbdinfo --list without TLS shows no export (exit $rc: $(head -n 1 "$E2E_TMP/list.err"))"
    for a in "unix:$SOCK" "127.0.0.1:$PORT"; do
        "$PY" "$PROBE" notls "$a" >"$E2E_TMP/notls.out" 2>&1 ||
            fail "without STARTTLS on $a: $(cat "$E2E_TMP/notls.out") (expected NBD_REP_ERR_TLS_REQD for both)"
        log "ok: without STARTTLS on $a: $(tr '\n' ' ' <"$E2E_TMP/notls.out")"
    done
    served "after the refusals, TLS over TCP" "$(tcp_tls client)"

    tls_stop
}

step_ctl() {
    if ! is_cvol; then
        skip_step "the control socket's mode (cvol's)"
        return 0
    fi
    step "the control socket is private"
    tls_server --tls require --tls-certificates "$CERTS"
    local ctl mode dmode
    ctl=$(find "$CVOL_RUN_DIR" -name 'cvol-*.ctl' | head -n 1)
    [[ -n "$ctl" && -S "$ctl" ]] || fail "no control socket cvol-*.ctl under CVOL_RUN_DIR=$CVOL_RUN_DIR"
    "$CVOL" stat "$VOL" --json >"$E2E_TMP/stat.json" || fail "cvol stat --json while served failed"
    [[ $(json_get "$E2E_TMP/stat.json" served) == True ]] || fail "cvol stat did not reach the server through $ctl"
    mode=$(stat -c %a "$ctl")
    dmode=$(stat -c %a "$(dirname "$ctl")")
    # 0600, or any mode inside a directory of cvol's own that only its owner may enter
    if ((8#$mode & 8#077)) && ! [[ "$(dirname "$ctl")" != "$CVOL_RUN_DIR" && $((8#$dmode & 8#077)) -eq 0 ]]; then
        fail "control socket ${ctl#"$E2E_TMP"/} is mode $mode in a directory of mode $dmode (umask $(umask)), expected 0600 or a 0700 directory: with a umask that lets the group write (002), other users can connect and ask it"
    fi
    log "ok: control socket ${ctl#"$E2E_TMP"/} mode $mode (its directory $dmode)"
    tls_stop
}

step_verify() {
    step "--tls-verify-peer: only clients with a certificate of the CA"
    tls_server --tls require --tls-certificates "$CERTS" --tls-verify-peer
    served "client/ over the unix socket" "$(unix_tls client)"
    served "client/ over TCP" "$(tcp_tls client)"
    expect_fp "the probe with client/" "127.0.0.1:$PORT" client "$FP_SERVER"
    timeout 60 qemu-img compare -q "${QEMU_TLS[@]}" --image-opts "driver=file,filename=$E2E_TMP/b.bin" \
        "$(qemu_nbd_opts)" || fail "qemu-img compare with client/ under --tls-verify-peer failed"
    log "ok: qemu-img with client/ (its certificate) is served"
    local c out
    for c in rogue-client expired-client noca-client; do
        refused "$c/ over TCP" "$(tcp_tls "$c")"
        refused "$c/ over the unix socket" "$(unix_tls "$c")"
        if out=$(probe_fp "127.0.0.1:$PORT" "$c"); then
            fail "the probe with $c/ was served (certificate $out)"
        fi
        log "ok: the probe with $c/ is refused (${out:0:100})"
    done
    served "client/ after the refusals" "$(tcp_tls client)"
    tls_stop
}

step_on() {
    step "--tls on: plain and TLS clients"
    tls_server --tls on --tls-certificates "$CERTS"
    served "nbd+unix:// (plain)" "$(unix_plain)"
    served "nbd:// (plain)" "$(tcp_plain)"
    served "nbds+unix:// (TLS)" "$(unix_tls client)"
    served "nbds:// (TLS)" "$(tcp_tls client)"
    # written in plain, read back over TLS
    timeout 60 nbdcopy "$E2E_TMP/a.bin" "$(unix_plain)" || fail "nbdcopy a.bin -> $(unix_plain) failed"
    timeout 60 nbdcopy "$(tcp_tls client)" "$E2E_TMP/out.bin" || fail "nbdcopy $(tcp_tls client) -> out.bin failed"
    cmp -n 8388608 "$E2E_TMP/a.bin" "$E2E_TMP/out.bin" || fail "written in plain, read over TLS: different"
    rm -f "$E2E_TMP/out.bin"
    log "ok: 8 MiB written in plain read back over TLS"
    tls_stop

    step "no --tls (off): plain only"
    tls_server
    served "nbd:// (plain)" "$(tcp_plain)"
    refused "nbds:// (TLS) to a server without TLS" "$(tcp_tls client)"
    tls_stop
}

step_badconf() {
    step "a bad TLS configuration is refused at start"
    start_refused "a missing --tls-certificates directory" 'cert|tls|no such' \
        --tls require --tls-certificates "$E2E_TMP/no-such-dir"
    mkdir -p "$E2E_TMP/badcerts"
    cp "$PKI"/server/*.pem "$E2E_TMP/badcerts/"
    head -c 1000 /dev/urandom | base64 >"$E2E_TMP/badcerts/server-key.pem"
    start_refused "a garbage server-key.pem" 'key|cert|tls' \
        --tls require --tls-certificates "$E2E_TMP/badcerts"
    start_refused "--tls bogus" 'tls' --tls bogus --tls-certificates "$CERTS"
    if is_cvol; then
        start_refused "--tls on with --tls-verify-peer" 'with --tls on.*use --tls require' \
            --tls on --tls-certificates "$CERTS" --tls-verify-peer
    fi
}

step_rotate() {
    if ! is_cvol; then
        skip_step "SIGHUP certificate rotation (nbdkit does not reload certificates)"
        return 0
    fi
    step "SIGHUP: new connections get the new certificate"
    cp "$PKI"/server/*.pem "$CERTS/"
    tls_server --tls require --tls-certificates "$CERTS"
    expect_fp "before the rotation" "127.0.0.1:$PORT" client "$FP_SERVER"

    # A connection opened before the rotation keeps working after it.
    local held="" held_pid=""
    if find_nbd_python; then
        held=$E2E_TMP/held
        "$NBD_PY" - "$(tcp_tls client)" "$held" <<'PYEOF' >"$held.log" 2>&1 &
import nbd, os, sys, time
uri, flag = sys.argv[1], sys.argv[2]
h = nbd.NBD()
h.set_uri_allow_local_file(True)  # tls-certificates=DIR
h.connect_uri(uri)
data = os.urandom(65536)
h.pwrite(data, 40 << 20)
h.flush()
open(flag + ".ready", "w").close()
for _ in range(600):
    if os.path.exists(flag + ".go"):
        break
    time.sleep(0.1)
else:
    sys.exit("no go signal")
assert h.pread(65536, 40 << 20) == data, "read back different data on the held connection"
h.pwrite(data, (40 << 20) + 65536)
h.flush()
h.shutdown()
print("held connection ok")
PYEOF
        held_pid=$!
        reg_pid "$held_pid"
        local until=$(($(date +%s) + 20))
        until [[ -e "$held.ready" ]]; do
            _alive "$held_pid" || fail "the connection held across the rotation failed before it: $(cat "$held.log")"
            (($(date +%s) < until)) || fail "the held connection did not write within 20 s: $(cat "$held.log")"
            sleep 0.1
        done
    else
        log "no python3 with the nbd module: the held-connection check is skipped"
    fi

    cp "$PKI"/server-rotated/*.pem "$CERTS/"
    local off
    off=$(stat -c %s "$SRV_ERR")
    kill -HUP "$SRV_PID"
    local deadline=$(($(date +%s) + 15)) got=""
    while :; do
        _alive "$SRV_PID" || fail "the server exited on SIGHUP: $(tail -n 20 "$SRV_ERR")"
        got=$(probe_fp "127.0.0.1:$PORT" client || true)
        [[ "$got" == "$FP_ROTATED" ]] && break
        (($(date +%s) < deadline)) || fail "15 s after SIGHUP new connections still get certificate ${got:0:16}… (want server-rotated's ${FP_ROTATED:0:16}…)"
        sleep 0.2
    done
    log "ok: after SIGHUP new connections get server-rotated's certificate"
    log "server log after SIGHUP: $(tail -c +$((off + 1)) "$SRV_ERR" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ' | cut -c1-300)"
    served "nbdinfo after the rotation" "$(tcp_tls client)"
    if [[ -n "$held_pid" ]]; then
        touch "$held.go"
        wait "$held_pid" || fail "the connection opened before the rotation failed after it: $(cat "$held.log")"
        unreg_pid "$held_pid"
        log "ok: a connection opened before the rotation still reads and writes after it"
    fi

    step "SIGHUP with a broken certificate directory: keep the old certificates, log an error"
    head -c 1000 /dev/urandom | base64 >"$CERTS/server-key.pem"
    off=$(stat -c %s "$SRV_ERR")
    kill -HUP "$SRV_PID"
    deadline=$(($(date +%s) + 15))
    until tail -c +$((off + 1)) "$SRV_ERR" | grep -iE 'error|fail|invalid|warn|not reloaded' | grep -qiE 'tls|cert|key'; do
        _alive "$SRV_PID" || fail "the server exited on SIGHUP with a broken key: $(tail -n 20 "$SRV_ERR")"
        (($(date +%s) < deadline)) ||
            fail "15 s after SIGHUP with a garbage server-key.pem the log says no error about TLS/the certificate/the key: $(tail -c +$((off + 1)) "$SRV_ERR")"
        sleep 0.2
    done
    log "ok: logged: $(tail -c +$((off + 1)) "$SRV_ERR" | grep -iE 'error|fail|invalid|warn|not reloaded' | grep -iE 'tls|cert|key' | head -n 1 | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200)"
    _alive "$SRV_PID" || fail "the server exited after SIGHUP with a broken key"
    expect_fp "still the rotated certificate" "127.0.0.1:$PORT" client "$FP_ROTATED"
    served "nbdinfo with the broken directory" "$(tcp_tls client)"

    step "restored + SIGHUP: the first certificate again"
    cp "$PKI"/server/*.pem "$CERTS/"
    kill -HUP "$SRV_PID"
    deadline=$(($(date +%s) + 15))
    until [[ "$(probe_fp "127.0.0.1:$PORT" client || true)" == "$FP_SERVER" ]]; do
        _alive "$SRV_PID" || fail "the server exited on SIGHUP: $(tail -n 20 "$SRV_ERR")"
        (($(date +%s) < deadline)) || fail "15 s after the restoring SIGHUP the first certificate is not served"
        sleep 0.2
    done
    log "ok: the first certificate is served again"
    served "nbds+unix:// after the rotations" "$(unix_tls client)"
    tls_stop
}

step_allow() {
    if ! is_cvol; then
        skip_step "--allow (nbdkit's ip filter 1.32 cannot parse IPv4 CIDRs)"
        return 0
    fi
    step "--allow: TCP peers outside the networks are closed"
    tls_server --allow 10.0.0.0/8
    local t0 t1
    t0=$(date +%s.%N)
    refused "nbd://127.0.0.1 under --allow 10.0.0.0/8" "$(tcp_plain)"
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { exit !(b - a < 5) }' ||
        fail "--allow: the refused connection took $(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') s (not closed at once)"
    served "the unix socket under --allow 10.0.0.0/8 (TCP only)" "$(unix_plain)"
    tls_stop
    tls_server --allow 10.0.0.0/8,127.0.0.0/8
    served "nbd://127.0.0.1 under --allow 10.0.0.0/8,127.0.0.0/8" "$(tcp_plain)"
    tls_stop
    tls_server --allow 127.0.0.0/8 --tls require --tls-certificates "$CERTS"
    served "nbds://localhost under --allow 127.0.0.0/8 and TLS" "$(tcp_tls client)"
    tls_stop
    start_refused "--allow nonsense" '--allow' --allow nonsense
    start_refused "--allow 10.0.0.0/33" '--allow' --allow 10.0.0.0/33
}

# warn_start URI-CERTDIR ARGS... -- cvol serve $VOL --listen 0.0.0.0:PORT ARGS,
# served to a client (with $PKI/URI-CERTDIR's certificate over TLS, or plain
# if "-"), then stopped; its stderr (colours stripped) in $WARN_ERR
warn_start() {
    local certdir=$1 port out err pid deadline uri
    shift
    port=$(free_port)
    out=$E2E_TMP/warn.out
    err=$E2E_TMP/warn.err
    "$CVOL" serve "$VOL" --listen "0.0.0.0:$port" "$@" >"$out" 2>"$err" &
    pid=$!
    reg_pid "$pid"
    deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    until grep -qE '^nbds?://' "$out"; do
        _alive "$pid" || fail "cvol serve --listen 0.0.0.0:$port $* exited: $(cat "$err")"
        (($(date +%s) < deadline)) || fail "cvol serve --listen 0.0.0.0:$port $* printed no URI"
        sleep 0.05
    done
    if [[ "$certdir" == - ]]; then
        uri="nbd://127.0.0.1:$port/"
    else
        uri="nbds://localhost:$port/?tls-certificates=$PKI/$certdir"
    fi
    served "$uri via 0.0.0.0 ($*)" "$uri"
    stop_server "$pid"
    WARN_ERR=$E2E_TMP/warn.clean
    sed 's/\x1b\[[0-9;]*m//g' "$err" >"$WARN_ERR"
}

step_warn() {
    if ! is_cvol; then
        skip_step "the warning for a non-loopback listener without client authentication (cvol's)"
        return 0
    fi
    step "a non-loopback listener without client authentication warns"
    local w
    warn_start -
    w=$(grep -i 'warn' "$WARN_ERR" | grep -i 'tls' | head -n 1 || true)
    [[ -n "$w" ]] || fail "--listen 0.0.0.0 without TLS: no warning line mentioning TLS on stderr: $(cat "$WARN_ERR")"
    [[ "$w" == *"--tls-verify-peer"* ]] ||
        fail "--listen 0.0.0.0 without TLS: the warning does not recommend client certificates (--tls-verify-peer): $w"
    log "ok: warned: ${w:0:200}"
    warn_start noca-client --tls require --tls-certificates "$CERTS"
    w=$(grep -i 'warn' "$WARN_ERR" | grep -i 'no client certificates' | head -n 1 || true)
    [[ -n "$w" ]] || fail "--tls require without --tls-verify-peer on 0.0.0.0: no warning: $(cat "$WARN_ERR")"
    log "ok: warned: ${w:0:200}"
    warn_start client --tls require --tls-certificates "$CERTS" --tls-verify-peer
    ! grep -qi 'warn' "$WARN_ERR" ||
        fail "--tls require --tls-verify-peer on 0.0.0.0 warned: $(grep -i 'warn' "$WARN_ERR")"
    log "ok: --tls require --tls-verify-peer on 0.0.0.0: served, no warning"
}

for s in $STEPS; do
    case "$s" in
        require) step_require ;;
        verify) step_verify ;;
        on) step_on ;;
        badconf) step_badconf ;;
        rotate) step_rotate ;;
        allow) step_allow ;;
        warn) step_warn ;;
        ctl) step_ctl ;;
        *) fail "unknown step '$s' in E2E_TLS_STEPS" ;;
    esac
done

pass "steps: $STEPS"
