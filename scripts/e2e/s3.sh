#!/usr/bin/env bash
# Volumes in an S3 object store (`cvol create/serve s3://BUCKET/PREFIX`),
# against a throw-away single-node Ceph with radosgw on 127.0.0.1
# (scripts/ceph-local, in this test's temp dir, stopped at exit; free ports
# are picked when 7480/3300 are taken). Skipped if Ceph is missing and cannot
# be installed (no apt-get). Every serve gets a new, empty --cache-dir and
# --lease 2 (E2E_S3_LEASE). Steps (E2E_S3_STEPS, in this order by default):
#
#   ext4      nbdfuse + loop + mkfs.ext4 on a 1 GiB volume served with a
#             32 MiB --cache-size, copy 100-160 MB of trees from /usr, sync,
#             umount, e2fsck -fn clean, mount again, diff -r identical (read
#             back through evictions; left mounted for kill9)
#   kill9     64 MiB (real data + random) by nbdcopy --flush, then unaligned
#             qemu-io writes + flush, kill -9 at once; a serve with a new
#             cache dir takes the volume over (lease lapsed) and reads it all
#             back exact. Then ext4's file system, mounted, gets one more
#             file and `sync`; kill -9; a new serve: mount (journal replay),
#             diff -r both, umount, e2fsck -fn clean
#   single    a second serve while the first runs: exit 2, "being served by
#             another server", no socket left; the first still serves
#   errors    refusals, exit 2 and a message: serve without --cache-dir,
#             create on an existing volume without --force (the volume still
#             serves its data), a bad bucket name, no prefix, a missing
#             bucket, serve of a prefix with no volume (naming `cvol create`),
#             --cache-dir and --unsafe-no-fencing for a local volume. And the
#             probe of create-only PUTs (fencing rests on them): RGW passes
#             it (create and serve work; no probe object is left behind), and
#             a serve with --unsafe-no-fencing says fencing stays on
#   takeover  A writes 0x11 (and 8 MiB of 0x44) + flush; kill -STOP A; B
#             (same host, same run dir for control sockets) takes over after
#             the lease ("lease lapsed: taking the volume over"); B writes
#             0x22 + flush; kill -CONT A;
#             A's write + flush of 0x33 fails and A's log says "fenced"; B
#             reads 0x22; B stops cleanly (lease released: C starts without
#             waiting) and C reads 0x22 and A's 0x44
#   stale     as takeover, but A is resumed only after B has written a
#             manifest (B flushes 520 small writes: a manifest every 512
#             deltas) and deleted the deltas before it: A's write + flush
#             must still fail (A's next delta must still collide with B's
#             fence), and C must read B's data and A's 0x44
#   trim      a 2 GiB volume in a bucket of its own: 256 MiB of random data +
#             flush; idle E2E_S3_TRIM_IDLE seconds (default 35: longer than
#             the store's 30 s manifest interval); discard the whole device +
#             flush; within E2E_S3_TRIM_WAIT seconds (default 90) the bucket's
#             object count (radosgw-admin bucket stats) falls to a quarter of
#             what it was or less (~80 -> ~12: the metadata chunk and a few
#             small objects stay); reads as zeros
#
#   E2E_S3_STEPS        steps to run (default: all, in the order above; kill9's
#                       ext4 part needs ext4; each other step stands alone)
#   E2E_S3_SRC          directory trees for ext4 (space-separated; default:
#                       trees under /usr adding up to 100-160 MB)
#   E2E_S3_FS_CACHE     --cache-size of ext4's serves (default 32M: the copy
#                       overflows it, so reading back GETs evicted chunks)
#   E2E_S3_LEASE        --lease of every serve (default 2)
#   E2E_S3_TRIM_IDLE    seconds the trim volume idles before the TRIM (default 35)
#   E2E_S3_TRIM_WAIT    seconds to wait for the store to shrink (default 90)
#   E2E_S3_OWN_RUN_DIR  1: in takeover and stale, each server gets a
#                       CVOL_RUN_DIR (control socket directory) of its own, as
#                       if on another host (default 0: one host, one run dir)
#   CEPH_RGW_PORT, CEPH_MON_PORT  force the ports (default: 7480/3300 or the
#                       first free ones from 17480/13300)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol only (volumes in an object store)"
need_root
need nbdfuse losetup mkfs.ext4 e2fsck mount umount diff cmp qemu-io nbdcopy timeout
[[ -e /dev/fuse ]] || skip "/dev/fuse missing"
need_server

STEPS=${E2E_S3_STEPS:-ext4 kill9 single errors takeover stale trim encrypted}
LEASE=${E2E_S3_LEASE:-2}
TRIM_WAIT=${E2E_S3_TRIM_WAIT:-90}
TRIM_IDLE=${E2E_S3_TRIM_IDLE:-35}
OWN_RUN_DIR=${E2E_S3_OWN_RUN_DIR:-0}
CEPH_LOCAL=$E2E_REPO_ROOT/scripts/ceph-local
CEPH_DIR=$E2E_TMP/ceph
BUCKET=cvol-e2e
TRIM_BUCKET=cvol-e2e-trim
FS_SIZE=1G
FS_CACHE=${E2E_S3_FS_CACHE:-32M}
FUSE_DIR=$E2E_TMP/fuse
FS_DIR=$E2E_TMP/fs
mkdir -p "$FUSE_DIR" "$FS_DIR"
for s in $STEPS; do
    case $s in
        ext4 | kill9 | single | takeover | stale | trim | errors | encrypted) ;;
        *) fail "E2E_S3_STEPS: unknown step '$s' (ext4 kill9 single takeover stale trim errors encrypted)" ;;
    esac
done

# ------------------------------------------------------------------ Ceph ----

ceph_tools() {
    local t
    for t in ceph-mon monmaptool ceph-osd radosgw radosgw-admin ceph ceph-authtool curl; do
        command -v "$t" >/dev/null 2>&1 || return 1
    done
}

# free_port PORT FALLBACK -- PORT if nothing listens on it, else the first
# free one from FALLBACK on.
free_port() {
    local p=$1
    command -v ss >/dev/null 2>&1 || {
        echo "$p"
        return
    }
    if [[ -n $(ss -Htln "sport = :$p") ]]; then
        p=$2
        while [[ -n $(ss -Htln "sport = :$p") ]]; do p=$((p + 1)); done
    fi
    echo "$p"
}

CEPH_STARTED=0
# shellcheck disable=SC2317  # called from the EXIT trap
ceph_stop() {
    ((CEPH_STARTED)) || return 0
    CEPH_STARTED=0
    "$CEPH_LOCAL" stop "$CEPH_DIR" >>"$E2E_TMP/ceph.log" 2>&1 ||
        echo "cleanup: $CEPH_LOCAL stop $CEPH_DIR failed: $(tail -n 5 "$E2E_TMP/ceph.log")" >&2
}

# lib.sh's cleanup (unmount, detach, kill the servers), then Ceph (the servers'
# last requests need it), then the temp dir (Ceph's is inside it).
eval "_e2e_lib_cleanup() $(declare -f _cleanup | tail -n +2)"
# shellcheck disable=SC2317  # called from the EXIT trap
_cleanup() {
    local keep_tmp=$E2E_KEEP p
    set +e
    # A server of the takeover steps may be stopped (SIGSTOP).
    for p in "${_E2E_PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; done
    E2E_KEEP=1
    _e2e_lib_cleanup 2> >(grep -v '^E2E_KEEP=1: leaving' >&2)
    E2E_KEEP=$keep_tmp
    ceph_stop
    if [[ "$E2E_KEEP" == 1 ]]; then
        echo "E2E_KEEP=1: leaving $E2E_TMP" >&2
    else
        rm -rf "$E2E_TMP"
    fi
}

start_ceph() {
    local t0=$SECONDS exports rgw mon try
    if ! ceph_tools; then
        command -v apt-get >/dev/null 2>&1 ||
            skip "Ceph (ceph-mon, ceph-osd, radosgw) is not installed and there is no apt-get to install it"
    fi
    CEPH_STARTED=1
    for try in 1 2 3; do
        rgw=${CEPH_RGW_PORT:-$(free_port 7480 17480)}
        mon=${CEPH_MON_PORT:-$(free_port 3300 13300)}
        step "setup: local Ceph + radosgw in $CEPH_DIR (S3 on 127.0.0.1:$rgw, mon on :$mon)"
        if exports=$(CEPH_RGW_PORT=$rgw CEPH_MON_PORT=$mon "$CEPH_LOCAL" start "$CEPH_DIR" 2>"$E2E_TMP/ceph.log"); then
            break
        fi
        ceph_tools || skip "could not install Ceph: $(tail -n 5 "$E2E_TMP/ceph.log")"
        # A port taken meanwhile (another test starting a cluster): again.
        if ((try < 3)) && [[ -z ${CEPH_RGW_PORT:-}${CEPH_MON_PORT:-} ]] && grep -q 'is in use' "$E2E_TMP/ceph.log"; then
            log "$(grep -m1 'is in use' "$E2E_TMP/ceph.log"); trying other ports"
            "$CEPH_LOCAL" stop "$CEPH_DIR" >>"$E2E_TMP/ceph.log" 2>&1 || true
            sleep "$try"
            continue
        fi
        cat "$E2E_TMP/ceph.log"
        fail "scripts/ceph-local start failed (log above)"
    done
    # Credentials of the throw-away cluster only.
    unset AWS_SESSION_TOKEN AWS_PROFILE AWS_DEFAULT_REGION AWS_CONFIG_FILE AWS_SHARED_CREDENTIALS_FILE
    eval "$exports"
    [[ ${AWS_ENDPOINT_URL:-} == "http://127.0.0.1:$rgw" && -n ${CEPH_CONF:-} ]] ||
        fail "scripts/ceph-local start printed unexpected exports: $exports"
    "$CEPH_LOCAL" mkbucket "$BUCKET" "$CEPH_DIR" 2>>"$E2E_TMP/ceph.log" || fail "mkbucket $BUCKET failed"
    "$CEPH_LOCAL" mkbucket "$TRIM_BUCKET" "$CEPH_DIR" 2>>"$E2E_TMP/ceph.log" || fail "mkbucket $TRIM_BUCKET failed"
    log "Ceph up in $((SECONDS - t0))s: $AWS_ENDPOINT_URL, buckets $BUCKET and $TRIM_BUCKET"
}

# rgw_objects BUCKET -- the bucket's object count, per radosgw itself
rgw_objects() {
    radosgw-admin -c "$CEPH_CONF" bucket stats --bucket="$1" 2>>"$E2E_TMP/rgw.err" |
        "$PY" -c 'import json,sys; print(json.load(sys.stdin).get("usage", {}).get("rgw.main", {}).get("num_objects", 0))'
}

# rgw_names BUCKET PREFIX -- names of the objects under PREFIX, sorted
rgw_names() {
    radosgw-admin -c "$CEPH_CONF" bucket list --bucket="$1" --max-entries=1000000 2>>"$E2E_TMP/rgw.err" |
        "$PY" -c 'import json,sys; print("\n".join(sorted(o["name"] for o in json.load(sys.stdin) if o["name"].startswith(sys.argv[1]))))' "$2"
}

# ---------------------------------------------------------------- helpers ----

TIMES=()
begin() {
    STEP_NAME=$1
    shift
    step "$STEP_NAME: $*"
    STEP_T0=$(now)
}
end_step() {
    local s
    s=$(awk -v a="$STEP_T0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    TIMES+=("$STEP_NAME ${s}s")
    log "$STEP_NAME: ok (${s}s)"
}

# create URL SIZE [args...]
create() {
    local url=$1 size=$2
    shift 2
    "$CVOL" create "$url" --size "$size" "$@" >"$E2E_TMP/create.log" 2>&1 ||
        fail "cvol create $url --size $size $* failed: $(cat "$E2E_TMP/create.log")"
}

# try_serve URL [serve args...] -- like lib.sh's start_server, with a new
# empty --cache-dir and --lease $LEASE; returns 1 (SRV_RC set) if the server
# exits before printing its URI. With SRV_RUN_DIR set, the server gets it as
# CVOL_RUN_DIR.
try_serve() {
    local url=$1 n line deadline envs=()
    shift
    _E2E_SRV_SEQ=$((_E2E_SRV_SEQ + 1))
    n=$_E2E_SRV_SEQ
    SRV_SOCK=$E2E_TMP/srv$n.sock
    SRV_OUT=$E2E_TMP/srv$n.out
    SRV_ERR=$E2E_TMP/srv$n.err
    CACHE_DIR=$E2E_TMP/cache$n
    if [[ -n ${SRV_RUN_DIR:-} ]]; then
        mkdir -p "$SRV_RUN_DIR"
        envs=(CVOL_RUN_DIR="$SRV_RUN_DIR")
    fi
    env "${envs[@]}" "$CVOL" serve "$url" --socket "$SRV_SOCK" --cache-dir "$CACHE_DIR" \
        --lease "$LEASE" "$@" >"$SRV_OUT" 2>"$SRV_ERR" &
    SRV_PID=$!
    reg_pid "$SRV_PID"
    SRV_URI=""
    SRV_RC=""
    deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    while :; do
        line=$(grep -m1 -E '^nbd\+unix://' "$SRV_OUT" 2>/dev/null || true)
        if [[ -n "$line" ]]; then
            SRV_URI=${line%$'\r'}
            log "server pid $SRV_PID (cache dir ${CACHE_DIR##*/}) ready at $SRV_URI"
            return 0
        fi
        if ! _alive "$SRV_PID"; then
            SRV_RC=0
            wait "$SRV_PID" || SRV_RC=$?
            unreg_pid "$SRV_PID"
            return 1
        fi
        (($(date +%s) < deadline)) ||
            fail "cvol serve $url did not print its URI within ${E2E_READY_TIMEOUT}s; stderr: $(tail -n 5 "$SRV_ERR")"
        sleep 0.05
    done
}

# s3_serve URL [serve args...] -- try_serve or fail
s3_serve() {
    try_serve "$@" ||
        fail "cvol serve $1 exited with status $SRV_RC before serving; stderr: $(tail -n 5 "$SRV_ERR")"
}

# qio WHAT URI CMD... -- qemu-io commands that must all succeed
qio() {
    local what=$1 uri=$2 c args=() rc=0
    shift 2
    for c in "$@"; do args+=(-c "$c"); done
    timeout 120 qemu-io -f raw "${args[@]}" "$uri" >"$E2E_TMP/qemu-io.out" 2>&1 || rc=$?
    if ((rc != 0)) || grep -qiE 'fail|error' "$E2E_TMP/qemu-io.out"; then
        head -n 20 "$E2E_TMP/qemu-io.out"
        fail "$what: qemu-io ${*} (exit $rc)"
    fi
}

# expect_log FILE TEXT WHAT -- FILE (a server's stderr) says TEXT
expect_log() {
    grep -qF -- "$2" "$1" || {
        tail -n 10 "$1"
        fail "$3: its log does not say '$2'"
    }
}

# stat_keys URL KEY... -- stat --json values, space-separated
stat_keys() {
    cvol_stat_json "$1" "$E2E_TMP/stat.json"
    local k out=()
    for k in "${@:2}"; do out+=("$k=$(json_get "$E2E_TMP/stat.json" "$k")"); done
    echo "${out[*]}"
}

# --------------------------------------------------- ext4 (as ext4.sh) ----

# SRCS: directory trees adding up to 100-160 MB (as cache.sh picks them).
pick_sources() {
    local d mb total=0
    SRCS=()
    if [[ -n "${E2E_S3_SRC:-}" ]]; then
        read -ra SRCS <<<"$E2E_S3_SRC"
        for d in "${SRCS[@]}"; do [[ -d "$d" ]] || fail "E2E_S3_SRC: $d is not a directory"; done
        return
    fi
    for d in /usr/lib/python3.[0-9]* /usr/share/doc /usr/share/man /usr/lib/gcc /usr/share/locale /usr/share/perl; do
        [[ -d "$d" ]] || continue
        mb=$(du -sm "$d" 2>/dev/null | cut -f1)
        ((mb >= 10 && total + mb <= 160)) || continue
        SRCS+=("$d")
        total=$((total + mb))
        ((total < 100)) || break
    done
    ((total >= 50)) || fail "found only $total MB of source trees under /usr; set E2E_S3_SRC"
}

# attach -- nbdfuse the current server's export to $FUSE_DIR/nbd, a loop
# device on it; sets LOOP and FUSE_PID.
attach() {
    local sz
    nbdfuse "$FUSE_DIR" "$SRV_URI" >"$E2E_TMP/nbdfuse.log" 2>&1 &
    FUSE_PID=$!
    reg_pid "$FUSE_PID"
    reg_fuse "$FUSE_DIR"
    wait_until 20 "nbdfuse to expose $FUSE_DIR/nbd" test -f "$FUSE_DIR/nbd"
    sz=$(stat -c %s "$FUSE_DIR/nbd")
    [[ $sz -eq $(to_bytes "$FS_SIZE") ]] || fail "$FUSE_DIR/nbd has size $sz, expected $FS_SIZE"
    LOOP=$(losetup -f --show "$FUSE_DIR/nbd") || fail "losetup on $FUSE_DIR/nbd failed"
    reg_loop "$LOOP"
    log "nbdfuse pid $FUSE_PID, loop device $LOOP"
}

# detach [dead] -- loop device and nbdfuse away (dead: the server was
# killed, so nbdfuse's exit status and a failing umount are expected).
detach() {
    local dead=${1:-} rc=0
    losetup -d "$LOOP" || fail "losetup -d $LOOP failed"
    unreg_loop "$LOOP"
    wait_until 20 "$LOOP to detach" bash -c "! losetup '$LOOP' >/dev/null 2>&1"
    fuse_unmount "$FUSE_DIR" 2>/dev/null || [[ -n $dead ]] || fail "unmounting FUSE $FUSE_DIR failed"
    if [[ -n $dead ]] && mountpoint -q "$FUSE_DIR"; then umount -l "$FUSE_DIR" || true; fi
    unreg_fuse "$FUSE_DIR"
    wait_until 20 "nbdfuse to exit" bash -c "! kill -0 $FUSE_PID 2>/dev/null || grep -q '^State:.*Z' /proc/$FUSE_PID/status"
    wait "$FUSE_PID" || rc=$?
    unreg_pid "$FUSE_PID"
    ((rc == 0)) || [[ -n $dead ]] || fail "nbdfuse exited with status $rc: $(cat "$E2E_TMP/nbdfuse.log")"
}

mount_fs() {
    mount -t ext4 "$LOOP" "$FS_DIR" || fail "mount $LOOP failed"
    reg_mount "$FS_DIR"
}
umount_fs() {
    umount "$FS_DIR" || fail "umount $FS_DIR failed"
    unreg_mount "$FS_DIR"
}

# fsck_clean WHAT
fsck_clean() {
    local rc=0
    e2fsck -fn "$LOOP" >"$E2E_TMP/e2fsck.txt" 2>&1 || rc=$?
    if ((rc != 0)); then
        cat "$E2E_TMP/e2fsck.txt"
        fail "e2fsck -fn $LOOP ($1) reported problems (exit $rc)"
    fi
    log "e2fsck -fn ($1): $(tail -n 1 "$E2E_TMP/e2fsck.txt")"
}

# diff_trees WHAT -- each source tree against its copy $FS_DIR/tN
diff_trees() {
    local i
    for i in "${!SRCS[@]}"; do
        diff -r --no-dereference "${SRCS[i]}" "$FS_DIR/t$i" >"$E2E_TMP/diff.txt" 2>&1 || {
            head -n 20 "$E2E_TMP/diff.txt"
            fail "$1: diff -r ${SRCS[i]} vs its copy in the file system: differences found"
        }
    done
}

# ------------------------------------------------------------------ data ----

# K9_DATA: 48 MiB of real data (a tar of /usr) then 16 MiB of random bytes.
k9_data() {
    [[ -n ${K9_DATA:-} ]] && return
    tar_image usr-doc 48 /usr/share /usr/lib
    K9_DATA=$E2E_TMP/k9.img
    cat "$TAR_IMAGE" >"$K9_DATA"
    head -c 16M /dev/urandom >>"$K9_DATA"
}

# ================================================================= steps ====

FS_URL=s3://$BUCKET/ext4
FS_PID=""

step_ext4() {
    local t0 i
    pick_sources
    SRC_MB=$(du -smc "${SRCS[@]}" | tail -n 1 | cut -f1)
    begin ext4 "ext4 on $FS_URL ($FS_SIZE, --cache-size $FS_CACHE): mkfs, copy ${SRCS[*]} ($SRC_MB MB), sync, umount, e2fsck -fn, mount, diff -r"
    create "$FS_URL" "$FS_SIZE"
    s3_serve "$FS_URL" --cache-size "$FS_CACHE"
    FS_PID=$SRV_PID
    attach
    mkfs.ext4 -q -F "$LOOP" || fail "mkfs.ext4 $LOOP failed"
    mount_fs
    t0=$SECONDS
    for i in "${!SRCS[@]}"; do
        cp -a "${SRCS[i]}" "$FS_DIR/t$i" || fail "cp -a ${SRCS[i]} failed"
    done
    sync -f "$FS_DIR"
    log "copy + sync: $((SECONDS - t0))s"
    umount_fs
    fsck_clean "after umount"
    mount_fs
    t0=$SECONDS
    diff_trees "ext4 after umount and mount"
    log "diff -r: identical ($((SECONDS - t0))s); $(stat_keys "$FS_URL" object_store object_count object_bytes object_puts object_gets object_cache_evictions object_cache_hit_ratio mapped_bytes physical_used_bytes)"
    [[ $(json_get "$E2E_TMP/stat.json" object_store) == "$FS_URL" ]] || fail "stat: object_store is not $FS_URL"
    (($(json_get "$E2E_TMP/stat.json" object_cache_evictions) > 0)) ||
        fail "no chunk was evicted from a $FS_CACHE cache: reading back did not exercise GETs (set a smaller E2E_S3_FS_CACHE)"
    # Stays mounted: kill9 kills its server under it.
    end_step
}

step_kill9() {
    local url=s3://$BUCKET/k9 k9_out=$E2E_TMP/k9.out
    begin kill9 "flushed data survives kill -9; a serve with a new empty cache dir reads it from the store"
    k9_data
    create "$url" 256M
    s3_serve "$url"
    nbdcopy --flush "$K9_DATA" "$SRV_URI" || fail "nbdcopy --flush into $url failed"
    # Small unaligned writes: bytes in a delta, not a whole chunk object.
    qio "unaligned writes" "$SRV_URI" "write -P 0x5a 104859137 10000" "write -P 0xa5 209715200 4096" flush
    kill9_server
    s3_serve "$url"
    expect_log "$SRV_ERR" "lease lapsed: taking the volume over" "the serve after kill -9"
    nbdcopy "$SRV_URI" "$k9_out" || fail "nbdcopy out of $url failed"
    cmp -n "$(stat -c %s "$K9_DATA")" "$K9_DATA" "$k9_out" || fail "kill -9: the flushed nbdcopy data differs after recovery"
    qio "kill -9: read back the flushed unaligned writes" "$SRV_URI" \
        "read -P 0x5a 104859137 10000" "read -P 0 104857600 1537" "read -P 0 104869137 4096" \
        "read -P 0xa5 209715200 4096"
    log "64 MiB + unaligned writes read back exact; $(stat_keys "$url" object_count object_gets object_cache_hit_ratio)"
    stop_server
    rm -f "$k9_out"

    if [[ -z $FS_PID ]]; then
        log "(ext4 part skipped: the ext4 step did not run)"
        end_step
        return
    fi
    step "kill9: ext4 (mounted) gets one more file, sync, kill -9 its server"
    cp "$K9_DATA" "$FS_DIR/after-sync.img" || fail "cp into ext4 failed"
    sync
    kill9_server "$FS_PID"
    FS_PID=""
    log "(nbdfuse may abort now, its server gone: expected)"
    umount "$FS_DIR" 2>/dev/null || umount -l "$FS_DIR" || fail "cannot unmount $FS_DIR after the server died"
    unreg_mount "$FS_DIR"
    detach dead
    s3_serve "$FS_URL" --cache-size "$FS_CACHE"
    expect_log "$SRV_ERR" "lease lapsed: taking the volume over" "the ext4 serve after kill -9"
    attach
    mount_fs # replays ext4's journal
    diff_trees "ext4 after kill -9"
    cmp "$K9_DATA" "$FS_DIR/after-sync.img" || fail "ext4 after kill -9: the file written before sync differs"
    log "after kill -9: mounted (journal replayed), trees identical, the file written before sync exact"
    umount_fs
    fsck_clean "after kill -9, journal replayed"
    detach
    stop_server
    end_step
}

step_single() {
    local url=s3://$BUCKET/single rc=0 t0 secs
    begin single "a second serve while the first runs is refused (exit 2)"
    create "$url" 256M
    s3_serve "$url"
    qio "write through the first server" "$SRV_URI" "write -P 0x3c 0 1M" flush
    t0=$(now)
    timeout 60 "$CVOL" serve "$url" --cache-dir "$E2E_TMP/cache-second" --lease "$LEASE" \
        --socket "$E2E_TMP/second.sock" >"$E2E_TMP/second.out" 2>"$E2E_TMP/second.err" || rc=$?
    secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    ((rc == 2)) || {
        cat "$E2E_TMP/second.err"
        fail "a second serve of $url exited $rc (expected 2) after ${secs}s"
    }
    expect_log "$E2E_TMP/second.err" "being served by another server" "the second serve"
    [[ ! -e "$E2E_TMP/second.sock" ]] || fail "the refused serve left its socket behind"
    [[ ! -s "$E2E_TMP/second.out" ]] || fail "the refused serve printed on stdout: $(cat "$E2E_TMP/second.out")"
    log "refused after ${secs}s: $(grep -m1 'cvol:' "$E2E_TMP/second.err")"
    qio "the first server after the refusal" "$SRV_URI" "read -P 0x3c 0 1M" "write -P 0x3d 1M 1M" flush
    stop_server
    end_step
}

# takeover_run URL LATE -- A serves and is stopped; B takes over; with LATE,
# B writes a manifest (and deletes its fence delta) before A resumes.
takeover_run() {
    local url=$1 late=$2 a_pid a_uri a_err b_uri b_pid rc=0 i args=() m0 m1
    create "$url" 256M
    SRV_RUN_DIR=""
    ((OWN_RUN_DIR)) && SRV_RUN_DIR=$E2E_TMP/run-A
    s3_serve "$url"
    a_pid=$SRV_PID a_uri=$SRV_URI a_err=$SRV_ERR
    # 0x44: whole chunks of A's, which B's volume keeps referencing.
    qio "A: write 0x11 and 0x44" "$a_uri" "write -P 0x11 0 1M" "write -P 0x44 8M 8M" flush
    kill -STOP "$a_pid"
    log "A (pid $a_pid) stopped with SIGSTOP"
    ((OWN_RUN_DIR)) && SRV_RUN_DIR=$E2E_TMP/run-B
    try_serve "$url" ||
        fail "B: the serve taking over from the stopped A exited $SRV_RC: $(grep -m1 '^cvol:' "$SRV_ERR")"
    b_pid=$SRV_PID b_uri=$SRV_URI
    expect_log "$SRV_ERR" "lease lapsed: taking the volume over" "B"
    qio "B: write 0x22" "$b_uri" "write -P 0x22 0 1M" flush
    if [[ $late == late ]]; then
        m0=$(rgw_names "$BUCKET" "${url#s3://"$BUCKET"/}/manifest/")
        for i in $(seq 520); do args+=(-c "write -P $((i % 250 + 1)) $((64 * 1048576 + i * 4096)) 4096" -c flush); done
        timeout 120 qemu-io -f raw "${args[@]}" "$b_uri" >"$E2E_TMP/qemu-io.out" 2>&1 ||
            fail "B: 520 small writes and flushes failed: $(tail -n 3 "$E2E_TMP/qemu-io.out")"
        i=0
        while [[ $(rgw_names "$BUCKET" "${url#s3://"$BUCKET"/}/manifest/") == "$m0" ]]; do
            ((i++ < 300)) || fail "B wrote no manifest within 30s of 520 flushes"
            sleep 0.1
        done
        qio "B: one more write" "$b_uri" "write -P 0x22 1M 4096" flush
        m1=$(rgw_names "$BUCKET" "${url#s3://"$BUCKET"/}/manifest/" | tr '\n' ' ')
        log "B flushed 520 small writes: manifests now ${m1//${url#s3://"$BUCKET"/}\/manifest\//}"
    fi
    kill -CONT "$a_pid"
    log "A (pid $a_pid) resumed with SIGCONT"
    timeout 60 qemu-io -f raw -c "write -P 0x33 0 1M" -c flush "$a_uri" >"$E2E_TMP/qemu-io-a.out" 2>&1 || rc=$?
    if ((rc == 0)) && ! grep -qiE 'fail|error' "$E2E_TMP/qemu-io-a.out"; then
        cat "$E2E_TMP/qemu-io-a.out"
        local why="after B took the volume over"
        [[ $late != late ]] || why="after B took the volume over, wrote a manifest and deleted the deltas before it (was B's fence delta deleted too?)"
        fail "A (fenced) acknowledged a write of 0x33 and a FLUSH $why"
    fi
    log "A's write + flush failed as it must: $(grep -m1 -iE 'fail|error' "$E2E_TMP/qemu-io-a.out")"
    wait_until 10 "A's log to say 'fenced'" grep -q fenced "$a_err"
    qio "B: read 0x22 after A's attempt" "$b_uri" "read -P 0x22 0 1M"
    stop_server "$b_pid"
    kill9_server "$a_pid"
    ((OWN_RUN_DIR)) && SRV_RUN_DIR=$E2E_TMP/run-C
    s3_serve "$url"
    if grep -q 'did not release its lease' "$SRV_ERR"; then
        fail "C waited for a lease: B's clean stop did not release it"
    fi
    qio "C: read 0x22 (B's data, not A's) and A's 0x44 from before the takeover" "$SRV_URI" \
        "read -P 0x22 0 1M" "read -P 0x44 8M 8M"
    [[ $late != late ]] || qio "C: read B's last write" "$SRV_URI" "read -P 0x22 1M 4096"
    stop_server
    SRV_RUN_DIR=""
}

step_takeover() {
    begin takeover "kill -STOP A, B takes over after the lease; A resumed is fenced"
    takeover_run "s3://$BUCKET/takeover" early
    end_step
}

step_stale() {
    begin stale "as takeover, but A resumes after B wrote a manifest and deleted the deltas before it"
    takeover_run "s3://$BUCKET/stale" late
    end_step
}

step_trim() {
    local url=s3://$TRIM_BUCKET/trim data=$E2E_TMP/random.img before after n deadline t0 next_log=0
    begin trim "TRIM frees segments; the store deletes their chunk objects"
    head -c 256M /dev/urandom >"$data"
    create "$url" 2G
    s3_serve "$url"
    nbdcopy --flush "$data" "$SRV_URI" || fail "nbdcopy --flush into $url failed"
    rm -f "$data"
    # Chunks still uploading in the background land within seconds.
    sleep 2
    before=$(rgw_objects "$TRIM_BUCKET")
    log "256 MiB of random data: $before objects in the bucket; $(stat_keys "$url" object_count object_bytes object_puts physical_used_bytes)"
    ((before >= 64)) || fail "only $before objects for 256 MiB of random data in 4 MiB chunks"
    # Idle for longer than the store's manifest interval (30 s), as a volume
    # usually is before an fstrim.
    log "idle for ${TRIM_IDLE}s before the TRIM"
    sleep "$TRIM_IDLE"
    qio "discard the whole device" "$SRV_URI" "discard 0 1G" "discard 1G 1G" flush
    t0=$SECONDS
    deadline=$((SECONDS + TRIM_WAIT))
    while :; do
        n=$(rgw_objects "$TRIM_BUCKET")
        ((n * 4 <= before)) && break
        ((SECONDS < deadline)) || fail "after ${TRIM_WAIT}s the bucket still holds $n objects (was $before; must fall to $((before / 4)) or less); $(stat_keys "$url" object_count object_deletes mapped_bytes physical_used_bytes cleaner_segments_cleaned segments_used)"
        if ((SECONDS >= next_log)); then
            log "waiting: $n objects; $(stat_keys "$url" object_count object_deletes mapped_bytes physical_used_bytes segments_used)"
            next_log=$((SECONDS + 10))
        fi
        sleep 1
    done
    after=$n
    log "after $((SECONDS - t0))s: $after objects in the bucket (was $before); $(stat_keys "$url" object_count object_deletes mapped_bytes physical_used_bytes)"
    qio "read zeros after the discard" "$SRV_URI" "read -P 0 0 256M"
    stop_server
    end_step
}

# refused WHAT TEXT CMD... -- CMD exits 2 and says TEXT on stderr
refused() {
    local what=$1 text=$2 rc=0
    shift 2
    timeout 60 "$@" >"$E2E_TMP/refused.out" 2>"$E2E_TMP/refused.err" || rc=$?
    if ((rc != 2)) || ! grep -qF -- "$text" "$E2E_TMP/refused.err"; then
        cat "$E2E_TMP/refused.err"
        fail "$what: exit $rc (expected 2) and stderr must say '$text'"
    fi
    log "$what: exit 2, $(grep -m1 . "$E2E_TMP/refused.err" | cut -c1-160)"
}

step_errors() {
    local url=s3://$BUCKET/errors
    begin errors "refused commands: exit 2 and a message"
    create "$url" 256M
    s3_serve "$url"
    qio "write 0x77" "$SRV_URI" "write -P 0x77 0 1M" flush
    stop_server
    [[ -z $(rgw_names "$BUCKET" errors/probe/) ]] || fail "the create-only probes left objects behind"
    s3_serve "$url" --unsafe-no-fencing
    expect_log "$SRV_ERR" "fencing stays on" "serve --unsafe-no-fencing on a store that honours create-only PUTs"
    stop_server
    refused "serve without --cache-dir" "--cache-dir" \
        "$CVOL" serve "$url" --socket "$E2E_TMP/e1.sock"
    [[ ! -e "$E2E_TMP/e1.sock" ]] || fail "serve without --cache-dir left its socket behind"
    refused "create on an existing volume without --force" "--force" \
        "$CVOL" create "$url" --size 256M
    s3_serve "$url"
    qio "the volume after the refused create" "$SRV_URI" "read -P 0x77 0 1M"
    stop_server
    refused "create with a bad bucket name" "not a bucket name" \
        "$CVOL" create s3://BadBucket/x --size 1G
    refused "create without a prefix" "prefix" \
        "$CVOL" create "s3://$BUCKET" --size 1G
    refused "create in a bucket that does not exist" "no-such-bucket" \
        "$CVOL" create s3://no-such-bucket/x --size 1G
    refused "serve of a prefix with no volume" "cvol create" \
        "$CVOL" serve "s3://$BUCKET/nothing-here" --cache-dir "$E2E_TMP/cache-none" --socket "$E2E_TMP/e2.sock"
    [[ -z $(rgw_names "$BUCKET" nothing-here/) ]] || fail "the refused serve wrote objects under nothing-here/"
    "$CVOL" create "$E2E_TMP/local.cvol" --size 64M >/dev/null 2>&1 || fail "cvol create of a local volume failed"
    refused "--cache-dir for a local volume" "--cache-dir" \
        "$CVOL" serve "$E2E_TMP/local.cvol" --cache-dir "$E2E_TMP/cache-local" --socket "$E2E_TMP/e3.sock"
    refused "serve --unsafe-no-fencing of a local volume" "--unsafe-no-fencing" \
        "$CVOL" serve "$E2E_TMP/local.cvol" --unsafe-no-fencing --socket "$E2E_TMP/e4.sock"
    refused "create --unsafe-no-fencing of a local volume" "--unsafe-no-fencing" \
        "$CVOL" create "$E2E_TMP/local2.cvol" --size 64M --unsafe-no-fencing
    [[ ! -e "$E2E_TMP/local2.cvol" ]] || fail "the refused create left $E2E_TMP/local2.cvol behind"
    end_step
}

# s3_get NAME OUT -- one object of $BUCKET through the S3 API
s3_get() {
    curl -sSf --aws-sigv4 "aws:amz:${AWS_REGION:-us-east-1}:s3" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
        --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" -o "$2" \
        "$AWS_ENDPOINT_URL/$BUCKET/$1" || fail "S3 GET $BUCKET/$1 failed"
}

# plaintext_hits PREFIX -- HITS: per search string, how often it occurs in
# the objects under $BUCKET/PREFIX (all fetched, then searched together);
# OBJECTS: how many there are
plaintext_hits() {
    local name s dir=$E2E_TMP/objects n=0 counts=()
    rm -rf "$dir"
    mkdir "$dir"
    while IFS= read -r name; do
        [[ -n $name ]] || continue
        n=$((n + 1))
        s3_get "$name" "$dir/$n"
    done < <(rgw_names "$BUCKET" "$1")
    ((n > 0)) || fail "no objects under $BUCKET/$1"
    while IFS= read -r s; do
        counts+=("$(cat "$dir"/* | grep -c -F -a -e "$s" || true)")
    done <"$E2E_TMP/needles"
    rm -rf "$dir"
    OBJECTS=$n
    HITS=${counts[*]}
}

step_encrypted() {
    local key=$E2E_TMP/enc.key data back=$E2E_TMP/enc-out.img hits c s url
    begin encrypted "no plaintext of written data in the objects of an encrypted volume"
    tar_image usr-doc 24 /usr/share/doc
    data=$TAR_IMAGE
    "$PY" "$E2E_DIR/py/needles.py" "$data" "$E2E_TMP/needles" 8 || fail "no search strings in $data"
    (umask 077 && head -c 32 /dev/urandom >"$key")
    for c in clear encrypted; do
        url=s3://$BUCKET/enc-$c
        if [[ $c == clear ]]; then
            # Room for the 24 MiB stored as it is (no codec) and the metadata.
            create "$url" 24M --physical-size 48M --codec none
            s3_serve "$url"
        else
            create "$url" 24M --physical-size 48M --codec none --encryption aes-256-gcm --key-file "$key"
            s3_serve "$url" --key-file "$key"
        fi
        nbdcopy --flush "$data" "$SRV_URI" || fail "nbdcopy --flush into $url failed"
        rm -f "$back"
        nbdcopy "$SRV_URI" "$back" || fail "nbdcopy out of $url failed"
        cmp "$data" "$back" || fail "$url reads back different data"
        rm -f "$back"
        stop_server
        plaintext_hits "enc-$c/"
        log "$c: the search strings occur ($HITS) times in the $OBJECTS objects under enc-$c/"
        if [[ $c == clear ]]; then
            [[ " $HITS " != *" 0 "* ]] || fail "a search string is missing from the objects of the volume in the clear ($HITS): the search cannot prove anything"
        else
            [[ $HITS == "0 0 0 0 0 0 0 0" ]] || fail "plaintext of the data is in the objects of the encrypted volume ($HITS)"
            hits=$(while IFS= read -r s; do
                find "$CACHE_DIR" -type f -exec cat {} + | grep -c -F -a -e "$s" || true
            done <"$E2E_TMP/needles" | tr '\n' ' ')
            log "$c: in its serve's --cache-dir ($(du -sk "$CACHE_DIR" | cut -f1) KiB): ($hits)"
            [[ $hits == "0 0 0 0 0 0 0 0 " ]] || fail "plaintext of the data is in the --cache-dir of the encrypted volume ($hits)"
        fi
    done
    refused "serve of the encrypted volume without its key" "--key-file" \
        "$CVOL" serve "$url" --cache-dir "$E2E_TMP/cache-nokey" --socket "$E2E_TMP/e5.sock"
    grep -qF encrypted "$E2E_TMP/refused.err" || fail "serve without the key: no 'encrypted' in $(cat "$E2E_TMP/refused.err")"
    step_encrypted_rotate "$url" "$key" "$data"
    end_step
}

# step_encrypted_rotate URL KEY DATA -- `cvol key rotate` of a volume in the
# store: refused while served (here, and by a server this host cannot see:
# its lease), then the new key reads DATA back and the old key is refused.
step_encrypted_rotate() {
    local url=$1 key=$2 data=$3 newkey=$E2E_TMP/enc-new.key back=$E2E_TMP/enc-out.img
    (umask 077 && printf 'a passphrase for the rotated volume\n' >"$newkey")
    s3_serve "$url" --key-file "$key"
    refused "key rotate of a served volume" "served" \
        "$CVOL" --key-file "$key" key rotate "$url" --new-key-file "$newkey"
    stop_server
    SRV_RUN_DIR=$E2E_TMP/run-elsewhere s3_serve "$url" --key-file "$key"
    refused "key rotate of a volume served where its control socket is not seen" "stop it first" \
        "$CVOL" --key-file "$key" key rotate "$url" --new-key-file "$newkey"
    stop_server
    "$CVOL" --key-file "$key" key rotate "$url" --new-key-file "$newkey" >"$E2E_TMP/rotate.out" 2>&1 ||
        fail "key rotate of $url: $(cat "$E2E_TMP/rotate.out")"
    log "rotated: $(cat "$E2E_TMP/rotate.out")"
    refused "serve with the key the rotation retired" "key" \
        "$CVOL" serve "$url" --key-file "$key" --cache-dir "$E2E_TMP/cache-oldkey" --socket "$E2E_TMP/e6.sock"
    s3_serve "$url" --key-file "$newkey"
    rm -f "$back"
    nbdcopy "$SRV_URI" "$back" || fail "nbdcopy out of $url after the rotation failed"
    cmp "$data" "$back" || fail "$url reads back different data after the rotation"
    rm -f "$back"
    stop_server
}

# ================================================================== main ====

# Control sockets of object-store volumes are named after the URL: ours only.
export CVOL_RUN_DIR=$E2E_TMP/run
mkdir -p "$CVOL_RUN_DIR"
T_START=$(now)
start_ceph
for s in $STEPS; do
    case $s in
        ext4) step_ext4 ;;
        kill9) step_kill9 ;;
        single) step_single ;;
        takeover) step_takeover ;;
        stale) step_stale ;;
        trim) step_trim ;;
        errors) step_errors ;;
        encrypted) step_encrypted ;;
    esac
done
TIMES+=("total $(awk -v a="$T_START" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')s")
log "timings: ${TIMES[*]}"
pass "steps: $STEPS; ${TIMES[*]}"
