#!/usr/bin/env bash
# service: running cvol as a service.
#  - systemd's notify protocol against a fake NOTIFY_SOCKET (a Python
#    datagram listener): READY=1 only once the export answers, WATCHDOG=1
#    at half of WATCHDOG_USEC, STOPPING=1 at SIGTERM; SIGHUP does not kill
#    a server without TLS;
#  - `--metrics`: a real scrape with curl after nbdcopy writes and reads:
#    request counters, latency histograms, stat figures with the `volume`
#    label, `promtool check metrics` when promtool is installed (Debian's
#    prometheus package; scripts/test installs it); 404 elsewhere; bad
#    `--metrics` values refused before the volume is touched; stuck
#    scrapers delay no other scrape and are closed at the deadline;
#  - `--trace FILE`: a session recorded, `cvol trace show` totals it,
#    `cvol trace replay` runs the same requests on another volume;
#  - `cvol man DIR` and `cvol completions SHELL`;
#  - contrib/systemd/cvol@.service passes `systemd-analyze verify`.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol-only test (systemd notify, metrics)"
need nbdcopy
need curl
need_nbd_python

VOL=$E2E_TMP/vol.cvol
NOTIFY=$E2E_TMP/notify.sock
MSGS=$E2E_TMP/notify.log
make_volume "$VOL" 128M

free_port() {
    "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

step "a fake systemd: a datagram socket logging what it is told"
"$PY" - "$NOTIFY" "$MSGS" <<'EOF' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
with open(sys.argv[2], "a", buffering=1) as out:
    while True:
        data = s.recv(4096).decode()
        out.write("%.3f %s\n" % (time.time(), data.replace("\n", "|")))
EOF
LISTENER=$!
reg_pid "$LISTENER"
wait_until 10 "notify socket" test -S "$NOTIFY"

PORT=$(free_port)
step "serve with NOTIFY_SOCKET, WATCHDOG_USEC=400000 and --metrics $PORT"
# systemd sets WATCHDOG_PID to the service's main PID: a wrapper that execs
# cvol knows it in advance.
printf '#!/bin/sh\nexport WATCHDOG_PID=$$\nexec "%s" "$@"\n' "$CVOL" >"$E2E_TMP/cvol-under-systemd"
chmod +x "$E2E_TMP/cvol-under-systemd"
REAL_CVOL=$CVOL
CVOL=$E2E_TMP/cvol-under-systemd NOTIFY_SOCKET=$NOTIFY WATCHDOG_USEC=400000 start_server "$VOL" --metrics "$PORT"
CVOL=$REAL_CVOL
grep -q "READY=1" "$MSGS" || fail "no READY=1 by the time the URI was printed: $(cat "$MSGS")"
ready_line=$(grep -m1 "READY=1" "$MSGS")
[[ "$ready_line" == *"STATUS=serving nbd+unix://"* ]] || fail "READY without the URIs in STATUS: $ready_line"
log "notify: $ready_line"

step "the export answers, data goes in and out"
head -c 16M /dev/urandom >"$E2E_TMP/data.bin"
nbdcopy "$E2E_TMP/data.bin" "$SRV_URI" || fail "nbdcopy in"
nbdcopy "$SRV_URI" "$E2E_TMP/back.bin" || fail "nbdcopy out"
cmp <(head -c 16M "$E2E_TMP/back.bin") "$E2E_TMP/data.bin" || fail "data differs"

step "watchdog pings at about half the interval"
sleep 1.2
pings=$(grep -c "WATCHDOG=1" "$MSGS" || true)
((pings >= 2)) || fail "expected >= 2 WATCHDOG=1 within ~1.2 s, got $pings: $(cat "$MSGS")"
log "watchdog pings so far: $pings"

step "scrape /metrics"
curl -fsS "http://127.0.0.1:$PORT/metrics" >"$E2E_TMP/metrics.txt" || fail "curl /metrics failed"
head -n 5 "$E2E_TMP/metrics.txt"
"$PY" - "$E2E_TMP/metrics.txt" "$VOL" <<'EOF' || fail "metrics checks failed (see above)"
import re, sys
text = open(sys.argv[1]).read()
vol = sys.argv[2]
errors = []
def value(name, labels):
    pat = re.escape(name) + r"\{([^}]*)\} (\S+)"
    for m in re.finditer(pat, text):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    errors.append("no %s%r" % (name, labels))
    return None
v = {"volume": vol}
w = value("cvol_requests_total", dict(v, command="write"))
r = value("cvol_requests_total", dict(v, command="read"))
if w is not None and w < 1: errors.append("no write counted: %s" % w)
if r is not None and r < 1: errors.append("no read counted: %s" % r)
b = value("cvol_request_bytes_total", dict(v, command="write"))
if b is not None and b < 16 << 20: errors.append("write bytes %s < 16 MiB" % b)
c = value("cvol_request_duration_seconds_count", dict(v, command="write"))
if c is not None and w is not None and c != w: errors.append("histogram count %s != requests %s" % (c, w))
value("cvol_request_duration_seconds_bucket", dict(v, command="read", le="+Inf"))
value("cvol_requests_in_flight", v)
n = value("cvol_nbd_request_duration_seconds_count", dict(v, command="write"))
if n is not None and w is not None and n < w: errors.append("server-side write latencies %s < volume writes %s" % (n, w))
value("cvol_nbd_connections", v)
u = value("cvol_physical_used_bytes", v)
if u is not None and u <= 0: errors.append("physical_used_bytes %s" % u)
cw = value("cvol_client_bytes_written_total", v)
if cw is not None and cw < 16 << 20: errors.append("client_bytes_written_total %s" % cw)
value("cvol_blocks_by_codec", dict(v, codec="none"))
value("cvol_volume_info", dict(v, cleaner_policy="cost-benefit"))  # as `cvol stat` spells it
value("cvol_load_level", v)
for t in ("# TYPE cvol_requests_total counter", "# TYPE cvol_request_duration_seconds histogram",
          "# TYPE cvol_physical_used_bytes gauge", "# TYPE cvol_client_bytes_written_total counter"):
    if t not in text: errors.append("missing %r" % t)
for e in errors: print("  check failed:", e)
sys.exit(1 if errors else 0)
EOF
if command -v promtool >/dev/null 2>&1; then
    promtool check metrics <"$E2E_TMP/metrics.txt" >"$E2E_TMP/promtool.out" 2>&1 ||
        fail "promtool check metrics: $(cat "$E2E_TMP/promtool.out")"
    log "promtool check metrics: ok $(head -c 300 "$E2E_TMP/promtool.out")"
else
    log "promtool not installed (Debian: prometheus): format checked by the scrape above only"
fi
# A scraper asking for OpenMetrics (Prometheus does) gets it.
curl -fsS -D "$E2E_TMP/om.head" -H 'Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5' \
    "http://127.0.0.1:$PORT/metrics" >"$E2E_TMP/om.txt" || fail "curl OpenMetrics"
grep -qi "^content-type: application/openmetrics-text" "$E2E_TMP/om.head" || fail "no OpenMetrics content type: $(cat "$E2E_TMP/om.head")"
grep -q "^# TYPE cvol_requests counter$" "$E2E_TMP/om.txt" && [[ $(tail -n 1 "$E2E_TMP/om.txt") == "# EOF" ]] ||
    fail "OpenMetrics exposition malformed: $(head -c 300 "$E2E_TMP/om.txt")"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/nope")
[[ "$code" == 404 ]] || fail "GET /nope answered $code, expected 404"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:$PORT/metrics")
[[ "$code" == 405 ]] || fail "POST /metrics answered $code, expected 405"
# Stuck scrapers (silent, or trickling a byte every 300 ms) delay no other
# scrape, and each is closed at the per-scrape deadline (5 s).
"$PY" - "$PORT" >"$E2E_TMP/stuck-scrapers.log" 2>&1 <<'EOF' &
import socket, sys, time
port = int(sys.argv[1])
silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
trickler = socket.create_connection(("127.0.0.1", port))
trickler.settimeout(0.3)
start = time.monotonic()
while time.monotonic() - start < 20:
    try:
        trickler.send(b"G")
        if trickler.recv(1) == b"":
            break
    except socket.timeout:
        continue
    except OSError:
        break
print(f"trickler closed after {time.monotonic() - start:.1f} s")
EOF
STUCK_PID=$!
sleep 0.5
for i in 1 2 3; do
    curl -fsS --max-time 2 "http://127.0.0.1:$PORT/metrics" >/dev/null || fail "scrape $i while scrapers are stuck"
done
wait "$STUCK_PID" || fail "stuck scrapers: $(cat "$E2E_TMP/stuck-scrapers.log")"
log "$(cat "$E2E_TMP/stuck-scrapers.log")"
closed_after=$(awk '/trickler closed/ {print int($4)}' "$E2E_TMP/stuck-scrapers.log")
[[ -n "$closed_after" && "$closed_after" -le 10 ]] ||
    fail "the trickling scraper was not closed at the deadline: $(cat "$E2E_TMP/stuck-scrapers.log")"

step "SIGHUP without TLS is logged, not fatal"
kill -HUP "$SRV_PID"
wait_until 10 "SIGHUP logged" grep -q "SIGHUP: nothing to reload" "$SRV_ERR"
_alive "$SRV_PID" || fail "the server died of SIGHUP"
nbdcopy "$SRV_URI" "$E2E_TMP/again.bin" || fail "nbdcopy after SIGHUP"
cmp <(head -c 16M "$E2E_TMP/again.bin") "$E2E_TMP/data.bin" || fail "data differs after SIGHUP"

step "SIGTERM: STOPPING=1, clean exit"
stop_server
grep -q "STOPPING=1" "$MSGS" || fail "no STOPPING=1: $(cat "$MSGS")"

step "bad --metrics values are refused before the volume is touched"
sum_before=$(sha256sum "$VOL" | cut -d' ' -f1)
for bad in nonsense 127.0.0.1:99999 "$PORT:$PORT"; do
    rc=0
    timeout 20 "$CVOL" serve "$VOL" --socket "$E2E_TMP/bad.sock" --metrics "$bad" >"$E2E_TMP/bad.out" 2>"$E2E_TMP/bad.err" || rc=$?
    [[ $rc -eq 2 ]] || fail "--metrics $bad: exit $rc, expected 2"
    grep -q -- "--metrics" "$E2E_TMP/bad.err" || fail "--metrics $bad: message does not name --metrics: $(cat "$E2E_TMP/bad.err")"
done
BUSY=$(free_port)
"$PY" -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1",int(sys.argv[1]))); s.listen(); time.sleep(30)' "$BUSY" &
HOLDER=$!
reg_pid "$HOLDER"
port_taken() { "$PY" -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$1"; }
wait_until 10 "port $BUSY held" port_taken "$BUSY"
rc=0
timeout 20 "$CVOL" serve "$VOL" --socket "$E2E_TMP/bad.sock" --metrics "$BUSY" >/dev/null 2>"$E2E_TMP/bad.err" || rc=$?
[[ $rc -eq 2 ]] && grep -q "another exporter" "$E2E_TMP/bad.err" || fail "--metrics on a busy port: exit $rc: $(cat "$E2E_TMP/bad.err")"
kill "$HOLDER" 2>/dev/null || true
[[ $(sha256sum "$VOL" | cut -d' ' -f1) == "$sum_before" ]] || fail "a refused serve changed the volume"

step "--trace: record a session, show it, replay it on another volume"
TRACE=$E2E_TMP/session.trace
start_server "$VOL" --trace "$TRACE"
nbdcopy --flush "$E2E_TMP/data.bin" "$SRV_URI" || fail "nbdcopy in (traced)"
nbdcopy "$SRV_URI" "$E2E_TMP/back2.bin" || fail "nbdcopy out (traced)"
stop_server
grep -q "trace .* written records=" "$SRV_ERR" || fail "no trace summary in the log: $(tail -n 3 "$SRV_ERR")"
"$CVOL" trace show "$TRACE" --json >"$E2E_TMP/trace.json" || fail "cvol trace show"
"$PY" - "$E2E_TMP/trace.json" <<'EOF' || fail "trace contents (see above)"
import json, sys
t = json.load(open(sys.argv[1]))
c = t["by_command"]
errors = []
if t["volume_bytes"] != 128 << 20: errors.append("volume_bytes %r" % t["volume_bytes"])
if c.get("write", {}).get("bytes", 0) < 16 << 20: errors.append("writes: %r" % c.get("write"))
if c.get("read", {}).get("bytes", 0) < 16 << 20: errors.append("reads: %r" % c.get("read"))
if "flush" not in c: errors.append("no flush (nbdcopy --flush)")
if t["trailing_bytes"] != 0: errors.append("trailing bytes %r" % t["trailing_bytes"])
for e in errors: print("  check failed:", e)
sys.exit(1 if errors else 0)
EOF
"$CVOL" trace show "$TRACE" --limit 3 | head -n 8
VOL2=$E2E_TMP/replay.cvol
make_volume "$VOL2" 128M
"$CVOL" trace replay "$TRACE" "$VOL2" --json >"$E2E_TMP/replay.json" || fail "cvol trace replay"
"$PY" - "$E2E_TMP/trace.json" "$E2E_TMP/replay.json" <<'EOF' || fail "replay did not run the trace's requests"
import json, sys
t, r = (json.load(open(p)) for p in sys.argv[1:3])
for cmd, v in t["by_command"].items():
    got = r["by_command"].get(cmd, {})
    if (got.get("requests"), got.get("bytes")) != (v["requests"], v["bytes"]):
        sys.exit("%s: trace %r, replay %r" % (cmd, v, got))
if r["errors"]: sys.exit("replay errors: %r" % r["errors"])
print("replayed", r["requests"], "requests at", round(r["requests_per_second"]), "per second; stored",
      r["volume"]["stored_bytes"], "bytes")
EOF
cvol_check "$VOL2"
rc=0
"$CVOL" serve "$VOL" --socket "$E2E_TMP/bad.sock" --trace "$TRACE" >/dev/null 2>"$E2E_TMP/bad.err" || rc=$?
[[ $rc -eq 2 ]] && grep -q "exists; refusing" "$E2E_TMP/bad.err" || fail "--trace onto an existing file: exit $rc: $(cat "$E2E_TMP/bad.err")"
rc=0
"$CVOL" trace replay "$VOL" "$VOL2" >/dev/null 2>"$E2E_TMP/bad.err" || rc=$?
[[ $rc -eq 2 ]] && grep -q "not a cvol trace" "$E2E_TMP/bad.err" || fail "replay of a non-trace: exit $rc: $(cat "$E2E_TMP/bad.err")"

step "man pages and completions"
mkdir -p "$E2E_TMP/man"
"$CVOL" man "$E2E_TMP/man" >/dev/null || fail "cvol man"
for page in cvol cvol-serve cvol-create cvol-stat cvol-check cvol-scrub; do
    [[ -s "$E2E_TMP/man/$page.1" ]] || fail "no $page.1"
done
grep -q -- "tls\\\\-certificates" "$E2E_TMP/man/cvol-serve.1" || fail "cvol-serve.1 does not list --tls-certificates"
if command -v man >/dev/null 2>&1; then
    MANWIDTH=80 man -l "$E2E_TMP/man/cvol-serve.1" 2>/dev/null | grep -q -- "--metrics" || fail "man -l cvol-serve.1 does not show --metrics"
fi
"$CVOL" completions bash >"$E2E_TMP/cvol.bash" || fail "cvol completions bash"
bash -n "$E2E_TMP/cvol.bash" || fail "the bash completion is not valid bash"
grep -q -- "--tls-verify-peer" "$E2E_TMP/cvol.bash" || fail "completion lacks --tls-verify-peer"
"$CVOL" completions zsh | grep -q "#compdef cvol" || fail "zsh completion"
rc=0
"$CVOL" completions nosuchshell >/dev/null 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "completions for an unknown shell succeeded"

step "the systemd unit"
if command -v systemd-analyze >/dev/null 2>&1; then
    mkdir -p "$E2E_TMP/unit"
    sed "s#/usr/bin/cvol#$CVOL#" "$E2E_REPO_ROOT/contrib/systemd/cvol@.service" >"$E2E_TMP/unit/cvol@.service"
    systemd-analyze verify --man=no "$E2E_TMP/unit/cvol@test.service" >"$E2E_TMP/verify.out" 2>&1 ||
        fail "systemd-analyze verify: $(cat "$E2E_TMP/verify.out")"
    log "systemd-analyze verify: ok"
else
    log "systemd-analyze not installed: unit not verified"
fi

pass
