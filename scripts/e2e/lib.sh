# shellcheck shell=bash
# Shared helpers for the cvol end-to-end tests.  Source it from a test script:
#
#     . "$(dirname "$0")/lib.sh"
#
# Environment knobs (all optional):
#   CVOL              binary under test (default: <repo>/target/release/cvol)
#   E2E_SERVER        cvol (default) | nbdkit  -- nbdkit is a stand-in server
#                     (plain file, `nbdkit file`) used to validate the client
#                     side of the tests; cvol-only steps (stat/check/lock) are
#                     skipped under it.
#   E2E_TMPDIR        where per-test temp dirs are created (default /tmp)
#   E2E_CACHE_DIR     cache for generated test data (default /tmp/cvol-e2e-cache)
#   E2E_KEEP=1        keep the per-test temp dir (volumes, server logs)
#   E2E_READY_TIMEOUT seconds to wait for a server to become ready (default 30)
#   E2E_STOP_TIMEOUT  seconds to wait for a server to exit on SIGTERM (default 60)
#   E2E_PYTHON        a python3 that can `import nbd` (auto-detected)
#   E2E_SERVE_ARGS    extra arguments for every `cvol serve` (word-split),
#                     e.g. "--map-cache 64K" (ext4-paged.sh sets it)

set -Eeuo pipefail

E2E_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
E2E_REPO_ROOT=$(cd "$E2E_DIR/../.." && pwd)
: "${CVOL:=$E2E_REPO_ROOT/target/release/cvol}"
: "${E2E_SERVER:=cvol}"
: "${E2E_TMPDIR:=/tmp}"
: "${E2E_CACHE_DIR:=/tmp/cvol-e2e-cache}"
: "${E2E_KEEP:=0}"
: "${E2E_READY_TIMEOUT:=30}"
: "${E2E_STOP_TIMEOUT:=60}"
# Tests cd into their temp dir: make user-supplied relative paths absolute.
_abs() { if [[ "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
if [[ "$CVOL" == */* ]]; then CVOL=$(_abs "$CVOL"); fi
E2E_TMPDIR=$(_abs "$E2E_TMPDIR")
E2E_CACHE_DIR=$(_abs "$E2E_CACHE_DIR")
export CVOL E2E_SERVER
export PYTHONDONTWRITEBYTECODE=1

case "$E2E_SERVER" in
    cvol | nbdkit) ;;
    *)
        echo "E2E_SERVER must be 'cvol' or 'nbdkit' (got '$E2E_SERVER')" >&2
        exit 2
        ;;
esac

TEST_NAME=${TEST_NAME:-$(basename "$0" .sh)}
E2E_TMP=$(mktemp -d "$E2E_TMPDIR/cvol-e2e-$TEST_NAME.XXXXXX")

# Resources registered for cleanup.
_E2E_PIDS=()   # background processes (servers, nbdfuse, clients)
_E2E_MOUNTS=() # kernel mounts (ext4 on loop)
_E2E_LOOPS=()  # loop devices
_E2E_FUSE=()   # FUSE mountpoints
_E2E_DONE=0    # set by pass/fail/skip so the EXIT trap knows a verdict was printed
_E2E_SRV_SEQ=0
_E2E_ERR_CMD=""
_E2E_ERR_LINE=""

# Current server (set by start_server / start_qemu_nbd).
# shellcheck disable=SC2034  # read by the test scripts
SRV_KIND=""
# shellcheck disable=SC2034  # set by find_nbd_python, read by the tests
NBD_PY=""
SRV_PID=""
SRV_URI=""
SRV_SOCK=""
SRV_OUT=""
SRV_ERR=""

# ---------------------------------------------------------------- output ----

_ts() { date +%H:%M:%S; }

log() { printf '[%s %s] %s\n' "$(_ts)" "$TEST_NAME" "$*"; }

step() { printf '[%s %s] --- %s\n' "$(_ts)" "$TEST_NAME" "$*"; }

pass() {
    _E2E_DONE=1
    printf 'PASS: %s%s\n' "$TEST_NAME" "${1:+ ($1)}"
    exit 0
}

fail() {
    _E2E_DONE=1
    printf 'FAIL: %s: %s\n' "$TEST_NAME" "$*"
    _dump_server_logs
    exit 1
}

# skip REASON -- exit 77 (counted as skipped by run-all.sh)
skip() {
    _E2E_DONE=1
    printf 'SKIP: %s: %s\n' "$TEST_NAME" "$*"
    exit 77
}

# Print a message about a cvol-only step being skipped in stand-in mode.
skip_step() { log "skipped under E2E_SERVER=$E2E_SERVER: $*"; }

is_cvol() { [[ "$E2E_SERVER" == cvol ]]; }

# need TOOL... -- skip the test if a tool is missing.
need() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || skip "required tool '$t' not found"
    done
}

need_root() { [[ $(id -u) -eq 0 ]] || skip "must run as root"; }

# Make sure the server binary is usable (fails, not skips: a missing cvol
# binary is a broken build, not a missing optional tool).
need_server() {
    if is_cvol; then
        [[ -x "$CVOL" ]] || fail "cvol binary not found at $CVOL (cargo build --release, or set CVOL=)"
        "$CVOL" --help 2>&1 | grep -qw serve ||
            fail "$CVOL --help does not mention 'serve' (binary not built with the CLI yet?)"
    else
        need nbdkit
    fi
}

# Locate a python3 that has the libnbd bindings (what nbdsh uses); sets NBD_PY.
find_nbd_python() {
    local c
    for c in "${E2E_PYTHON:-}" /usr/bin/python3 python3; do
        [[ -n "$c" ]] || continue
        if "$c" -c 'import nbd' >/dev/null 2>&1; then
            # shellcheck disable=SC2034  # used by the test scripts
            NBD_PY=$c
            return 0
        fi
    done
    return 1
}
need_nbd_python() {
    find_nbd_python || skip "no python3 with the 'nbd' module (python3-libnbd) found"
}

# Any python3 (json parsing etc.).
PY=${E2E_JSON_PYTHON:-python3}

# --------------------------------------------------------------- cleanup ----

_alive() {
    local pid=$1 st
    [[ -r /proc/$pid/stat ]] || return 1
    st=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n "$st" && "$st" != Z && "$st" != X ]]
}

reg_pid() { _E2E_PIDS+=("$1"); }
unreg_pid() {
    local p keep=()
    for p in "${_E2E_PIDS[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    _E2E_PIDS=("${keep[@]}")
}
reg_mount() { _E2E_MOUNTS+=("$1"); }
unreg_mount() {
    local p keep=()
    for p in "${_E2E_MOUNTS[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    _E2E_MOUNTS=("${keep[@]}")
}
reg_loop() { _E2E_LOOPS+=("$1"); }
unreg_loop() {
    local p keep=()
    for p in "${_E2E_LOOPS[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    _E2E_LOOPS=("${keep[@]}")
}
# fuse_unmount DIR -- fusermount3/fusermount if present, else umount (root).
fuse_unmount() {
    if command -v fusermount3 >/dev/null 2>&1; then
        fusermount3 -u "$1"
    elif command -v fusermount >/dev/null 2>&1; then
        fusermount -u "$1"
    else
        umount "$1"
    fi
}
reg_fuse() { _E2E_FUSE+=("$1"); }
unreg_fuse() {
    local p keep=()
    for p in "${_E2E_FUSE[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    _E2E_FUSE=("${keep[@]}")
}

# On failure, show the end of the most recently written server log.
_dump_server_logs() {
    local f
    f=$(find "$E2E_TMP" -maxdepth 1 -name '*.err' -printf '%T@ %p\n' 2>/dev/null |
        sort -rn | head -n 1 | cut -d' ' -f2-) || true
    [[ -n "$f" && -s "$f" ]] || return 0
    printf -- '----- last lines of %s (E2E_KEEP=1 keeps all logs) -----\n' "${f##*/}"
    tail -n 20 "$f" | sed 's/\x1b\[[0-9;]*m//g' || true
}

_cleanup() {
    local m l f p i
    trap - ERR
    set +e
    for ((i = ${#_E2E_MOUNTS[@]} - 1; i >= 0; i--)); do
        m=${_E2E_MOUNTS[i]}
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
    done
    for l in "${_E2E_LOOPS[@]}"; do
        losetup -d "$l" 2>/dev/null
    done
    for f in "${_E2E_FUSE[@]}"; do
        fuse_unmount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null
    done
    for p in "${_E2E_PIDS[@]}"; do
        _alive "$p" && kill -TERM "$p" 2>/dev/null
    done
    for p in "${_E2E_PIDS[@]}"; do
        for _ in $(seq 50); do _alive "$p" || break; sleep 0.1; done
        if _alive "$p"; then
            echo "cleanup: pid $p ignored SIGTERM for 5s, sending SIGKILL" >&2
            kill -KILL "$p" 2>/dev/null
        fi
        wait "$p" 2>/dev/null
    done
    if [[ "$E2E_KEEP" == 1 ]]; then
        echo "E2E_KEEP=1: leaving $E2E_TMP" >&2
    else
        rm -rf "$E2E_TMP"
    fi
}

_on_exit() {
    local rc=$?
    if [[ $_E2E_DONE -eq 0 ]]; then
        _E2E_DONE=1
        if [[ $rc -eq 0 ]]; then
            printf 'PASS: %s\n' "$TEST_NAME"
        else
            if ((rc == 143 || rc == 130)); then
                printf 'FAIL: %s: interrupted by a signal (timeout?)\n' "$TEST_NAME"
            else
                printf 'FAIL: %s: exit status %s%s\n' "$TEST_NAME" "$rc" \
                    "${_E2E_ERR_CMD:+ (line $_E2E_ERR_LINE: $_E2E_ERR_CMD)}"
            fi
            _dump_server_logs
        fi
    fi
    _cleanup
    exit "$rc"
}

_on_err() {
    # Remember the first failing command for the verdict line.
    if [[ -z "$_E2E_ERR_CMD" ]]; then
        _E2E_ERR_LINE=$1
        _E2E_ERR_CMD=$2
    fi
}

trap _on_exit EXIT
trap '_on_err "$LINENO" "$BASH_COMMAND"' ERR
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 141' PIPE

# Work inside the temp dir so stray files from tools (e.g. fio state files)
# never land in the source tree.
cd "$E2E_TMP"

# ----------------------------------------------------------------- utils ----

# now -- seconds since epoch, float
now() { date +%s.%N; }

# mbps BYTES SECONDS -- MiB/s with one decimal
mbps() { awk -v b="$1" -v s="$2" 'BEGIN { if (s <= 0) s = 1e-9; printf "%.1f", b / 1048576 / s }'; }

# to_bytes SIZE -- 512K / 64M / 3G / 123 -> bytes (binary units)
to_bytes() {
    local s=$1 n u
    n=${s%[KkMmGgTt]}
    u=${s:${#n}}
    case "$u" in
        "") echo "$n" ;;
        K | k) echo $((n * 1024)) ;;
        M | m) echo $((n * 1024 * 1024)) ;;
        G | g) echo $((n * 1024 * 1024 * 1024)) ;;
        T | t) echo $((n * 1024 * 1024 * 1024 * 1024)) ;;
    esac
}

# json_get FILE KEY -- print a top-level key of a JSON object (fails if absent)
json_get() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
k = sys.argv[2]
if k not in d:
    sys.exit("key %r missing from %s" % (k, sys.argv[1]))
v = d[k]
print(json.dumps(v) if isinstance(v, (dict, list)) else v)
EOF
}

# wait_until TIMEOUT DESCRIPTION CMD... -- poll CMD every 0.1s
wait_until() {
    local timeout=$1 desc=$2 deadline
    shift 2
    deadline=$(($(date +%s) + timeout))
    until "$@" >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || fail "timed out after ${timeout}s waiting for: $desc"
        sleep 0.1
    done
}

# tar_image NAME MB DIR... -- sets TAR_IMAGE to a cached MB MiB file: a tar of
# the DIRs (real data) cut to size, made once in $E2E_CACHE_DIR.
tar_image() {
    local name=$1 mb=$2
    shift 2
    local bytes=$((mb * 1024 * 1024)) img=$E2E_CACHE_DIR/$name-${mb}M.img tmp
    mkdir -p "$E2E_CACHE_DIR"
    if [[ ! -s "$img" || $(stat -c %s "$img") -ne $bytes ]]; then
        step "data: tar of $* cut to $mb MiB"
        tmp=$(mktemp "$E2E_CACHE_DIR/img.XXXXXX")
        # tar is cut off by head (SIGPIPE), so ignore the pipeline status.
        (set +o pipefail; tar -cf - --sort=name "$@" 2>/dev/null | head -c "$bytes" >"$tmp") || true
        [[ $(stat -c %s "$tmp") -eq $bytes ]] || { rm -f "$tmp"; fail "not enough data under $* for $mb MiB"; }
        mv "$tmp" "$img"
    fi
    TAR_IMAGE=$img
}

# -------------------------------------------------------------- volumes ----

# make_volume VOLUME SIZE [cvol create args...]
make_volume() {
    local vol=$1 size=$2
    shift 2
    if is_cvol; then
        "$CVOL" create "$vol" --size "$size" "$@" ||
            fail "cvol create $vol --size $size $* failed"
    else
        rm -f "$vol"
        truncate -s "$(to_bytes "$size")" "$vol"
    fi
}

# cvol_stat_json VOLUME OUTFILE -- cvol only
cvol_stat_json() {
    "$CVOL" stat "$1" --json >"$2" || fail "cvol stat $1 --json failed"
    "$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' "$2" ||
        fail "cvol stat --json output is not valid JSON: $(head -c 500 "$2")"
}

# cvol_check VOLUME -- assert offline check passes (cvol only; no-op otherwise)
cvol_check() {
    if ! is_cvol; then
        skip_step "cvol check $1"
        return 0
    fi
    local log_file=$E2E_TMP/check.$RANDOM.log rc=0
    "$CVOL" check "$1" >"$log_file" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        cat "$log_file"
        fail "cvol check $1 exited $rc"
    fi
    log "cvol check $1: ok"
}

# --------------------------------------------------------------- servers ----

# start_server VOLUME [cvol serve args...]
# Starts the server in the background on a fresh unix socket in $E2E_TMP and
# waits until it prints its nbd+unix:// URI on stdout.  Sets SRV_PID, SRV_URI,
# SRV_SOCK, SRV_OUT, SRV_ERR.
start_server() {
    local vol=$1
    shift
    _E2E_SRV_SEQ=$((_E2E_SRV_SEQ + 1))
    local n=$_E2E_SRV_SEQ
    SRV_SOCK=$E2E_TMP/srv$n.sock
    SRV_OUT=$E2E_TMP/srv$n.out
    SRV_ERR=$E2E_TMP/srv$n.err
    SRV_KIND=$E2E_SERVER
    if is_cvol; then
        local extra=()
        read -ra extra <<<"${E2E_SERVE_ARGS:-}"
        "$CVOL" serve "$vol" --socket "$SRV_SOCK" "${extra[@]}" "$@" >"$SRV_OUT" 2>"$SRV_ERR" &
        SRV_PID=$!
        reg_pid "$SRV_PID"
        _wait_uri "cvol serve $vol --socket $SRV_SOCK $*"
    else
        local args=() export_name=""
        while (($#)); do
            case "$1" in
                --read-only) args+=(-r) ;;
                --export)
                    export_name=$2
                    args+=(-e "$2")
                    shift
                    ;;
                --sync) ;;
                *) log "stand-in nbdkit: ignoring serve option $1" ;;
            esac
            shift
        done
        nbdkit -f -P "$E2E_TMP/srv$n.pid" -U "$SRV_SOCK" "${args[@]}" file "$vol" \
            >"$SRV_OUT" 2>"$SRV_ERR" &
        SRV_PID=$!
        reg_pid "$SRV_PID"
        local deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
        until [[ -s "$E2E_TMP/srv$n.pid" ]]; do
            _alive "$SRV_PID" || fail "nbdkit exited before becoming ready: $(cat "$SRV_ERR")"
            (($(date +%s) < deadline)) || fail "nbdkit not ready after ${E2E_READY_TIMEOUT}s"
            sleep 0.1
        done
        SRV_URI="nbd+unix:///$export_name?socket=$SRV_SOCK"
    fi
    log "server pid $SRV_PID ready at $SRV_URI"
}

# Wait for the nbd+unix URI line on the server's stdout.
_wait_uri() {
    local what=$1 deadline line
    deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    SRV_URI=""
    while :; do
        line=$(grep -m1 -E '^nbd\+unix://' "$SRV_OUT" 2>/dev/null || true)
        if [[ -n "$line" ]]; then
            SRV_URI=${line%$'\r'}
            break
        fi
        if ! _alive "$SRV_PID"; then
            local rc=0
            wait "$SRV_PID" || rc=$?
            unreg_pid "$SRV_PID"
            fail "server exited (status $rc) before printing its URI: $what; stderr: $(tail -n 20 "$SRV_ERR")"
        fi
        if (($(date +%s) >= deadline)); then
            fail "server did not print an nbd+unix:// URI within ${E2E_READY_TIMEOUT}s: $what; stdout: $(head -c 500 "$SRV_OUT")"
        fi
        sleep 0.05
    done
    [[ "$SRV_URI" == *"socket=$SRV_SOCK"* ]] ||
        fail "URI '$SRV_URI' does not name the socket $SRV_SOCK"
}

# stop_server [PID] -- SIGTERM, wait (bounded), assert exit status 0.
stop_server() {
    local pid=${1:-$SRV_PID} rc=0 deadline
    [[ -n "$pid" ]] || fail "stop_server: no server running"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$(($(date +%s) + E2E_STOP_TIMEOUT))
    while _alive "$pid"; do
        if (($(date +%s) >= deadline)); then
            kill -KILL "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            unreg_pid "$pid"
            fail "server pid $pid did not exit within ${E2E_STOP_TIMEOUT}s of SIGTERM"
        fi
        sleep 0.05
    done
    wait "$pid" || rc=$?
    unreg_pid "$pid"
    if [[ "$pid" == "$SRV_PID" ]]; then SRV_PID=""; fi
    [[ $rc -eq 0 ]] || fail "server pid $pid exited with status $rc after SIGTERM (expected 0)"
    log "server pid $pid stopped cleanly (SIGTERM -> exit 0)"
}

# kill9_server [PID] -- SIGKILL and reap.
kill9_server() {
    local pid=${1:-$SRV_PID}
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    unreg_pid "$pid"
    if [[ "$pid" == "$SRV_PID" ]]; then SRV_PID=""; fi
    log "server pid $pid killed with SIGKILL"
}

# start_qemu_nbd RAWFILE -- reference server for throughput comparisons.
start_qemu_nbd() {
    local file=$1
    _E2E_SRV_SEQ=$((_E2E_SRV_SEQ + 1))
    local n=$_E2E_SRV_SEQ
    SRV_SOCK=$E2E_TMP/srv$n.sock
    SRV_OUT=$E2E_TMP/srv$n.out
    SRV_ERR=$E2E_TMP/srv$n.err
    # shellcheck disable=SC2034  # informational, for the test scripts
    SRV_KIND=qemu-nbd
    qemu-nbd -f raw -t -k "$SRV_SOCK" "$file" >"$SRV_OUT" 2>"$SRV_ERR" &
    SRV_PID=$!
    reg_pid "$SRV_PID"
    SRV_URI="nbd+unix:///?socket=$SRV_SOCK"
    local deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    until nbdinfo --size "$SRV_URI" >/dev/null 2>&1; do
        _alive "$SRV_PID" || fail "qemu-nbd exited early: $(cat "$SRV_ERR")"
        (($(date +%s) < deadline)) || fail "qemu-nbd not ready after ${E2E_READY_TIMEOUT}s"
        sleep 0.1
    done
    log "qemu-nbd pid $SRV_PID ready at $SRV_URI"
}
