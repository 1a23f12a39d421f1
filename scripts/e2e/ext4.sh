#!/usr/bin/env bash
# ext4 on top of the export: nbdfuse -> loop device -> mkfs.ext4 -> mount ->
# copy a directory tree -> unmount everything -> restart the server ->
# reattach read-only -> e2fsck -fn clean -> diff -r identical.
#
#   E2E_EXT4_SRC   directory tree to copy (default: a 30-150 MB tree such as
#                  /usr/lib/python3.X or /usr/share/doc)
#   E2E_EXT4_SIZE  volume size (default 384M)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need_root
need nbdfuse losetup mkfs.ext4 e2fsck mount umount mountpoint diff
[[ -e /dev/fuse ]] || skip "/dev/fuse missing"
need_server

SIZE=${E2E_EXT4_SIZE:-384M}
VOL=$E2E_TMP/vol.cvol
FUSE_DIR=$E2E_TMP/fuse
FS_DIR=$E2E_TMP/fs
mkdir -p "$FUSE_DIR" "$FS_DIR"

pick_source() {
    local d mb
    if [[ -n "${E2E_EXT4_SRC:-}" ]]; then
        [[ -d "$E2E_EXT4_SRC" ]] || fail "E2E_EXT4_SRC=$E2E_EXT4_SRC is not a directory"
        echo "$E2E_EXT4_SRC"
        return
    fi
    for d in /usr/lib/python3.[0-9]* /usr/share/doc /usr/share/man /usr/lib/gcc /usr/share/locale; do
        [[ -d "$d" ]] || continue
        mb=$(du -sm "$d" 2>/dev/null | cut -f1)
        if ((mb >= 30 && mb <= 150)); then
            echo "$d"
            return
        fi
    done
    fail "no suitable 30-150 MB source tree found; set E2E_EXT4_SRC"
}
SRC=$(pick_source)
SRC_MB=$(du -sm "$SRC" | cut -f1)

# attach [ro] -- nbdfuse the export to $FUSE_DIR/nbd and put a loop device on
# it; sets LOOP and FUSE_PID.
attach() {
    local ro=${1:-} fuse_args=() loop_args=()
    if [[ "$ro" == ro ]]; then
        fuse_args=(-r)
        loop_args=(-r)
    fi
    nbdfuse "${fuse_args[@]}" "$FUSE_DIR" "$SRV_URI" >"$E2E_TMP/nbdfuse.log" 2>&1 &
    FUSE_PID=$!
    reg_pid "$FUSE_PID"
    reg_fuse "$FUSE_DIR"
    wait_until 20 "nbdfuse to expose $FUSE_DIR/nbd" test -f "$FUSE_DIR/nbd"
    local sz
    sz=$(stat -c %s "$FUSE_DIR/nbd")
    [[ $sz -eq $(to_bytes "$SIZE") ]] || fail "$FUSE_DIR/nbd has size $sz, expected $SIZE"
    LOOP=$(losetup -f --show "${loop_args[@]}" "$FUSE_DIR/nbd") || fail "losetup on $FUSE_DIR/nbd failed"
    reg_loop "$LOOP"
    log "nbdfuse pid $FUSE_PID, loop device $LOOP${ro:+ (read-only)}"
}

detach() {
    losetup -d "$LOOP" || fail "losetup -d $LOOP failed"
    unreg_loop "$LOOP"
    # losetup -d is asynchronous; wait for the device to be released
    wait_until 20 "$LOOP to detach" bash -c "! losetup '$LOOP' >/dev/null 2>&1"
    fuse_unmount "$FUSE_DIR" || fail "unmounting FUSE $FUSE_DIR failed"
    unreg_fuse "$FUSE_DIR"
    local rc=0
    wait_until 20 "nbdfuse to exit" bash -c "! kill -0 $FUSE_PID 2>/dev/null || grep -q '^State:.*Z' /proc/$FUSE_PID/status"
    wait "$FUSE_PID" || rc=$?
    unreg_pid "$FUSE_PID"
    ((rc == 0)) || fail "nbdfuse exited with status $rc: $(cat "$E2E_TMP/nbdfuse.log")"
}

make_volume "$VOL" "$SIZE"
start_server "$VOL"

step "nbdfuse + loop + mkfs.ext4"
attach
mkfs.ext4 -q -F "$LOOP" || fail "mkfs.ext4 $LOOP failed"
mount -t ext4 "$LOOP" "$FS_DIR" || fail "mount $LOOP failed"
reg_mount "$FS_DIR"

step "copy $SRC ($SRC_MB MB) into the filesystem"
t0=$(date +%s)
cp -a "$SRC" "$FS_DIR/tree" || fail "cp -a $SRC failed"
sync -f "$FS_DIR/tree"
log "copy+sync took $(($(date +%s) - t0))s"
diff -r --no-dereference "$SRC" "$FS_DIR/tree" >/dev/null || fail "tree differs right after copying"
# discard freed space too (exercises trim through loop + nbdfuse)
if fstrim "$FS_DIR" 2>/dev/null; then log "fstrim ok"; else log "fstrim not supported here (ignored)"; fi
umount "$FS_DIR" || fail "umount $FS_DIR failed"
unreg_mount "$FS_DIR"
sync
blockdev --flushbufs "$LOOP" 2>/dev/null || true
detach

step "restart the server, reattach read-only, e2fsck -fn, diff -r"
stop_server
start_server "$VOL"
attach ro
rc=0
e2fsck -fn "$LOOP" >"$E2E_TMP/e2fsck.txt" 2>&1 || rc=$?
if ((rc != 0)); then
    cat "$E2E_TMP/e2fsck.txt"
    fail "e2fsck -fn $LOOP reported problems (exit $rc)"
fi
tail -n 1 "$E2E_TMP/e2fsck.txt"
mount -t ext4 -o ro "$LOOP" "$FS_DIR" || fail "read-only mount after restart failed"
reg_mount "$FS_DIR"
diff -r --no-dereference "$SRC" "$FS_DIR/tree" >"$E2E_TMP/diff.txt" 2>&1 || {
    head -n 20 "$E2E_TMP/diff.txt"
    fail "diff -r $SRC vs filesystem copy after restart: differences found"
}
log "tree identical after restart"
if [[ -n ${E2E_EXPECT_MAP_MISSES:-} ]] && is_cvol; then
    cvol_stat_json "$VOL" "$E2E_TMP/stat.json"
    misses=$(json_get "$E2E_TMP/stat.json" map_cache_misses)
    ((misses > 0)) || fail "no map page was read back (map_cache_misses 0): paging was not tested"
    log "map pages read back from the volume since the restart: $misses"
fi
umount "$FS_DIR" || fail "umount $FS_DIR failed"
unreg_mount "$FS_DIR"
detach
stop_server
cvol_check "$VOL"
pass "$SRC_MB MB tree from $SRC"
