#!/usr/bin/env bash
# A hostile local user: `nobody` (through setpriv) attacks what root (and a
# second user, `daemon`, as an unprivileged victim) do with cvol on the same
# machine. Steps (E2E_HOSTILE_STEPS, in this order by default):
#
#   tmp     offline commands on an object-store volume (`cvol create|stat|
#           scrub s3://...`, against scripts/e2e/py/tiny_s3.py, an in-memory
#           S3 endpoint) while nobody has planted, in their TMPDIR (a sticky
#           1777 directory, like /tmp), a directory for each of the next
#           3000 process ids at the names cvol once used (cvol-read-PID,
#           cvol-create-PID), each holding the cache file's name as a
#           symbolic link to a root-owned victim file: the victim is
#           unchanged, every planted entry is still there as it was, and
#           root's own temporary directories are gone
#   perms   a created volume, metadata device, cache volume (--origin) and
#           the default volume of `cvol serve` with no VOLUME (its directory
#           ./cvol-data too) are private (0600 files, a 0700 directory):
#           nobody cannot read them; nobody's `flock -s` cannot even open
#           the volume
#   lock    with the volume made 0644 on purpose, nobody holds `flock -s` on
#           it (it can read it now): `cvol serve` starts anyway, warns that
#           the file is readable by others, and serves
#   ctl     the control socket: root's `cvol stat` of a served volume finds
#           root's server (served: yes) while nobody listens on a socket at
#           the old predictable name in TMPDIR, and nobody's socket is
#           never connected to; for daemon (no XDG_RUNTIME_DIR, so its
#           sockets go in TMPDIR/cvol-1), nobody pre-creates TMPDIR/cvol-1
#           (a directory of theirs, then a symbolic link to one): daemon's
#           `cvol serve` refuses with the reason (exit 2) before opening the
#           volume (unchanged); once the squat is gone, daemon's serve makes
#           the directory 0700 and daemon's `cvol stat` reaches its server
#   flags   absurd numbers refused with a range (exit 2, no panic, volume
#           unchanged): --handshake-timeout 18446744073709551615,
#           --read-cache 99999T, --dedup-memory 0, --workers 5000, and
#           daemon's `--workers 200` under `ulimit -u 40` (the thread limit
#           is met before the volume is opened)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol only (file modes, locks and the control socket)"
need_root
need setpriv flock python3 sha256sum stat timeout
need_server

STEPS=${E2E_HOSTILE_STEPS:-tmp perms lock ctl flags}
TMPD=$E2E_TMP/tmp
# The other users' python: one they can run (not a shim under /root).
OPY=/usr/bin/python3
[[ -x $OPY ]] || skip "$OPY missing (the other users' python)"
has_step() { [[ " $STEPS " == *" $1 "* ]]; }

# setpriv execs the command itself (no process in between), so the pid of
# a background one ("${AS_NOBODY[@]}" CMD &) is the command's and signals
# reach it.
AS_NOBODY=(setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups --)
AS_DAEMON=(setpriv --reuid="$(id -u daemon)" --regid="$(id -g daemon)" --clear-groups --
    env -u XDG_RUNTIME_DIR TMPDIR="$TMPD")
mode_of() { stat -c %a "$1"; }
fingerprint() { stat -c '%s %Y %a %U' "$1" && sha256sum <"$1"; }

# Layout: E2E_TMP (root's, 0700) opened for traversal only; pub/ where root
# keeps its files (0755: others may look, the files' modes decide); tmp/ a
# shared sticky temporary directory (TMPDIR of every command here); the
# binary copied where the other users can run it.
chmod 0711 "$E2E_TMP"
PUB=$E2E_TMP/pub
mkdir -p "$PUB" "$TMPD" "$E2E_TMP/bin"
chmod 0755 "$PUB" "$E2E_TMP/bin"
chmod 1777 "$TMPD"
cp "$CVOL" "$E2E_TMP/bin/cvol"
chmod 0755 "$E2E_TMP/bin/cvol"
CVOL=$E2E_TMP/bin/cvol
export TMPDIR=$TMPD
unset CVOL_RUN_DIR
umask 022
cd "$PUB"

# ------------------------------------------------------------------ tmp ----
if has_step tmp; then
    step "tmp: planted directories and links in TMPDIR change nothing (offline s3:// commands)"
    rm -f "$E2E_TMP/s3.port"
    python3 "$E2E_DIR/py/tiny_s3.py" "$E2E_TMP/s3.port" >"$E2E_TMP/s3.log" 2>&1 &
    reg_pid $!
    wait_until 10 "tiny_s3.py to start" test -s "$E2E_TMP/s3.port"
    export AWS_ENDPOINT_URL=http://127.0.0.1:$(cat "$E2E_TMP/s3.port") AWS_ALLOW_HTTP=true \
        AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1
    "$CVOL" create s3://bkt/vol --size 64M >/dev/null 2>"$E2E_TMP/create.err" ||
        fail "cvol create s3://bkt/vol: $(cat "$E2E_TMP/create.err")"
    victim=$PUB/victim
    head -c 1M /dev/urandom >"$victim"
    chmod 0644 "$victim"
    before=$(fingerprint "$victim")
    # nobody plants for the next 3000 process ids (the cache file is named
    # after the volume: bkt_vol.cache, bkt_vol2.cache).
    first=$(($(cat /proc/sys/kernel/ns_last_pid) + 1))
    "${AS_NOBODY[@]}" "$OPY" - "$TMPD" "$victim" "$first" 3000 <<'EOF'
import os, sys
tmp, victim, first, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for pid in range(first, first + n):
    for what in ("read", "create"):
        d = os.path.join(tmp, "cvol-%s-%d" % (what, pid))
        os.mkdir(d)
        os.chmod(d, 0o777)
        for name in ("bkt_vol.cache", "bkt_vol2.cache"):
            os.symlink(victim, os.path.join(d, name))
EOF
    planted=$(find "$TMPD" -mindepth 1 -user nobody | wc -l)
    log "nobody planted $planted entries (pids $first..$((first + 2999)))"
    "$CVOL" stat s3://bkt/vol >"$E2E_TMP/stat.out" 2>"$E2E_TMP/stat.err" ||
        fail "cvol stat s3://bkt/vol exited $?: $(tail -n 5 "$E2E_TMP/stat.err")"
    grep -q "served *no" "$E2E_TMP/stat.out" || fail "stat output: $(head -n 3 "$E2E_TMP/stat.out")"
    "$CVOL" scrub s3://bkt/vol >/dev/null 2>"$E2E_TMP/scrub.err" ||
        fail "cvol scrub s3://bkt/vol exited $?: $(tail -n 5 "$E2E_TMP/scrub.err")"
    "$CVOL" create s3://bkt/vol2 --size 64M >/dev/null 2>"$E2E_TMP/create2.err" ||
        fail "cvol create s3://bkt/vol2: $(cat "$E2E_TMP/create2.err")"
    [[ "$(fingerprint "$victim")" == "$before" ]] ||
        fail "the victim file changed: $before -> $(fingerprint "$victim")"
    after=$(find "$TMPD" -mindepth 1 -user nobody | wc -l)
    ((after == planted)) || fail "nobody's planted entries: $planted before, $after after"
    broken=$(find "$TMPD" -mindepth 2 -name '*.cache' ! -type l | head -n 3)
    [[ -z "$broken" ]] || fail "a planted link was replaced: $broken"
    left=$(find "$TMPD" -mindepth 1 ! -user nobody | head -n 3)
    [[ -z "$left" ]] || fail "root's temporary files were left behind: $left"
    log "ok: victim unchanged ($(stat -c %s "$victim") bytes), $planted planted entries untouched, nothing of root's left in TMPDIR"
    find "$TMPD" -mindepth 1 -delete
fi

# ---------------------------------------------------------------- perms ----
if has_step perms || has_step lock || has_step ctl || has_step flags; then
    "$CVOL" create "$PUB/vol.cvol" --size 64M >/dev/null
fi
if has_step perms; then
    step "perms: what cvol creates is private"
    "$CVOL" create "$PUB/mvol.cvol" --size 64M --metadata-device "$PUB/meta.md" >/dev/null
    head -c 16M /dev/zero >"$PUB/origin.img"
    "$CVOL" create "$PUB/cache.cvol" --origin "$PUB/origin.img" --physical-size 32M >/dev/null
    mkdir "$PUB/dflt"
    chmod 0755 "$PUB/dflt"
    (cd "$PUB/dflt" && exec "$CVOL" serve --socket "$PUB/dflt.sock" >"$E2E_TMP/dflt.out" 2>"$E2E_TMP/dflt.err") &
    SRV_PID=$!
    reg_pid "$SRV_PID"
    wait_until 30 "serve with no VOLUME to start" grep -q '^nbd+unix://' "$E2E_TMP/dflt.out"
    stop_server "$SRV_PID"
    for f in vol.cvol mvol.cvol meta.md cache.cvol dflt/cvol-data/default.cvol; do
        m=$(mode_of "$PUB/$f")
        [[ $m == 600 ]] || fail "$f is mode $m (umask 022), expected 600"
        if "${AS_NOBODY[@]}" cat "$PUB/$f" >/dev/null 2>&1; then
            fail "nobody can read $f"
        fi
    done
    m=$(mode_of "$PUB/dflt/cvol-data")
    [[ $m == 700 ]] || fail "serve's ./cvol-data is mode $m, expected 700"
    if "${AS_NOBODY[@]}" flock -n -s "$PUB/vol.cvol" true 2>/dev/null; then
        fail "nobody could open and lock vol.cvol"
    fi
    log "ok: volume, metadata device, cache, default volume 0600, cvol-data 0700; nobody can neither read nor lock them"
fi

# ----------------------------------------------------------------- lock ----
if has_step lock; then
    step "lock: nobody's shared flock on a readable volume does not stop the server"
    chmod 0644 "$PUB/vol.cvol"
    # flock(1)'s -s, in one process (so that killing it lets go).
    "${AS_NOBODY[@]}" "$OPY" -c 'import fcntl, sys, time
f = open(sys.argv[1])
fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
open(sys.argv[2], "w").write("held\n")
time.sleep(120)' "$PUB/vol.cvol" "$TMPD/held" &
    holder=$!
    reg_pid "$holder"
    wait_until 10 "nobody's shared flock" test -s "$TMPD/held"
    start_server "$PUB/vol.cvol"
    grep -q "mode 0644: other users may read it" "$SRV_ERR" ||
        fail "no warning about a volume others can read: $(head -n 5 "$SRV_ERR")"
    stop_server
    kill "$holder" 2>/dev/null || true
    wait "$holder" 2>/dev/null || true
    unreg_pid "$holder"
    chmod 0600 "$PUB/vol.cvol"
    log "ok: served while nobody held flock -s; warned about mode 0644"
fi

# ------------------------------------------------------------------ ctl ----
if has_step ctl; then
    step "ctl: root's stat never talks to a socket nobody made"
    vid=$(printf 'cvol-%x-%x.ctl' "$(stat -c %d "$PUB/vol.cvol")" "$(stat -c %i "$PUB/vol.cvol")")
    # nobody listens at the old name, logging every connection.
    "${AS_NOBODY[@]}" "$OPY" - "$TMPD/$vid" "$TMPD/fake.log" <<'EOF' &
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
s.listen(8)
while True:
    c, _ = s.accept()
    with open(sys.argv[2], "a") as f:
        f.write("connected\n")
    c.sendall(b'{"served": true, "volume": "nobody was here"}\n')
    c.close()
EOF
    fake=$!
    reg_pid "$fake"
    wait_until 10 "nobody's fake socket" test -S "$TMPD/$vid"
    start_server "$PUB/vol.cvol"
    "$CVOL" stat "$PUB/vol.cvol" --json >"$E2E_TMP/ctl.json" 2>"$E2E_TMP/ctl.err" ||
        fail "root's stat of its served volume exited $?: $(cat "$E2E_TMP/ctl.err")"
    grep -q '"served": *true' "$E2E_TMP/ctl.json" || fail "stat did not reach the server: $(head -c 300 "$E2E_TMP/ctl.json")"
    ! grep -q "nobody was here" "$E2E_TMP/ctl.json" || fail "stat believed nobody's socket"
    [[ ! -s "$TMPD/fake.log" ]] || fail "root's stat connected to nobody's socket"
    stop_server
    kill "$fake" 2>/dev/null || true
    wait "$fake" 2>/dev/null || true
    unreg_pid "$fake"
    log "ok: root's stat reached root's server (served: true); nobody's socket at $vid was never connected to"

    step "ctl: a squatted per-user directory is refused before the volume opens"
    DMN=$E2E_TMP/daemon
    mkdir -p "$DMN"
    chown daemon: "$DMN"
    chmod 0755 "$DMN"
    "${AS_DAEMON[@]}" "$CVOL" create "$DMN/d.cvol" --size 64M >/dev/null
    before=$(fingerprint "$DMN/d.cvol")
    squat=$TMPD/cvol-$(id -u daemon)
    "${AS_NOBODY[@]}" mkdir -m 0777 "$squat"
    rc=0
    "${AS_DAEMON[@]}" timeout 30 "$CVOL" serve "$DMN/d.cvol" --socket "$DMN/d.sock" >/dev/null 2>"$E2E_TMP/squat1.err" || rc=$?
    ((rc == 2)) || fail "daemon's serve with nobody's $squat exited $rc, expected 2: $(cat "$E2E_TMP/squat1.err")"
    grep -q "belongs to another user" "$E2E_TMP/squat1.err" || fail "no reason given: $(cat "$E2E_TMP/squat1.err")"
    rmdir "$squat"
    "${AS_NOBODY[@]}" mkdir -m 0700 "$TMPD/nobodys"
    "${AS_NOBODY[@]}" ln -s "$TMPD/nobodys" "$squat"
    rc=0
    "${AS_DAEMON[@]}" timeout 30 "$CVOL" serve "$DMN/d.cvol" --socket "$DMN/d.sock" >/dev/null 2>"$E2E_TMP/squat2.err" || rc=$?
    ((rc == 2)) || fail "daemon's serve with a symbolic link at $squat exited $rc, expected 2: $(cat "$E2E_TMP/squat2.err")"
    grep -q "symbolic link" "$E2E_TMP/squat2.err" || fail "no reason given: $(cat "$E2E_TMP/squat2.err")"
    [[ "$(fingerprint "$DMN/d.cvol")" == "$before" ]] || fail "a refused serve changed the volume"
    [[ -z "$(ls -A "$TMPD/nobodys")" ]] || fail "something was put in nobody's directory: $(ls -A "$TMPD/nobodys")"
    rm -f "$squat"
    log "ok: refused (exit 2) with nobody's directory and with a symbolic link, volume unchanged: $(head -n 1 "$E2E_TMP/squat1.err")"

    step "ctl: daemon's own directory is private, and its stat reaches its server"
    "${AS_DAEMON[@]}" "$CVOL" serve "$DMN/d.cvol" --socket "$DMN/d.sock" >"$E2E_TMP/d.out" 2>"$E2E_TMP/d.err" &
    dpid=$!
    reg_pid "$dpid"
    wait_until 30 "daemon's serve to start" grep -q '^nbd+unix://' "$E2E_TMP/d.out"
    [[ "$(stat -c '%a %U' "$squat")" == "700 daemon" ]] || fail "$squat is $(stat -c '%a %U' "$squat"), expected 700 daemon"
    if "${AS_NOBODY[@]}" ls "$squat" >/dev/null 2>&1; then fail "nobody can list $squat"; fi
    "${AS_DAEMON[@]}" "$CVOL" stat "$DMN/d.cvol" --json >"$E2E_TMP/d.json" 2>"$E2E_TMP/dstat.err" ||
        fail "daemon's stat exited $?: $(cat "$E2E_TMP/dstat.err")"
    grep -q '"served": *true' "$E2E_TMP/d.json" || fail "daemon's stat did not reach its server"
    stop_server "$dpid"
    log "ok: $squat is 700 daemon; daemon's stat reached its server"
fi

# ---------------------------------------------------------------- flags ----
if has_step flags; then
    step "flags: absurd numbers are refused with a range, before the volume opens"
    before=$(fingerprint "$PUB/vol.cvol")
    for args in "--handshake-timeout 18446744073709551615" "--read-cache 99999T" \
        "--dedup-memory 0" "--workers 5000" "--max-buffered 99999T"; do
        rc=0
        # shellcheck disable=SC2086
        timeout 30 "$CVOL" serve "$PUB/vol.cvol" --socket "$PUB/f.sock" $args >/dev/null 2>"$E2E_TMP/flag.err" || rc=$?
        ((rc == 2)) || fail "serve $args exited $rc, expected 2: $(cat "$E2E_TMP/flag.err")"
        ! grep -q panicked "$E2E_TMP/flag.err" || fail "serve $args panicked: $(cat "$E2E_TMP/flag.err")"
        log "refused: $args: $(tail -n 1 "$E2E_TMP/flag.err")"
    done
    [[ "$(fingerprint "$PUB/vol.cvol")" == "$before" ]] || fail "a refused serve changed the volume"
    if has_step ctl; then
        before=$(fingerprint "$DMN/d.cvol")
        rc=0
        "${AS_DAEMON[@]}" bash -c 'ulimit -u 40 && exec timeout 30 "$0" serve "$1" --socket "$2" --workers 200' \
            "$CVOL" "$DMN/d.cvol" "$DMN/f.sock" >/dev/null 2>"$E2E_TMP/nproc.err" || rc=$?
        ((rc == 2)) || fail "serve --workers 200 under ulimit -u 40 exited $rc, expected 2: $(cat "$E2E_TMP/nproc.err")"
        grep -q "lower --workers" "$E2E_TMP/nproc.err" || fail "no reason given: $(cat "$E2E_TMP/nproc.err")"
        [[ "$(fingerprint "$DMN/d.cvol")" == "$before" ]] || fail "the refused serve changed the volume"
        log "refused under ulimit -u 40: $(tail -n 1 "$E2E_TMP/nproc.err")"
    fi
fi

pass
