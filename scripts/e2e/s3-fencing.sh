#!/usr/bin/env bash
# The object store's fencing probe with the real binary, against a tiny
# in-process S3 stand-in (Python, path-style PUT/GET/DELETE/ListObjectsV2,
# no authentication checked) that honours `If-None-Match: *` until the file
# $E2E_TMP/ignore exists, then ignores it (as a store without conditional
# PUTs does). No Ceph needed (scripts/e2e/s3.sh runs the real RGW).
#
#   honoured  create and serve work; the probe leaves no object behind
#   ignored   serve is refused (exit 2, "does not honour create-only PUTs",
#             naming --unsafe-no-fencing), nothing written; create of a new
#             volume refused with no object under its prefix
#   unsafe    serve --unsafe-no-fencing serves, warning "fencing is OFF";
#             data written and flushed reads back after a restart
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol only (volumes in an object store)"
need nbdinfo qemu-io curl

MOCK=$E2E_TMP/mock_s3.py
cat >"$MOCK" <<'PYEOF'
# mock_s3.py PORT DATADIR IGNOREFLAG -- objects in memory; If-None-Match: *
# honoured unless IGNOREFLAG (a path) exists.
import hashlib, os, sys, threading, urllib.parse
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.sax.saxutils import escape, unescape

PORT, IGNORE = int(sys.argv[1]), sys.argv[2]
OBJ = {}
LOCK = threading.Lock()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def split(self):
        u = urllib.parse.urlsplit(self.path)
        parts = u.path.lstrip("/").split("/", 1)
        return parts[0], urllib.parse.unquote(parts[1]) if len(parts) > 1 else "", urllib.parse.parse_qs(u.query)

    def reply(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, code, what):
        self.reply(code, ("<Error><Code>%s</Code></Error>" % what).encode(), [("Content-Type", "application/xml")])

    def do_PUT(self):
        b, key, _ = self.split()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        etag = '"%s"' % hashlib.md5(body).hexdigest()
        with LOCK:
            if self.headers.get("If-None-Match") == "*" and not os.path.exists(IGNORE) and (b, key) in OBJ:
                return self.error(412, "PreconditionFailed")
            OBJ[(b, key)] = (body, etag)
        self.reply(200, b"", [("ETag", etag)])

    def do_GET(self):
        b, key, q = self.split()
        if not key:
            prefix = q.get("prefix", [""])[0]
            with LOCK:
                keys = sorted((k, v) for (bb, k), v in OBJ.items() if bb == b and k.startswith(prefix))
            items = "".join(
                "<Contents><Key>%s</Key><Size>%d</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                "<ETag>%s</ETag></Contents>" % (escape(k), len(v[0]), escape(v[1])) for k, v in keys)
            xml = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>%s</Name><Prefix>%s</Prefix>'
                   "<KeyCount>%d</KeyCount><IsTruncated>false</IsTruncated>%s</ListBucketResult>"
                   % (escape(b), escape(prefix), len(keys), items))
            return self.reply(200, xml.encode(), [("Content-Type", "application/xml")])
        with LOCK:
            o = OBJ.get((b, key))
        if o is None:
            return self.error(404, "NoSuchKey")
        body, etag = o
        hdrs = [("ETag", etag), ("Last-Modified", formatdate(usegmt=True))]
        r = self.headers.get("Range")
        if r and r.startswith("bytes="):
            a, _, z = r[6:].partition("-")
            a = int(a)
            z = min(int(z) if z else len(body) - 1, len(body) - 1)
            return self.reply(206, body[a:z + 1], hdrs + [("Content-Range", "bytes %d-%d/%d" % (a, z, len(body)))])
        self.reply(200, body, hdrs)

    do_HEAD = do_GET

    def do_POST(self):  # ?delete: a batch of keys
        b, _, q = self.split()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        if "delete" not in q and "delete" not in urllib.parse.urlsplit(self.path).query:
            return self.error(501, "NotImplemented")
        keys = [k.split("</Key>")[0] for k in body.split("<Key>")[1:]]
        with LOCK:
            for k in keys:
                OBJ.pop((b, unescape(k)), None)
        xml = "<DeleteResult>%s</DeleteResult>" % "".join("<Deleted><Key>%s</Key></Deleted>" % k for k in keys)
        self.reply(200, xml.encode(), [("Content-Type", "application/xml")])

    def do_DELETE(self):
        b, key, _ = self.split()
        with LOCK:
            OBJ.pop((b, key), None)
        self.reply(204)


ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
PYEOF

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
IGNORE=$E2E_TMP/ignore
"$PY" "$MOCK" "$PORT" "$IGNORE" 2>"$E2E_TMP/mock.err" &
reg_pid $!
wait_until 10 "the S3 stand-in listens on $PORT" curl -s -o /dev/null "http://127.0.0.1:$PORT/bkt?list-type=2"
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
    AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
export CVOL_RUN_DIR=$E2E_TMP/run
mkdir -p "$CVOL_RUN_DIR"

# keys PREFIX -- object names under PREFIX in bucket bkt
keys() { curl -s "http://127.0.0.1:$PORT/bkt?list-type=2&prefix=$1" | grep -o '<Key>[^<]*</Key>' || true; }

N=0
# serve URL ARGS... -- start a server (SRV_PID, SRV_URI, SRV_ERR); 1 if it exits first
serve() {
    local url=$1 deadline
    shift
    N=$((N + 1))
    SRV_ERR=$E2E_TMP/srv$N.err
    "$CVOL" serve "$url" --socket "$E2E_TMP/srv$N.sock" --cache-dir "$E2E_TMP/cache$N" --lease 1 "$@" \
        >"$E2E_TMP/srv$N.out" 2>"$SRV_ERR" &
    SRV_PID=$!
    reg_pid "$SRV_PID"
    deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    until SRV_URI=$(grep -m1 '^nbd+unix://' "$E2E_TMP/srv$N.out" 2>/dev/null); do
        if ! _alive "$SRV_PID"; then
            SRV_RC=0
            wait "$SRV_PID" || SRV_RC=$?
            unreg_pid "$SRV_PID"
            return 1
        fi
        (($(date +%s) < deadline)) || fail "cvol serve $url printed no URI: $(tail -n 5 "$SRV_ERR")"
        sleep 0.05
    done
}

step "honoured: create and serve work, the probe leaves nothing"
"$CVOL" create s3://bkt/v --size 64M >"$E2E_TMP/create.log" 2>&1 ||
    fail "cvol create s3://bkt/v: $(cat "$E2E_TMP/create.log")"
serve s3://bkt/v || fail "serve on an honouring store exited $SRV_RC: $(cat "$SRV_ERR")"
qemu-io -f raw -c "write -P 0x5a 0 1M" -c flush "$SRV_URI" >/dev/null || fail "qemu-io write failed"
stop_server "$SRV_PID"
[[ -z "$(keys v/probe/)" ]] || fail "probe objects left behind: $(keys v/probe/)"
log "ok: $(keys v/ | wc -l) objects under v/, none under v/probe/"

step "ignored: a store that ignores If-None-Match is refused"
touch "$IGNORE"
before=$(keys v/)
rc=0
serve s3://bkt/v || rc=$SRV_RC
((rc == 2)) || fail "serve on a store ignoring create-only PUTs: expected exit 2, got ${rc} (running: ${SRV_URI:-})"
grep -q "does not honour create-only PUTs" "$SRV_ERR" && grep -q -- "--unsafe-no-fencing" "$SRV_ERR" ||
    fail "serve's refusal does not give the reason and the flag: $(cat "$SRV_ERR")"
[[ "$(keys v/)" == "$before" ]] || fail "the refused serve changed the objects"
log "ok: serve refused: $(grep -m1 'honour' "$SRV_ERR" | cut -c1-200)"
rc=0
"$CVOL" create s3://bkt/w --size 64M >"$E2E_TMP/create2.log" 2>&1 || rc=$?
((rc == 2)) && grep -q "does not honour create-only PUTs" "$E2E_TMP/create2.log" ||
    fail "create on a store ignoring create-only PUTs: exit $rc: $(cat "$E2E_TMP/create2.log")"
[[ -z "$(keys w/)" ]] || fail "the refused create left objects: $(keys w/)"
log "ok: create refused, nothing under w/"

step "unsafe: --unsafe-no-fencing serves one writer, warning"
serve s3://bkt/v --unsafe-no-fencing || fail "serve --unsafe-no-fencing exited $SRV_RC: $(cat "$SRV_ERR")"
grep -q "fencing is OFF" "$SRV_ERR" || fail "no warning that fencing is off: $(cat "$SRV_ERR")"
qemu-io -f raw -c "read -P 0x5a 0 1M" -c "write -P 0x6b 1M 1M" -c flush "$SRV_URI" >"$E2E_TMP/qio.out" ||
    fail "qemu-io under --unsafe-no-fencing failed"
stop_server "$SRV_PID"
serve s3://bkt/v --unsafe-no-fencing || fail "second serve --unsafe-no-fencing exited $SRV_RC: $(cat "$SRV_ERR")"
qemu-io -f raw -c "read -P 0x5a 0 1M" -c "read -P 0x6b 1M 1M" "$SRV_URI" >"$E2E_TMP/qio.out" ||
    fail "data written under --unsafe-no-fencing did not read back: $(cat "$E2E_TMP/qio.out")"
grep -qi "fail\|error" "$E2E_TMP/qio.out" && fail "qemu-io: $(cat "$E2E_TMP/qio.out")"
stop_server "$SRV_PID"
log "ok: written, restarted, read back"
pass "honoured, ignored, unsafe"
