# shellcheck shell=bash
# Helpers of the pool e2e tests (pools.sh, snapshots.sh): ext4 on cvol
# exports through nbdfuse and a loop device, the pool's statistics, the
# wait for idle cleaning. Source it after lib.sh; it uses lib.sh's
# reg_*/unreg_* cleanup registry, wait_until, fuse_unmount, json_get,
# cvol_stat_json and fail, and $E2E_TMP, $CVOL.

# timed PART ARGS... -- runs PART ARGS..., its seconds in TOOK[PART]
declare -A TOOK
timed() {
    local t0
    t0=$(date +%s)
    "$@"
    TOOK[$1]=$(($(date +%s) - t0))
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
du_b() { du -B1 "$1" | cut -f1; }
# stat_key POOL KEY [VOLUME]
stat_key() {
    local out=$E2E_TMP/stat.json
    if [[ -n ${3:-} ]]; then
        "$CVOL" stat "$1" --volume "$3" --json >"$out" || fail "cvol stat $1 --volume $3 --json failed"
    else
        cvol_stat_json "$1" "$out"
    fi
    json_get "$out" "$2"
}
# settle POOL -- wait (at most 90 s) for the idle cleaner: until two polls
# 5 s apart see the same physical_used_bytes; sets SETTLE_S
settle() {
    local t0 last=-1 pu f=$E2E_TMP/stat.json
    t0=$(date +%s)
    while :; do
        sleep 5
        pu=$(stat_key "$1" physical_used_bytes)
        log "  idle: physical_used $(mib "$pu"), dead $(mib "$(json_get "$f" dead_bytes)")" \
            "(reclaimable $(mib "$(json_get "$f" reclaimable_bytes)")), live $(mib "$(json_get "$f" live_bytes)")," \
            "idle cleaning passes $(json_get "$f" idle_clean_passes), du $(mib "$(du_b "$1")")"
        ((pu != last)) || break
        last=$pu
        (($(date +%s) - t0 < 90)) || fail "physical_used_bytes still changing after 90 s ($(mib "$pu"))"
    done
    SETTLE_S=$(($(date +%s) - t0))
}

declare -a LOOPS FPIDS
# fuse_attach I URI BYTES [ro] -- nbdfuse of URI on $E2E_TMP/fuseI, a loop
# device on it in LOOPS[I] (read-only with ro); the export must be BYTES
fuse_attach() {
    local i=$1 u=$2 bytes=$3 ro=${4:-} dir=$E2E_TMP/fuse$1 sz
    mkdir -p "$dir"
    nbdfuse ${ro:+-r} "$dir" "$u" >"$E2E_TMP/nbdfuse$i.log" 2>&1 &
    FPIDS[i]=$!
    reg_pid "${FPIDS[i]}"
    reg_fuse "$dir"
    wait_until 20 "nbdfuse to expose $dir/nbd" test -f "$dir/nbd"
    sz=$(stat -c %s "$dir/nbd")
    ((sz == bytes)) || fail "export $u through nbdfuse has size $sz, expected $bytes"
    LOOPS[i]=$(losetup -f --show ${ro:+-r} "$dir/nbd") || fail "losetup on $dir/nbd failed"
    reg_loop "${LOOPS[i]}"
}
# detach I [dead] -- loop device and nbdfuse away (dead: the server was
# killed, so nbdfuse's exit status and a failing FUSE unmount are expected)
detach() {
    local i=$1 dead=${2:-} dir=$E2E_TMP/fuse$1 loop=${LOOPS[$1]} pid=${FPIDS[$1]} rc=0
    losetup -d "$loop" || fail "losetup -d $loop failed"
    unreg_loop "$loop"
    wait_until 20 "$loop to detach" bash -c "! losetup '$loop' >/dev/null 2>&1"
    fuse_unmount "$dir" 2>/dev/null || [[ -n $dead ]] || fail "unmounting FUSE $dir failed"
    if [[ -n $dead ]] && mountpoint -q "$dir"; then umount -l "$dir" || true; fi
    unreg_fuse "$dir"
    wait_until 20 "nbdfuse to exit" bash -c "! kill -0 $pid 2>/dev/null || grep -q '^State:.*Z' /proc/$pid/status"
    wait "$pid" || rc=$?
    unreg_pid "$pid"
    ((rc == 0)) || [[ -n $dead ]] || fail "nbdfuse exited with status $rc: $(cat "$E2E_TMP/nbdfuse$i.log")"
}
# mount_fs I [mount options]
mount_fs() {
    mkdir -p "$E2E_TMP/fs$1"
    mount -t ext4 ${2:+-o "$2"} "${LOOPS[$1]}" "$E2E_TMP/fs$1" || fail "mount ${LOOPS[$1]} (fs$1${2:+, -o $2}) failed"
    reg_mount "$E2E_TMP/fs$1"
}
umount_fs() {
    umount "$E2E_TMP/fs$1" || fail "umount fs$1 failed"
    unreg_mount "$E2E_TMP/fs$1"
}
# fsck_clean I WHAT
fsck_clean() {
    local rc=0
    e2fsck -fn "${LOOPS[$1]}" >"$E2E_TMP/e2fsck$1.txt" 2>&1 || rc=$?
    if ((rc != 0)); then
        cat "$E2E_TMP/e2fsck$1.txt"
        fail "e2fsck -fn of fs$1 ($2) reported problems (exit $rc)"
    fi
}
# same_tree SRC DST WHAT
same_tree() {
    diff -r --no-dereference "$1" "$2" >"$E2E_TMP/diff.txt" 2>&1 || {
        head -n 20 "$E2E_TMP/diff.txt"
        fail "$3: diff -r $1 vs $2: differences found"
    }
}
# pick_trees N VAR -- N real directory trees of 15-60 MB into SRCS (or the
# space-separated list in the environment variable VAR); at least 2 found
# are repeated to make N
pick_trees() {
    local n=$1 var=$2 d mb
    if [[ -n ${!var:-} ]]; then
        read -ra SRCS <<<"${!var}"
        ((${#SRCS[@]} >= n)) || fail "$var: $n directories needed"
        return
    fi
    SRCS=()
    for d in /usr/share/vim /usr/lib/python3.[0-9]* /usr/lib/x86_64-linux-gnu/perl /usr/share/perl \
        /usr/lib/git-core /usr/share/i18n /usr/share/man /usr/share/doc /usr/lib/gcc \
        /usr/share/locale /usr/include /usr/sbin; do
        [[ -d "$d" ]] || continue
        mb=$(du -sm "$d" 2>/dev/null | cut -f1)
        if ((mb >= 15 && mb <= 60)); then SRCS+=("$d"); fi
        ((${#SRCS[@]} < n)) || return 0
    done
    ((${#SRCS[@]} >= 2)) || fail "fewer than 2 source trees of 15-60 MB found; set $var"
    while ((${#SRCS[@]} < n)); do SRCS+=("${SRCS[${#SRCS[@]} - 2]}"); done
}
