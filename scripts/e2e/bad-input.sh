#!/usr/bin/env bash
# Bad input on first use: every refused command exits with its
# documented code (1: `check` found problems, 2: cannot run), says what is
# wrong (a key phrase is grepped), and changes nothing on disk: every file
# of the working directory is listed with its type, size, mtime and CRC
# before and after each case, so a changed, removed or new file fails it.
#
# Table-driven: create limits and debris, not-a-volume inputs for every
# command, a copy truncated (past the data and into it) for check, repair,
# stat, scrub and serve, bad serve arguments, and --socket paths that exist
# (a volume, a text file, a directory, another server's live socket).
# Then: a stale socket is replaced and removed at exit; the live server
# keeps serving through its socket; a failed start does not write the
# volume; logs (a clean open says nothing, "NBD server stopped" once);
# SIGTERM while a large volume opens exits 0 and removes the socket; the
# words of `stat` and `--help`.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need qemu-io
need_server
is_cvol || skip "cvol only: error handling of the cvol command line"

W=$E2E_TMP/w          # the working directory the cases run in
LIVE=$E2E_TMP/live    # another server's volume and socket, outside W
mkdir -p "$W" "$LIVE"

# snapshot -- every entry under W: type, path, size, mtime, link target;
# and the checksum (cksum) of every regular file.
snapshot() {
    (
        cd "$W"
        find . -mindepth 1 -printf '%y %P %s %T@ %l\n' | sort
        find . -type f -print0 | sort -z | xargs -0 -r cksum
    )
}

# case_ CODE PHRASE DESCRIPTION ARGS... -- run `cvol ARGS` in W: exit CODE
# exactly, output matching PHRASE (extended regex, any case), W unchanged.
NCASES=0
case_() {
    local code=$1 phrase=$2 desc=$3 rc=0 before after
    shift 3
    before=$(snapshot)
    (cd "$W" && timeout 20 "$CVOL" "$@") >"$E2E_TMP/case.out" 2>&1 || rc=$?
    after=$(snapshot)
    ((rc != 124)) || fail "$desc: 'cvol $*' did not finish within 20 s"
    ((rc == code)) || fail "$desc: 'cvol $*' exited $rc, expected $code: $(cat "$E2E_TMP/case.out")"
    grep -qiE -- "$phrase" "$E2E_TMP/case.out" ||
        fail "$desc: 'cvol $*' does not say /$phrase/: $(cat "$E2E_TMP/case.out")"
    if [[ "$before" != "$after" ]]; then
        diff <(echo "$before") <(echo "$after") || true
        fail "$desc: 'cvol $*' changed the files above"
    fi
    NCASES=$((NCASES + 1))
    log "ok: $desc (exit $rc: $(head -n 1 "$E2E_TMP/case.out" | cut -c1-150))"
}

# run_table -- one case per line: CODE | PHRASE | DESCRIPTION | ARGS
# (ARGS split on blanks; @LIVE@ is the live server's directory, @PORT@ the
# TCP port it holds).
run_table() {
    local code phrase desc args line
    while IFS='|' read -r code phrase desc args; do
        code=$(echo "$code" | xargs)
        [[ -n "$code" && "$code" != \#* ]] || continue
        phrase=$(echo "$phrase" | sed 's/^ *//; s/ *$//')
        desc=$(echo "$desc" | sed 's/^ *//; s/ *$//')
        args=${args//@LIVE@/$LIVE}
        args=${args//@PORT@/$PORT}
        read -r -a line <<<"$args"
        case_ "$code" "$phrase" "$desc" "${line[@]}"
    done
}

step "fixtures: volumes (one with data), its truncated copies, non-volumes"
make_volume "$W/vol.cvol" 16M >/dev/null
start_server "$W/vol.cvol"
qemu-io -f raw -c "write -q -P 0x5a 0 6M" -c flush "$SRV_URI" || fail "qemu-io write"
stop_server
make_volume "$W/other.cvol" 16M >/dev/null
cp --sparse=always "$W/vol.cvol" "$W/short.cvol"
truncate -s 8M "$W/short.cvol" # past the data: only free log is missing
cp --sparse=always "$W/vol.cvol" "$W/cut.cvol"
truncate -s 3M "$W/cut.cvol" # into the data
cp --sparse=always "$W/vol.cvol" "$W/damaged.cvol" # both superblock copies damaged
printf 'XX' | dd of="$W/damaged.cvol" bs=1 seek=20 conv=notrunc status=none
printf 'XX' | dd of="$W/damaged.cvol" bs=1 seek=4116 conv=notrunc status=none
echo "notes, not a volume" >"$W/note.txt"
head -c 1048576 /dev/urandom >"$W/random.bin"
: >"$W/empty.img"
mkdir "$W/dir"
mkfifo "$W/fifo"
ln -s nowhere "$W/dangling"
# The stale socket of a dead server (bound, never listened on, closed).
"$PY" -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$W/stale.sock"
[[ -S "$W/stale.sock" ]] || fail "could not make a stale socket"

step "another server running (its volume, socket and port are outside W)"
make_volume "$LIVE/live.cvol" 16M >/dev/null
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$CVOL" serve "$LIVE/live.cvol" --socket "$LIVE/live.sock" --listen "127.0.0.1:$PORT" \
    >"$E2E_TMP/live.out" 2>"$E2E_TMP/live.err" &
LIVE_PID=$!
reg_pid "$LIVE_PID"
wait_until 30 "the live server's URI" grep -q '^nbd+unix://' "$E2E_TMP/live.out"
LIVE_URI="nbd+unix:///?socket=$LIVE/live.sock"
qemu-io -f raw -c "write -q -P 0x6b 0 1M" -c flush "$LIVE_URI" || fail "write to the live server"
live_inode=$(stat -c %i "$LIVE/live.sock")

step "the cases"
run_table <<'EOF'
# create: limits before any file is touched, no debris, no missing directories
2 | 16 TiB               | create --size above the 16 TiB limit              | create new.cvol --size 32T
2 | 16 TiB               | the same with a small --physical-size             | create new.cvol --size 32T --physical-size 1G
2 | 8 TiB                | --size 10T: the default physical size is too big  | create new.cvol --size 10T
2 | 8 TiB                | --physical-size above 8 TiB                       | create new.cvol --size 1G --physical-size 9T
2 | too small            | --physical-size 1M                                | create new.cvol --size 1G --physical-size 1M
2 | multiple of 4096     | --size not a multiple of 4096                     | create new.cvol --size 1000
2 | multiple of 4096     | --size 0                                          | create new.cvol --size 0
2 | invalid size         | --size with an unknown unit                       | create new.cvol --size 12Q
2 | invalid size         | --physical-size not a size                        | create new.cvol --size 64M --physical-size lots
2 | does not exist       | a missing directory is not created                | create typo/dir/v.cvol --size 64M
2 | does not exist       | a missing directory, absolute path                | create @LIVE@/typo/v.cvol --size 64M
2 | auto.*lz4            | --codec gzip lists every policy, auto too         | create new.cvol --size 64M --codec gzip
2 | out of range         | --codec zstd:25                                   | create new.cvol --size 64M --codec zstd:25
2 | strong codec         | --codec auto:lz4                                  | create new.cvol --size 64M --codec auto:lz4
2 | on or off            | --dedup maybe                                     | create new.cvol --size 64M --dedup maybe
2 | power of two         | --segment-size 3M                                 | create new.cvol --size 64M --segment-size 3M
2 | already exists       | an existing volume needs --force                  | create vol.cvol --size 16M
2 | already exists       | a non-empty file needs --force                    | create note.txt --size 16M
2 | directory            | a directory is no volume                          | create dir --size 16M
2 | not a regular file   | a FIFO is no volume                               | create fifo --size 16M
2 | symbolic link        | a dangling symlink is not followed                | create dangling --size 16M
2 | not a directory      | a file where the directory should be              | create note.txt/v.cvol --size 16M
2 | in use               | --force on a served volume                        | create @LIVE@/live.cvol --size 16M --force
2 | size                 | --size missing                                    | create new.cvol
# check: exit 1 for a broken volume, 2 when it cannot run
1 | shorter than the volume.*truncated or copied incompletely | check: copy truncated past the data | check short.cvol
1 | shorter than the volume | check: copy truncated into the data           | check cut.cvol
1 | shorter than the volume | check --json: truncated copy                   | check short.cvol --json
1 | shorter than the volume.*nothing was changed | check --repair: truncated copy, nothing written | check short.cvol --repair
1 | shorter than the volume | check --repair: truncated into the data        | check cut.cvol --repair
1 | superblock copy A.*checksum | check: both superblock copies damaged        | check damaged.cvol
1 | both superblock copies are damaged | check --repair: cannot repair, nothing written | check damaged.cvol --repair
2 | not a cvol volume    | check: random bytes                               | check random.bin
2 | not a cvol volume    | check --repair: random bytes, nothing written     | check random.bin --repair
2 | empty                | check: an empty file                              | check empty.img
2 | empty                | check --repair: an empty file                     | check empty.img --repair
2 | directory            | check: a directory                                | check dir
2 | directory            | check --repair: a directory                       | check dir --repair
2 | not a regular file   | check: a FIFO (must not hang)                     | check fifo
2 | not a regular file   | check: a character device                         | check /dev/null
2 | no such file         | check: a missing file                             | check missing.cvol
2 | no such file         | check: a dangling symlink                         | check dangling
2 | being served         | check: a served volume                            | check @LIVE@/live.cvol
2 | being served         | check --repair: a served volume                   | check @LIVE@/live.cvol --repair
# stat and scrub
2 | shorter than the volume | stat: truncated copy                           | stat short.cvol
2 | shorter than the volume | stat --json: truncated into the data           | stat cut.cvol --json
2 | not a cvol volume    | stat: random bytes                                | stat random.bin
2 | both damaged         | stat: both superblock copies damaged              | stat damaged.cvol
2 | empty                | stat: an empty file                               | stat empty.img
2 | directory            | stat: a directory                                 | stat dir
2 | not a regular file   | stat: a FIFO                                      | stat fifo
2 | no such file         | stat: a missing file                              | stat missing.cvol
2 | shorter than the volume | scrub: truncated copy                          | scrub short.cvol
2 | not a cvol volume    | scrub: random bytes                               | scrub random.bin
2 | directory            | scrub: a directory                                | scrub dir
2 | no such file         | scrub: a missing file                             | scrub missing.cvol
2 | --rate               | scrub: --rate not a rate                          | scrub vol.cvol --rate fast
2 | not served           | scrub --no-wait: needs a server                   | scrub vol.cvol --no-wait
2 | not served           | scrub --status: needs a server                    | scrub vol.cvol --status
# serve: refused before anything is written, no socket left behind
2 | exists \(a file\)    | --socket is an existing volume (was deleted)      | serve other.cvol --socket vol.cvol
2 | exists \(a file\)    | --socket is a text file                           | serve other.cvol --socket note.txt
2 | exists \(a directory\) | --socket is a directory                         | serve other.cvol --socket dir
2 | exists \(a file\)    | --socket is the volume itself                     | serve other.cvol --socket other.cvol
2 | running server       | --socket is another server's live socket          | serve other.cvol --socket @LIVE@/live.sock
2 | exists               | --socket is a FIFO                                | serve other.cvol --socket fifo
2 | exists \(a symbolic link\) | --socket is a symlink                       | serve other.cvol --socket dangling
2 | no such file         | --socket in a missing directory                   | serve other.cvol --socket nodir/s.sock
2 | invalid port         | --listen :99999                                   | serve other.cvol --listen :99999
2 | --listen             | --listen without a port                           | serve other.cvol --listen 127.0.0.1
2 | in use               | --listen on a port another server holds           | serve other.cvol --listen 127.0.0.1:@PORT@
2 | in use               | no VOLUME, port taken: no default volume created  | serve --listen 127.0.0.1:@PORT@
2 | in use               | a volume another server serves                    | serve @LIVE@/live.cvol --socket s.sock
2 | shorter than the volume | serve: truncated copy                          | serve short.cvol --socket s.sock
2 | not a cvol volume    | serve: random bytes                               | serve random.bin --socket s.sock
2 | both damaged         | serve: both superblock copies damaged             | serve damaged.cvol --socket s.sock
2 | empty                | serve: an empty file                              | serve empty.img --socket s.sock
2 | directory            | serve: a directory                                | serve dir --socket s.sock
2 | no such file         | serve: a missing volume is not created            | serve missing.cvol --socket s.sock
2 | on or off            | --recompress maybe                                | serve other.cvol --socket s.sock --recompress maybe
2 | unit-size            | --unit-size 3K                                    | serve other.cvol --socket s.sock --unit-size 3K
2 | clean-start          | --clean-start above --clean-stop                  | serve other.cvol --socket s.sock --clean-start 50 --clean-stop 20
2 | cost-benefit         | --cleaner unknown                                 | serve other.cvol --socket s.sock --cleaner fifo
2 | max-connections      | --max-connections 0                               | serve other.cvol --socket s.sock --max-connections 0
2 | max-buffered         | --max-buffered below one request                  | serve other.cvol --socket s.sock --max-buffered 1M
2 | handshake-timeout    | --handshake-timeout 0                             | serve other.cvol --socket s.sock --handshake-timeout 0
2 | per-address          | --max-connections-per-address 0                   | serve other.cvol --socket s.sock --max-connections-per-address 0
2 | max-handshaking      | --max-handshaking above --max-connections         | serve other.cvol --socket s.sock --max-connections 8 --max-handshaking 9
2 | idle-timeout         | --idle-timeout not a number of seconds            | serve other.cvol --socket s.sock --idle-timeout 5m
2 | idle-iops            | --idle-iops above --busy-iops                     | serve other.cvol --socket s.sock --idle-iops 50000
2 | dedup-memory         | --dedup-memory not a size                         | serve other.cvol --socket s.sock --dedup-memory lots
EOF

step "the live server was not disturbed"
[[ -S "$LIVE/live.sock" && $(stat -c %i "$LIVE/live.sock") == "$live_inode" ]] ||
    fail "the live server's socket was replaced or removed"
qemu-io -f raw -r -c "read -q -P 0x6b 0 1M" "$LIVE_URI" || fail "the live server stopped answering on its socket"
qemu-io -f raw -r -c "read -q -P 0x6b 0 1M" "nbd://127.0.0.1:$PORT/" ||
    fail "the live server stopped answering on its port"
stop_server "$LIVE_PID"
[[ ! -e "$LIVE/live.sock" ]] || fail "the live server left its socket behind"
grep -c "NBD server stopped" "$E2E_TMP/live.err" | grep -qx 1 ||
    fail "\"NBD server stopped\" not logged exactly once: $(cat "$E2E_TMP/live.err")"
if grep -E "client (dis)?connected|recovered" "$E2E_TMP/live.err"; then
    fail "info-level log of connects or a recovery on a clean volume (above)"
fi

step "a stale socket is replaced; the server removes its own socket at exit"
"$CVOL" serve "$W/other.cvol" --socket "$W/stale.sock" >"$E2E_TMP/stale.out" 2>"$E2E_TMP/stale.err" &
pid=$!
reg_pid "$pid"
wait_until 30 "serve on the stale socket path" grep -q '^nbd+unix://' "$E2E_TMP/stale.out"
grep -q "stale socket" "$E2E_TMP/stale.err" || fail "replacing a stale socket is not logged"
qemu-io -f raw -r -c "read -q 0 4096" "nbd+unix:///?socket=$W/stale.sock" || fail "serve on a replaced stale socket"
stop_server "$pid"
[[ ! -e "$W/stale.sock" ]] || fail "the server left its socket behind"

step "logs: a clean offline open says nothing; an unclean one says recovered"
"$CVOL" stat "$W/vol.cvol" >/dev/null 2>"$E2E_TMP/stat.err" || fail "stat exited $?"
[[ ! -s "$E2E_TMP/stat.err" ]] || fail "stat of a cleanly closed volume logged: $(cat "$E2E_TMP/stat.err")"
start_server "$W/other.cvol"
qemu-io -f raw -c "write -q -P 0x33 0 1M" -c flush "$SRV_URI" || fail "qemu-io write"
kill9_server
"$CVOL" stat "$W/other.cvol" >/dev/null 2>"$E2E_TMP/stat.err" || fail "stat exited $?"
grep -q "recovered: replayed" "$E2E_TMP/stat.err" || fail "no recovery note after kill -9: $(cat "$E2E_TMP/stat.err")"

step "words: stat while served and offline, --help"
start_server "$W/vol.cvol"
"$CVOL" stat "$W/vol.cvol" >"$E2E_TMP/stat.txt" || fail "stat while served"
"$CVOL" stat "$W/vol.cvol" --json >"$E2E_TMP/stat.json" || fail "stat --json while served"
stop_server
"$CVOL" stat "$W/vol.cvol" >"$E2E_TMP/stat-off.txt" || fail "stat offline"
cat "$E2E_TMP/stat.txt"
[[ $(json_get "$E2E_TMP/stat.json" cleaner_policy) == cost-benefit ]] || fail "cleaner_policy in JSON is not the flag's spelling"
(($(json_get "$E2E_TMP/stat.json" estimated_free_logical_bytes) <= 16 * 1048576)) ||
    fail "estimated_free_logical_bytes above the logical size"
grep -q "cost-benefit" "$E2E_TMP/stat.txt" || fail "stat: cleaner policy not named as its flag"
grep -q "^scrub " "$E2E_TMP/stat.txt" || fail "stat while served has no scrub line"
if grep -E "CostBenefit|kiB|(^|[^0-9])1 (passes|segments|blocks|runs)" "$E2E_TMP/stat.txt" "$E2E_TMP/stat-off.txt"; then
    fail "stat words (above)"
fi
if grep -E "write amplification|recompressed|^scrub " "$E2E_TMP/stat-off.txt"; then
    fail "offline stat shows counters that only a server has (above)"
fi
"$CVOL" create --help >"$E2E_TMP/help.txt"
grep -q "zstd:3 when idle" "$E2E_TMP/help.txt" || fail "create --help: codec policy wording"
for c in create serve stat check scrub; do
    # every argument and option has a description (on its line or the next)
    "$CVOL" "$c" -h | "$PY" -c '
import re, sys
lines = sys.stdin.read().splitlines()
item = re.compile(r"^( +)((-[a-zA-Z], )?--[a-z-]+( <[A-Z_:]+>)?|<[A-Z_]+>|\[[A-Z_]+\])( {2,}\S.*)?$")
bad = []
for i, l in enumerate(lines):
    m = item.match(l)
    if not m or m.group(5):
        continue
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    if not (nxt.startswith(m.group(1) + "  ") and nxt.strip() and not item.match(nxt)):
        bad.append(l.strip())
if bad:
    sys.exit("undocumented: " + ", ".join(bad))
' || fail "cvol $c -h"
done
[[ $("$CVOL" --help | grep -c '^  scrub ') == 1 && $("$CVOL" --help | grep '^  scrub ' | wc -c) -lt 100 ]] ||
    fail "the scrub summary in --help is not one short line"

step "SIGTERM while a large volume opens: exit 0 at once, socket removed"
BIG=$E2E_TMP/big
mkdir -p "$BIG"
# A sparse file opens at once (recovery skips its holes), so the slow open
# is an 8 TiB loop device over one, where every segment start is read.
BIGVOL=$BIG/big.cvol
truncate -s 8T "$BIG/big.img"
if [[ $(id -u) == 0 ]] && LOOP=$(losetup -f --show "$BIG/big.img" 2>/dev/null); then
    BIGVOL=$LOOP
    reg_loop "$LOOP"
    "$CVOL" create "$BIGVOL" --size 16T --force >/dev/null || fail "create on an 8 TiB loop device"
else
    rm -f "$BIG/big.img"
    "$CVOL" create "$BIGVOL" --size 16T --physical-size 8T >/dev/null || fail "create 8 TiB sparse"
fi
"$CVOL" serve "$BIGVOL" --socket "$BIG/big.sock" >"$E2E_TMP/big.out" 2>"$E2E_TMP/big.err" &
pid=$!
reg_pid "$pid"
state=""
for _ in $(seq 300); do
    if grep -q 'still opening' "$E2E_TMP/big.err"; then state=slow; break; fi
    if grep -q '^nbd+unix://' "$E2E_TMP/big.out"; then state=fast; break; fi
    _alive "$pid" || fail "serve of the 8 TiB volume exited: $(cat "$E2E_TMP/big.err")"
    sleep 0.1
done
[[ -n "$state" ]] || fail "serve of the 8 TiB volume: neither ready nor a progress note in 30 s"
if [[ $state == slow ]]; then
    log "progress logged: $(grep -m1 'still opening' "$E2E_TMP/big.err" | sed 's/.*INFO //')"
    t0=$(date +%s)
    kill -TERM "$pid"
    rc=0
    wait "$pid" || rc=$?
    unreg_pid "$pid"
    ((rc == 0)) || fail "SIGTERM during the open: exit $rc (expected 0): $(cat "$E2E_TMP/big.err")"
    (($(date +%s) - t0 <= 5)) || fail "SIGTERM during the open took $(($(date +%s) - t0)) s"
    grep -q "while opening" "$E2E_TMP/big.err" || fail "no log of the interrupted open"
    [[ ! -e "$BIG/big.sock" ]] || fail "socket left behind after SIGTERM during the open"
else
    # A fast machine opened it within 2 s: nothing to interrupt.
    log "the 8 TiB volume ($BIGVOL) opened within 2 s; SIGTERM during the open not exercised"
    stop_server "$pid"
fi
if [[ $BIGVOL != "$BIG/big.cvol" ]]; then
    losetup -d "$BIGVOL"
    unreg_loop "$BIGVOL"
fi
rm -f "$BIG/big.cvol" "$BIG/big.img"

pass "$NCASES refused commands: exact exit code, a message naming the problem, no file changed"
