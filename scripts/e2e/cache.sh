#!/usr/bin/env bash
# A cache volume (`cvol create --origin`) in front of an HDD-like origin:
# `nbdkit --filter=delay file origin.img rdelay=2ms wdelay=2ms` on a unix
# socket, named to the cache as nbd+unix:///?socket=PATH. For each mode
# (write-through, write-back):
# - ext4: create the cache (physical size well under the data, so lines are
#   evicted), serve it, nbdfuse + loop + mkfs.ext4, copy real trees (~150-200
#   MB) in, unmount, stop cleanly; restart: `start` is warm; e2fsck -fn clean
#   and diff -r identical through the cache; stat shows evictions and hits;
#   `cvol check` of the cache passes;
# - the origin alone (cache stopped): e2fsck -fn of origin.img clean, and
#   mounted read-only its trees diff identical (write-back: everything was
#   written back at the clean stop);
# - kill -9: a fresh origin and a small cache (lines evicted under the load),
#   kill9.sh's writer (64 KiB writes over 2 connections, flushes, FUA)
#   through the cache, the cache server killed mid-load, E2E_CACHE_K9_ROUNDS
#   times: write-through's origin alone holds every flushed write; restarted,
#   `start` is cold (write-through) or recovered (write-back) and every write
#   acknowledged by a completed flush (or FUA) reads back; after a clean
#   stop the origin file alone is identical to what the cache served, and
#   `cvol check` of the cache passes; the next start is warm.
# Then bad input: serving a cache whose origin socket is gone (stale, or
# removed) exits 2 naming the origin and leaves the cache file unchanged;
# `create` with a missing origin, the cache itself as origin, --size with
# --origin, --cache-mode bogus: exit 2, a clear message, no file left.
#
#   E2E_CACHE_SRC      directories to copy (space-separated; default: trees
#                      under /usr adding up to 150-200 MB)
#   E2E_CACHE_ORIGIN   origin size for the ext4 part (default 512M)
#   E2E_CACHE_PHYS     the cache's --physical-size there (default: a third
#                      of the trees' size, so that they overflow it)
#   E2E_CACHE_MODES    modes to run (default "write-through write-back")
#   E2E_CACHE_PARTS    parts to run (default "ext4 kill9 bad")
#   E2E_CACHE_DELAY    nbdkit delay filter's rdelay/wdelay (default 2ms)
#   E2E_CACHE_K9_ORIGIN, E2E_CACHE_K9_PHYS  origin and cache sizes of the
#                      kill -9 part (default 128M, 8M)
#   E2E_CACHE_K9_ROUNDS kill -9 rounds per mode (default 3)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol only (a cache volume)"
need_root
need nbdkit qemu-io nbdfuse losetup mkfs.ext4 e2fsck mount umount diff cmp cksum
[[ -e /dev/fuse ]] || skip "/dev/fuse missing"
nbdkit --filter=delay file --dump-plugin >/dev/null 2>&1 || skip "nbdkit's delay filter or file plugin missing"
need_nbd_python
need_server

ORIGIN_SIZE=${E2E_CACHE_ORIGIN:-512M}
MODES=${E2E_CACHE_MODES:-write-through write-back}
PARTS=${E2E_CACHE_PARTS:-ext4 kill9 bad}
DELAY=${E2E_CACHE_DELAY:-2ms}
K9_ORIGIN=${E2E_CACHE_K9_ORIGIN:-128M}
K9_PHYS=${E2E_CACHE_K9_PHYS:-8M}
K9_ROUNDS=${E2E_CACHE_K9_ROUNDS:-3}
FUSE_DIR=$E2E_TMP/fuse
FS_DIR=$E2E_TMP/fs
ORIGIN_MNT=$E2E_TMP/origin-mnt
K9_CLIENT=$E2E_DIR/py/kill9_client.py
mkdir -p "$FUSE_DIR" "$FS_DIR" "$ORIGIN_MNT"

# --------------------------------------------------------------- sources ----

# SRCS: directories adding up to 150-200 MB (fewer if the machine has less).
pick_sources() {
    local d mb total=0
    SRCS=()
    if [[ -n "${E2E_CACHE_SRC:-}" ]]; then
        read -ra SRCS <<<"$E2E_CACHE_SRC"
        for d in "${SRCS[@]}"; do [[ -d "$d" ]] || fail "E2E_CACHE_SRC: $d is not a directory"; done
        return
    fi
    for d in /usr/lib/python3.[0-9]* /usr/share/doc /usr/share/man /usr/lib/gcc /usr/share/locale /usr/share/perl; do
        [[ -d "$d" ]] || continue
        mb=$(du -sm "$d" 2>/dev/null | cut -f1)
        ((mb >= 10 && total + mb <= 200)) || continue
        SRCS+=("$d")
        total=$((total + mb))
        ((total < 150)) || break
    done
    ((total >= 100)) || fail "found only $total MB of source trees under /usr; set E2E_CACHE_SRC"
}
pick_sources
SRC_MB=$(du -smc "${SRCS[@]}" | tail -n 1 | cut -f1)
# A third of the data: compressed 2-3:1, it still overflows the cache.
PHYS=${E2E_CACHE_PHYS:-$((SRC_MB / 3))M}

# diff_trees ROOT -- each source tree against its copy ROOT/tN
diff_trees() {
    local root=$1 i
    for i in "${!SRCS[@]}"; do
        diff -r --no-dereference "${SRCS[i]}" "$root/t$i" >"$E2E_TMP/diff.txt" 2>&1 || {
            head -n 20 "$E2E_TMP/diff.txt"
            return 1
        }
    done
}

# ---------------------------------------------------------------- origin ----

# start_origin FILE -- serve FILE through nbdkit's delay filter on a fresh
# unix socket; sets ORIGIN_PID, ORIGIN_SOCK, ORIGIN_URI.
start_origin() {
    local file=$1 n
    _E2E_SRV_SEQ=$((_E2E_SRV_SEQ + 1))
    n=$_E2E_SRV_SEQ
    ORIGIN_SOCK=$E2E_TMP/origin$n.sock
    nbdkit -f --exit-with-parent -P "$E2E_TMP/origin$n.pid" -U "$ORIGIN_SOCK" \
        --filter=delay file "$file" rdelay="$DELAY" wdelay="$DELAY" \
        >"$E2E_TMP/origin$n.out" 2>"$E2E_TMP/origin$n.log" &
    ORIGIN_PID=$!
    reg_pid "$ORIGIN_PID"
    local deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    until [[ -s "$E2E_TMP/origin$n.pid" ]]; do
        _alive "$ORIGIN_PID" || fail "nbdkit (origin) exited early: $(cat "$E2E_TMP/origin$n.log")"
        (($(date +%s) < deadline)) || fail "nbdkit (origin) not ready after ${E2E_READY_TIMEOUT}s"
        sleep 0.1
    done
    ORIGIN_URI="nbd+unix:///?socket=$ORIGIN_SOCK"
    log "origin: nbdkit pid $ORIGIN_PID (delay filter, $DELAY per request) serving ${file##*/} at $ORIGIN_URI"
}

stop_origin() {
    kill -TERM "$ORIGIN_PID" 2>/dev/null || true
    wait "$ORIGIN_PID" 2>/dev/null || true
    unreg_pid "$ORIGIN_PID"
    log "origin: nbdkit pid $ORIGIN_PID stopped"
}

# ------------------------------------------------------------------ stat ----

# cstat CACHE KEY... -- print stat --json values (cache.KEY for the nested
# `cache` object), one per line.
cstat() {
    local cache=$1
    shift
    cvol_stat_json "$cache" "$E2E_TMP/stat.json"
    "$PY" - "$E2E_TMP/stat.json" "$@" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for k in sys.argv[2:]:
    v = d
    for part in k.split("."):
        if not isinstance(v, dict) or part not in v:
            sys.exit("stat --json has no key %r" % k)
        v = v[part]
    print(v)
EOF
}

# expect_start CACHE WANT -- stat's cache.start of the served CACHE
expect_start() {
    local got
    got=$(cstat "$1" cache.start)
    [[ "$got" == "$2" ]] || fail "cache.start is '$got', expected '$2'"
    log "stat: cache.start = $got"
}

# ------------------------------------------------------- nbdfuse + loop ----

# attach [ro] -- nbdfuse the cache's export to $FUSE_DIR/nbd, a loop device
# on it; sets LOOP and FUSE_PID.
attach() {
    local ro=${1:-} fuse_args=() loop_args=() sz
    if [[ "$ro" == ro ]]; then
        fuse_args=(-r)
        loop_args=(-r)
    fi
    nbdfuse "${fuse_args[@]}" "$FUSE_DIR" "$SRV_URI" >"$E2E_TMP/nbdfuse.log" 2>&1 &
    FUSE_PID=$!
    reg_pid "$FUSE_PID"
    reg_fuse "$FUSE_DIR"
    wait_until 20 "nbdfuse to expose $FUSE_DIR/nbd" test -f "$FUSE_DIR/nbd"
    sz=$(stat -c %s "$FUSE_DIR/nbd")
    [[ $sz -eq $(to_bytes "$ORIGIN_SIZE") ]] ||
        fail "$FUSE_DIR/nbd has size $sz, expected the origin's $ORIGIN_SIZE"
    LOOP=$(losetup -f --show "${loop_args[@]}" "$FUSE_DIR/nbd") || fail "losetup on $FUSE_DIR/nbd failed"
    reg_loop "$LOOP"
    log "nbdfuse pid $FUSE_PID, loop device $LOOP${ro:+ (read-only)}"
}

detach() {
    local rc=0
    losetup -d "$LOOP" || fail "losetup -d $LOOP failed"
    unreg_loop "$LOOP"
    wait_until 20 "$LOOP to detach" bash -c "! losetup '$LOOP' >/dev/null 2>&1"
    fuse_unmount "$FUSE_DIR" || fail "unmounting FUSE $FUSE_DIR failed"
    unreg_fuse "$FUSE_DIR"
    wait_until 20 "nbdfuse to exit" bash -c "! kill -0 $FUSE_PID 2>/dev/null || grep -q '^State:.*Z' /proc/$FUSE_PID/status"
    wait "$FUSE_PID" || rc=$?
    unreg_pid "$FUSE_PID"
    ((rc == 0)) || fail "nbdfuse exited with status $rc: $(cat "$E2E_TMP/nbdfuse.log")"
}

# fsck_clean DEV WHAT
fsck_clean() {
    local rc=0
    e2fsck -fn "$1" >"$E2E_TMP/e2fsck.txt" 2>&1 || rc=$?
    if ((rc != 0)); then
        cat "$E2E_TMP/e2fsck.txt"
        fail "e2fsck -fn of $2 reported problems (exit $rc)"
    fi
    log "e2fsck -fn $2: $(tail -n 1 "$E2E_TMP/e2fsck.txt")"
}

# -------------------------------------------------------- ext4 per mode ----

ext4_round() {
    local mode=$1 origin=$E2E_TMP/origin-$1.img cache=$E2E_TMP/cache-$1.cvol
    local t0 i ev hits misses fill oread owritten dirty stored
    step "$mode: ext4 on a $PHYS cache of a $ORIGIN_SIZE origin ($DELAY per request)"
    truncate -s "$ORIGIN_SIZE" "$origin"
    start_origin "$origin"
    "$CVOL" create "$cache" --origin "$ORIGIN_URI" --physical-size "$PHYS" --cache-mode "$mode" \
        >"$E2E_TMP/create.log" 2>&1 || fail "cvol create --origin: $(cat "$E2E_TMP/create.log")"
    start_server "$cache"
    [[ $(cstat "$cache" cache.mode) == "$mode" ]] || fail "stat: cache.mode is not $mode"
    [[ $(cstat "$cache" cache.origin) == "$ORIGIN_URI" ]] || fail "stat: cache.origin is not $ORIGIN_URI"
    [[ $(cstat "$cache" logical_size_bytes) -eq $(to_bytes "$ORIGIN_SIZE") ]] ||
        fail "the cache's logical size is not the origin's"

    attach
    t0=$(date +%s)
    mkfs.ext4 -q -F "$LOOP" || fail "mkfs.ext4 $LOOP failed"
    log "mkfs.ext4 (with discard) took $(($(date +%s) - t0))s"
    mount -t ext4 "$LOOP" "$FS_DIR" || fail "mount $LOOP failed"
    reg_mount "$FS_DIR"
    t0=$(date +%s)
    for i in "${!SRCS[@]}"; do
        cp -a "${SRCS[i]}" "$FS_DIR/t$i" || fail "cp -a ${SRCS[i]} failed"
    done
    sync -f "$FS_DIR"
    log "copied ${SRCS[*]} ($SRC_MB MB) in $(($(date +%s) - t0))s (with sync)"
    umount "$FS_DIR" || fail "umount $FS_DIR failed"
    unreg_mount "$FS_DIR"
    blockdev --flushbufs "$LOOP" 2>/dev/null || true
    detach
    read -r ev oread owritten dirty stored < <(cstat "$cache" cache_evictions origin_bytes_read \
        origin_bytes_written cache_dirty_bytes stored_bytes | paste -sd' ')
    log "after the copy: cache_evictions $ev, origin_bytes_read $oread, origin_bytes_written $owritten, cache_dirty_bytes $dirty, stored_bytes $stored"
    ((ev > 0)) || fail "no line was evicted while copying $SRC_MB MB into a $PHYS cache (set a smaller E2E_CACHE_PHYS)"
    if [[ $mode == write-through ]]; then
        ((owritten >= SRC_MB * 1024 * 1024)) ||
            fail "write-through: only $owritten bytes reached the origin for a $SRC_MB MB copy"
    fi
    t0=$(date +%s)
    stop_server
    log "clean stop took $(($(date +%s) - t0))s"

    step "$mode: restart warm; e2fsck and diff -r through the cache"
    start_server "$cache"
    expect_start "$cache" warm
    attach ro
    fsck_clean "$LOOP" "the file system through the cache"
    mount -t ext4 -o ro "$LOOP" "$FS_DIR" || fail "read-only mount after restart failed"
    reg_mount "$FS_DIR"
    t0=$(date +%s)
    diff_trees "$FS_DIR" || fail "$mode: the trees read back through the cache differ from the sources"
    log "diff -r: identical ($(($(date +%s) - t0))s)"
    umount "$FS_DIR" || fail "umount $FS_DIR failed"
    unreg_mount "$FS_DIR"
    detach
    read -r hits misses ev fill oread < <(cstat "$cache" cache_hits cache_misses cache_evictions \
        cache_fill_bytes origin_bytes_read | paste -sd' ')
    log "after reading back: cache_hits $hits, cache_misses $misses, cache_evictions $ev, cache_fill_bytes $fill, origin_bytes_read $oread"
    ((hits > 0)) || fail "no cache hit while reading back after a warm restart"
    ((ev > 0)) || fail "no eviction while reading $SRC_MB MB back through a $PHYS cache"
    stop_server
    cvol_check "$cache"

    step "$mode: the origin alone holds the file system"
    # The cache is stopped; nbdkit has the file open but nobody writes it.
    fsck_clean "$origin" "origin.img (no cache)"
    LOOP=$(losetup -f --show -r "$origin") || fail "losetup -r $origin failed"
    reg_loop "$LOOP"
    mount -t ext4 -o ro,noload "$LOOP" "$ORIGIN_MNT" || fail "read-only mount of the origin failed"
    reg_mount "$ORIGIN_MNT"
    diff_trees "$ORIGIN_MNT" || fail "$mode: the origin alone does not hold the trees after a clean stop"
    log "origin alone: diff -r identical"
    umount "$ORIGIN_MNT" || fail "umount $ORIGIN_MNT failed"
    unreg_mount "$ORIGIN_MNT"
    losetup -d "$LOOP" || fail "losetup -d $LOOP failed"
    unreg_loop "$LOOP"
    stop_origin
    rm -f "$origin" "$cache"
}

# ------------------------------------------------------ kill -9 per mode ----

kill9_mode() {
    local mode=$1 origin=$E2E_TMP/k9origin-$1.img cache=$E2E_TMP/k9cache-$1.cvol
    local base=$E2E_TMP/k9base-$1 round journal writer rc want delay
    step "$mode: kill -9 the cache server under flushed writes, $K9_ROUNDS rounds ($K9_PHYS cache of a $K9_ORIGIN origin)"
    truncate -s "$K9_ORIGIN" "$origin"
    start_origin "$origin"
    "$CVOL" create "$cache" --origin "$ORIGIN_URI" --physical-size "$K9_PHYS" --cache-mode "$mode" \
        >"$E2E_TMP/create.log" 2>&1 || fail "cvol create --origin: $(cat "$E2E_TMP/create.log")"
    want=cold
    [[ $mode == write-back ]] && want=recovered
    rm -f "$base" # the previous round's verified image (none: zeroes)
    for round in $(seq "$K9_ROUNDS"); do
        journal=$E2E_TMP/journal-$mode-$round
        : >"$journal"
        start_server "$cache"
        ((round == 1)) || expect_start "$cache" warm
        K9_SEED=$((K9_SEED + 1))
        "$NBD_PY" "$K9_CLIENT" write "$SRV_URI" "$journal" "$K9_SEED" 60 \
            >"$E2E_TMP/writer-$mode-$round.log" 2>&1 &
        writer=$!
        reg_pid "$writer"
        wait_until 30 "the writer's first flush" grep -q '^F ' "$journal"
        delay=$(awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 2 + 3 * r / 32767 }')
        sleep "$delay"
        _alive "$writer" || fail "writer exited before the kill: $(cat "$E2E_TMP/writer-$mode-$round.log")"
        log "round $round: kill after ${delay}s; cache_evictions $(cstat "$cache" cache_evictions), cache_dirty_bytes $(cstat "$cache" cache_dirty_bytes)"
        kill9_server
        wait_until 30 "the writer to exit after the kill" bash -c "! kill -0 $writer 2>/dev/null || grep -q '^State:.*Z' /proc/$writer/status"
        rc=0
        wait "$writer" || rc=$?
        unreg_pid "$writer"
        cat "$E2E_TMP/writer-$mode-$round.log"
        ((rc == 0)) || fail "writer exited with status $rc"

        if [[ $mode == write-through ]]; then
            # Write-through: every write reached the origin before its reply,
            # and a FLUSH synced it: the origin alone holds every flushed write.
            rc=0
            "$NBD_PY" "$K9_CLIENT" verify "$ORIGIN_URI" "$journal" "$base" "$E2E_TMP/origin-view" || rc=$?
            ((rc == 0)) || fail "write-through: the origin alone lacks writes acknowledged by a flush"
            log "round $round: the origin alone holds every flushed write"
        fi
        start_server "$cache"
        expect_start "$cache" "$want"
        rc=0
        "$NBD_PY" "$K9_CLIENT" verify "$SRV_URI" "$journal" "$base" "$base.new" || rc=$?
        ((rc == 0)) || fail "$mode: writes acknowledged by a flush did not survive kill -9 of the cache server"
        mv "$base.new" "$base"
        stop_server
        # A clean stop: the origin alone holds exactly what the cache served.
        cmp "$origin" "$base" || fail "$mode: after a clean stop the origin differs from what the cache served"
        log "round $round: after a clean stop the origin alone is identical to what the cache served"
        cvol_check "$cache"
    done
    stop_origin
    rm -f "$origin" "$cache" "$base" "$E2E_TMP/origin-view"
}

# ------------------------------------------------------------ bad input ----

# refused WHAT NEEDLE CMD... -- CMD exits 2 and its stderr names NEEDLE.
refused() {
    local what=$1 needle=$2 rc=0
    shift 2
    "$@" >"$E2E_TMP/refused.out" 2>"$E2E_TMP/refused.err" || rc=$?
    ((rc == 2)) || fail "$what: exit $rc (expected 2); stderr: $(cat "$E2E_TMP/refused.err")"
    grep -qF -- "$needle" "$E2E_TMP/refused.err" ||
        fail "$what: the message does not name '$needle': $(cat "$E2E_TMP/refused.err")"
    log "refused ($what): $(head -n 1 "$E2E_TMP/refused.err")"
}

# dir_state DIR -- every entry with type, size and cksum (files)
dir_state() {
    (cd "$1" && find . -mindepth 1 -printf '%y %s %p\n' | sort &&
        find . -type f -print0 | sort -z | xargs -0 -r cksum)
}

bad_input() {
    local d=$E2E_TMP/bad origin cache before
    step "bad input: a cache whose origin is gone; create refusals"
    mkdir -p "$d"
    origin=$d/origin.img
    cache=$d/cache.cvol
    truncate -s 64M "$origin"
    start_origin "$origin"
    "$CVOL" create "$cache" --origin "$ORIGIN_URI" --physical-size 16M --cache-mode write-back \
        >/dev/null 2>&1 || fail "cvol create --origin $ORIGIN_URI failed"
    start_server "$cache"
    qemu-io -f raw -c "write -P 0x61 0 1M" -c flush "$SRV_URI" >/dev/null || fail "qemu-io write"
    stop_server
    stop_origin
    rm -f "$ORIGIN_SOCK" # gone (a crashed origin leaves it stale: below)
    before=$(cksum <"$cache")
    refused "serve, origin socket missing" "$ORIGIN_URI" \
        "$CVOL" serve "$cache" --socket "$d/srv.sock"
    [[ ! -e "$d/srv.sock" ]] || fail "serve left its socket behind after refusing"
    "$PY" -c 'import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$ORIGIN_SOCK"
    refused "serve, origin socket stale" "$ORIGIN_URI" \
        "$CVOL" serve "$cache" --socket "$d/srv.sock"
    [[ $(cksum <"$cache") == "$before" ]] || fail "a refused serve changed the cache file"
    rm -f "$ORIGIN_SOCK"
    [[ $(cstat "$cache" cache.start) == offline ]] || fail "offline stat of the cache failed"

    before=$(dir_state "$d")
    refused "create, origin missing" "$d/missing.img" \
        "$CVOL" create "$d/c1.cvol" --origin "$d/missing.img" --physical-size 16M
    # (c2.cvol does not exist yet: refused as a missing origin)
    refused "create, origin is the (new) cache itself" "$d/c2.cvol" \
        "$CVOL" create "$d/c2.cvol" --origin "$d/c2.cvol" --physical-size 16M
    [[ $(dir_state "$d") == "$before" ]] || fail "a refused create left a file behind"
    truncate -s 64M "$d/self.img"
    before=$(dir_state "$d")
    refused "create --force, origin is the cache itself" "cache itself" \
        "$CVOL" create "$d/self.img" --origin "$d/self.img" --physical-size 16M --force
    refused "create --force, origin is the cache itself by another path" "cache itself" \
        "$CVOL" create "$d/self.img" --origin "$d/./self.img" --physical-size 16M --force
    refused "create --size with --origin" "--size" \
        "$CVOL" create "$d/c3.cvol" --origin "$origin" --size 64M --physical-size 16M
    refused "create --cache-mode bogus" "bogus" \
        "$CVOL" create "$d/c4.cvol" --origin "$origin" --physical-size 16M --cache-mode bogus
    refused "create, origin URI with no server" "$d/none.sock" \
        "$CVOL" create "$d/c5.cvol" --origin "nbd+unix:///?socket=$d/none.sock" --physical-size 16M
    [[ $(dir_state "$d") == "$before" ]] || {
        diff <(echo "$before") <(dir_state "$d") || true
        fail "a refused create left a file behind or changed one"
    }
}

log "sources: ${SRCS[*]} ($SRC_MB MB); modes: $MODES; parts: $PARTS"
for part in $PARTS; do
    case $part in
        ext4) for mode in $MODES; do ext4_round "$mode"; done ;;
        kill9)
            K9_SEED=0
            for mode in $MODES; do kill9_mode "$mode"; done
            ;;
        bad) bad_input ;;
        *) fail "E2E_CACHE_PARTS: unknown part '$part' (ext4 kill9 bad)" ;;
    esac
done
pass "modes: $MODES; $SRC_MB MB of trees through a $PHYS cache, kill -9 rounds, bad input"
