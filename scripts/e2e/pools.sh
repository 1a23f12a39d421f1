#!/usr/bin/env bash
# Pools: many volumes in one store, served by NBD export name.
#
#   list    a pool (1 GiB `default`) gets volumes a and b offline; served, the
#           NBD export list (NBD_OPT_LIST, `nbdinfo --list`) holds exactly
#           default, a and b with their sizes; an unknown export name is
#           refused; a volume created while served is served at once
#   ext4    three volumes, each with its own ext4 (nbdfuse + loop), real trees
#           copied into all three at the same time: e2fsck -fn and diff -r;
#           then kill -9 of the server during a second round of concurrent
#           writes: after a restart every tree synced before the kill is
#           intact and each file system checks clean
#   dedup   ten volumes of a second pool each get the same real image: the
#           pool stores about one copy; `stat --volume` counts it shared; then
#           nine volumes get unique data and are deleted: the idle cleaner
#           gives their space back (`du` falls) and the tenth reads back exact
#   resize  a volume grown while served: a new connection sees the new size,
#           resize2fs grows ext4 into it online; a shrink below the data is
#           refused (nothing changed), `--discard` shrinks it
#   physical  `cvol resize --physical-size` on a served pool: a pool of
#           96 MiB holding 64 MiB of random data, its file made 400 MiB,
#           grows to 400 MiB while a client writes (`cvol stat --json`
#           shows it), then takes 184 MiB more, all read back exact; a
#           shrink below the data is refused served and offline (exit 2,
#           nothing changed); an empty pool shrinks served, then offline,
#           cutting its file; `cvol check`
#   errors  refused `volume` commands, offline and served: an existing name,
#           '/' or '@' in a name, sizes 0 and 4095, an unknown name, deleting a
#           volume a client holds open (refused unless --force): exit 2, a
#           message naming the problem, `volume list` unchanged
#   check   `cvol check` of both pools
#
#   E2E_POOLS_PARTS  parts to run (default: "list ext4 dedup resize physical errors check")
#   E2E_POOLS_SRCS   six directory trees for the ext4 part (default: picked,
#                    15-60 MB each)
#   E2E_POOLS_MB     image size of the dedup part in MiB (default 64)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=pool-lib.sh
. "$E2E_DIR/pool-lib.sh"

need_root
need nbdinfo nbdcopy nbdfuse losetup mkfs.ext4 e2fsck resize2fs mount umount mountpoint diff tar
[[ -e /dev/fuse ]] || skip "/dev/fuse missing"
need_nbd_python
need_server
is_cvol || skip "cvol only: pools have no stand-in"

PARTS=${E2E_POOLS_PARTS:-list ext4 dedup resize physical errors check}
MB=${E2E_POOLS_MB:-64}
POOL=$E2E_TMP/pool.cvol  # list, ext4, resize, errors
DPOOL=$E2E_TMP/dedup.cvol # dedup
PPOOL=$E2E_TMP/phys.cvol  # physical
GIB=$((1 << 30))
MIB=$((1 << 20))

for p in $PARTS; do
    case $p in
        list | ext4 | dedup | resize | physical | errors | check) ;;
        *) fail "E2E_POOLS_PARTS: unknown part '$p' (known: list ext4 dedup resize physical errors check)" ;;
    esac
done
wants() { [[ " $PARTS " == *" $1 "* ]]; }

# uri NAME -- the export NAME of the current server
uri() { echo "nbd+unix:///$1?socket=$SRV_SOCK"; }
vsize() { nbdinfo --size "$(uri "$1")" || fail "nbdinfo --size of export '$1' failed"; }

# list_json POOL OUT -- `cvol volume list POOL --json` into OUT
list_json() { "$CVOL" volume list "$1" --json >"$2" || fail "cvol volume list $1 --json failed"; }
# names_sizes POOL -- "name:size ..." sorted by name
names_sizes() {
    list_json "$1" "$E2E_TMP/list.json"
    "$PY" -c 'import json,sys
v = json.load(open(sys.argv[1]))["volumes"]
print(" ".join("%s:%d" % (x["name"], x["size_bytes"]) for x in sorted(v, key=lambda x: x["name"])))' \
        "$E2E_TMP/list.json"
}

# vol CMD POOL NAME ARGS... -- `cvol volume CMD`, which must succeed
vol() {
    local cmd=$1 pool=$2
    shift 2
    "$CVOL" volume "$cmd" "$pool" "$@" >"$E2E_TMP/vol.out" 2>&1 ||
        fail "cvol volume $cmd ${pool##*/} $* failed: $(cat "$E2E_TMP/vol.out")"
}

# ------------------------------------------------------- nbdfuse + loop ----

# attach I NAME BYTES -- nbdfuse + loop of export NAME (pool-lib.sh)
attach() { fuse_attach "$1" "$(uri "$2")" "$3"; }

T_START=$(date +%s)

"$CVOL" create "$POOL" --size 1G --physical-size 3G >/dev/null 2>&1 || fail "cvol create $POOL failed"

# -------------------------------------------------------------- list ----

part_list() {
    step "list: volumes a and b created offline, served with default under their names"
    vol create "$POOL" a --size 512M
    vol create "$POOL" b --size 512M
    local want="a:$((GIB / 2)) b:$((GIB / 2)) default:$GIB" got
    got=$(names_sizes "$POOL")
    [[ $got == "$want" ]] || fail "volume list: '$got', expected '$want'"
    start_server "$POOL"
    nbdinfo --list --json "nbd+unix://?socket=$SRV_SOCK" >"$E2E_TMP/exports.json" ||
        fail "nbdinfo --list failed"
    got=$("$PY" -c 'import json,sys
e = json.load(open(sys.argv[1]))["exports"]
print(" ".join("%s:%d" % (x["export-name"], x["export-size"]) for x in sorted(e, key=lambda x: x["export-name"])))' \
        "$E2E_TMP/exports.json")
    [[ $got == "$want" ]] || fail "nbdinfo --list: '$got', expected exactly '$want'"
    log "nbdinfo --list: $got"
    (($(vsize "") == GIB)) || fail "the empty export name is not the 1 GiB default volume"

    step "list: an unknown export name is refused"
    local rc=0
    nbdinfo --size "$(uri nosuch)" >"$E2E_TMP/nosuch.out" 2>&1 || rc=$?
    ((rc != 0)) || fail "nbdinfo of the unknown export 'nosuch' succeeded: $(cat "$E2E_TMP/nosuch.out")"
    grep -q "nosuch" "$E2E_TMP/nosuch.out" || fail "refusal does not name the export: $(cat "$E2E_TMP/nosuch.out")"
    log "refused: $(tail -n 1 "$E2E_TMP/nosuch.out")"

    step "list: volume c created while served is served at once"
    vol create "$POOL" c --size 384M
    (($(vsize c) == 384 * MIB)) || fail "export c has size $(vsize c), expected 384 MiB"
    nbdinfo --list --json "nbd+unix://?socket=$SRV_SOCK" >"$E2E_TMP/exports.json"
    grep -q '"export-name": "c"' "$E2E_TMP/exports.json" || fail "nbdinfo --list does not show c"
    stop_server
    want="a:$((GIB / 2)) b:$((GIB / 2)) c:$((384 * MIB)) default:$GIB"
    got=$(names_sizes "$POOL")
    [[ $got == "$want" ]] || fail "after a restart, volume list: '$got', expected '$want'"
}

# -------------------------------------------------------------- ext4 ----

pick_sources() { pick_trees 6 E2E_POOLS_SRCS; }

# writer I -- round two: copy trees into fs I, `sync -f` after each; a line
# "synced N" once copy N is durable. Stops at the first error.
writer() {
    local i=$1 n src
    for n in 1 2 3 4 5 6; do
        src=${SRCS[3 + (i + n) % 3]}
        cp -a "$src" "$E2E_TMP/fs$i/r2-$n" || exit 0
        sync -f "$E2E_TMP/fs$i" || exit 0
        echo "synced $n $src" >>"$E2E_TMP/writer$i.log"
    done
}

part_ext4() {
    local i pids=() t0 rc
    pick_sources
    local fs_bytes=$((320 * MIB))
    step "ext4: three volumes, an ext4 each, ${SRCS[*]:0:3} copied at the same time"
    for i in 0 1 2; do vol create "$POOL" "e$i" --size 320M; done
    start_server "$POOL"
    for i in 0 1 2; do
        attach "$i" "e$i" "$fs_bytes"
        mkfs.ext4 -q -F "${LOOPS[i]}" || fail "mkfs.ext4 on e$i failed"
        mount_fs "$i"
    done
    t0=$(date +%s)
    for i in 0 1 2; do
        (cp -a "${SRCS[i]}" "$E2E_TMP/fs$i/tree" && sync -f "$E2E_TMP/fs$i") &
        pids+=($!)
    done
    for i in 0 1 2; do wait "${pids[i]}" || fail "copying ${SRCS[i]} into e$i failed"; done
    log "three concurrent copies + sync: $(($(date +%s) - t0)) s"
    for i in 0 1 2; do
        umount_fs "$i"
        fsck_clean "$i" "after the concurrent copies"
        mount_fs "$i"
        same_tree "${SRCS[i]}" "$E2E_TMP/fs$i/tree" "e$i after umount + fsck"
    done
    log "e2fsck -fn clean and diff -r identical on e0, e1, e2"

    step "ext4: a second round of concurrent writes, kill -9 of the server in the middle"
    sync
    pids=()
    for i in 0 1 2; do
        : >"$E2E_TMP/writer$i.log"
        writer "$i" &
        pids+=($!)
        reg_pid "${pids[i]}"
    done
    wait_until 60 "a copy of round two to be synced" grep -q synced "$E2E_TMP/writer0.log" "$E2E_TMP/writer1.log" "$E2E_TMP/writer2.log"
    sleep 1
    local alive=0
    for i in 0 1 2; do if _alive "${pids[i]}"; then alive=$((alive + 1)); fi; done
    ((alive > 0)) || fail "every writer finished before the kill: nothing was in flight"
    kill9_server
    log "killed with $alive of 3 writers still writing"
    for i in 0 1 2; do
        wait_until 60 "writer $i to stop after the kill" bash -c "! kill -0 ${pids[i]} 2>/dev/null || grep -q '^State:.*Z' /proc/${pids[i]}/status"
        wait "${pids[i]}" || true
        unreg_pid "${pids[i]}"
    done
    for i in 0 1 2; do
        umount "$E2E_TMP/fs$i" 2>/dev/null || umount -l "$E2E_TMP/fs$i" || fail "cannot unmount fs$i after the kill"
        unreg_mount "$E2E_TMP/fs$i"
        detach "$i" dead
    done

    step "ext4: restart; the journal replays, synced trees intact, e2fsck -fn clean"
    start_server "$POOL"
    local synced=0
    for i in 0 1 2; do
        attach "$i" "e$i" "$fs_bytes"
        mount_fs "$i" # replays the journal
        same_tree "${SRCS[i]}" "$E2E_TMP/fs$i/tree" "e$i after kill -9"
        while read -r _ n src; do
            same_tree "$src" "$E2E_TMP/fs$i/r2-$n" "e$i after kill -9 (round-two copy $n, synced)"
            synced=$((synced + 1))
        done <"$E2E_TMP/writer$i.log"
        umount_fs "$i"
        fsck_clean "$i" "after kill -9 and journal replay"
        detach "$i"
    done
    log "after kill -9: round one and $synced synced round-two copies identical, 3 file systems clean"
    stop_server
    rc=0
    "$CVOL" check "$POOL" >"$E2E_TMP/check.log" 2>&1 || rc=$?
    ((rc == 0)) || { cat "$E2E_TMP/check.log"; fail "cvol check after kill -9 exited $rc"; }
}

# ------------------------------------------------------------- dedup ----

# unique_data NAME SEED -- 8 MiB of random bytes at 96 MiB of export NAME
unique_data() {
    "$NBD_PY" -c 'import nbd, os, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(os.urandom(8 << 20), 96 << 20)
h.flush()
h.shutdown()' "$(uri "$1")" || fail "writing unique data into $1 failed"
}

# idle_target POOL WHAT -- idle cleaning collects dead space in segments at
# most 90% live until it is at most 5% of the live bytes (`serve
# --idle-clean`): once settled, what it could still collect is under that.
idle_target() {
    local reclaimable live
    reclaimable=$(stat_key "$1" reclaimable_bytes)
    live=$(json_get "$E2E_TMP/stat.json" live_bytes)
    ((reclaimable * 20 <= live)) ||
        fail "$2: idle cleaning settled with $(mib "$reclaimable") reclaimable (dead in segments at most 90% live) > 5% of the $(mib "$live") live"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }

part_dedup() {
    local i img_bytes=$((MB * MIB)) one_st one_du all_st all_du busy_du shared unique t0
    tar_image usr-doc "$MB" /usr/share /usr/lib
    local img=$TAR_IMAGE
    step "dedup: the same $MB MiB image into ten volumes of one pool"
    "$CVOL" create "$DPOOL" --size 128M --physical-size 2G >/dev/null 2>&1 || fail "cvol create $DPOOL failed"
    for i in $(seq 0 9); do vol create "$DPOOL" "v$i" --size 128M; done
    # Without background recompression, idle time goes to cleaning only.
    start_server "$DPOOL" --recompress off
    t0=$(date +%s)
    nbdcopy --flush "$img" "$(uri v0)" || fail "nbdcopy into v0 failed"
    one_st=$(stat_key "$DPOOL" stored_bytes)
    one_du=$(du_b "$DPOOL")
    for i in $(seq 1 9); do nbdcopy --flush "$img" "$(uri "v$i")" || fail "nbdcopy into v$i failed"; done
    log "ten nbdcopy --flush of $MB MiB: $(($(date +%s) - t0)) s"
    busy_du=$(du_b "$DPOOL")
    # Each deduplicated block logs a small reference record that a checkpoint
    # makes dead: the idle cleaner collects it.
    settle "$DPOOL"
    all_st=$(stat_key "$DPOOL" stored_bytes)
    all_du=$(du_b "$DPOOL")
    log "one copy: stored $(mib "$one_st"), du $(mib "$one_du"); ten copies: stored $(mib "$all_st"), du $(mib "$busy_du") right after, $(mib "$all_du") once idle (${SETTLE_S} s)"
    log "ten copies / one: stored $(ratio "$all_st" "$one_st")x, du $(ratio "$all_du" "$one_du")x ($(ratio "$busy_du" "$one_du")x before idle cleaning)"
    ((all_st * 10 <= one_st * 11)) || fail "ten copies stored $all_st bytes > 1.1x one copy's $one_st"
    idle_target "$DPOOL" "after ten copies"
    # On the host: one copy's du and a tenth (the nine other volumes' maps,
    # the reference records' tables), and the dead space idle cleaning
    # leaves by design (up to 5% of the live bytes, `idle_target`): on
    # these 43 MiB that allowance is half a segment, which the cleaner
    # leaves or not depending on where the copies' dead records fell.
    local live allowed
    live=$(json_get "$E2E_TMP/stat.json" live_bytes)
    allowed=$((one_du * 11 / 10 + live / 20))
    ((all_du <= allowed)) || fail "ten copies take du $all_du bytes > 1.1x one copy's $one_du + 5% of the $live live"
    shared=$(stat_key "$DPOOL" shared_bytes v3)
    unique=$(stat_key "$DPOOL" unique_bytes v3)
    log "stat --volume v3: shared $(mib "$shared"), unique $(mib "$unique")"
    ((shared * 10 >= one_st * 9)) || fail "v3 shares $shared bytes, expected about one copy ($one_st)"
    ((unique * 100 <= one_st)) || fail "v3 has $unique unique bytes, expected under 1% of one copy ($one_st)"

    step "dedup: 8 MiB of unique data into v1..v9, then delete them"
    for i in $(seq 1 9); do unique_data "v$i"; done
    unique=$(stat_key "$DPOOL" unique_bytes v3)
    log "stat --volume v3 with its unique data: unique $(mib "$unique")"
    ((unique >= 8 * MIB && unique <= 9 * MIB)) || fail "v3's unique_bytes $unique, expected 8-9 MiB (its random data)"
    local before_du before_pu after_du after_pu got
    before_du=$(du_b "$DPOOL")
    before_pu=$(stat_key "$DPOOL" physical_used_bytes)
    for i in $(seq 1 9); do vol delete "$DPOOL" "v$i"; done
    got=$(names_sizes "$DPOOL")
    [[ $got == "default:$((128 * MIB)) v0:$((128 * MIB))" ]] || fail "after deleting v1..v9, volume list: '$got'"
    settle "$DPOOL"
    after_pu=$(stat_key "$DPOOL" physical_used_bytes)
    after_du=$(du_b "$DPOOL")
    log "before the deletes: du $(mib "$before_du"), physical_used $(mib "$before_pu"); after (idle ${SETTLE_S} s): du $(mib "$after_du"), physical_used $(mib "$after_pu"); one copy: du $(mib "$one_du")"
    idle_target "$DPOOL" "after the deletes"
    ((before_du - after_du >= 60 * MIB)) || fail "du fell by $(mib $((before_du - after_du))) only, expected >= 60 MiB of the 72 MiB deleted"
    # Idle cleaning leaves segments more than 90% live alone: one copy plus
    # that margin.
    ((after_du * 100 <= one_du * 115)) ||
        fail "du after the deletes and idle cleaning $(mib "$after_du") ($(ratio "$after_du" "$one_du")x) > 1.15x one copy's $(mib "$one_du")"
    nbdcopy "$(uri v0)" "$E2E_TMP/v0.out" || fail "reading v0 back failed"
    cmp -n "$img_bytes" "$img" "$E2E_TMP/v0.out" || fail "v0 reads back different from the image"
    cmp <(tail -c +$((img_bytes + 1)) "$E2E_TMP/v0.out") <(head -c $((128 * MIB - img_bytes)) /dev/zero) ||
        fail "v0 past the image is not zero"
    rm -f "$E2E_TMP/v0.out"
    stop_server
}

# ------------------------------------------------------------ resize ----

part_resize() {
    local got rc=0
    step "resize: ext4 on a 256 MiB volume, grown to 512 MiB while served"
    vol create "$POOL" r --size 256M
    start_server "$POOL"
    attach 0 r $((256 * MIB))
    mkfs.ext4 -q -F "${LOOPS[0]}" || fail "mkfs.ext4 on r failed"
    mount_fs 0
    head -c $((32 * MIB)) /dev/urandom >"$E2E_TMP/r.bin"
    cp "$E2E_TMP/r.bin" "$E2E_TMP/fs0/r.bin"
    umount_fs 0
    detach 0
    vol resize "$POOL" r --size 512M
    got=$(vsize r)
    ((got == 512 * MIB)) || fail "after an online grow, a new connection sees $got bytes, expected 512 MiB"
    log "nbdinfo --size after the grow: $got"
    attach 0 r $((512 * MIB))
    mount_fs 0
    # Online growth needs CAP_SYS_RESOURCE (not in every container): without
    # it, grow the unmounted file system.
    if ! resize2fs "${LOOPS[0]}" >"$E2E_TMP/resize2fs.txt" 2>&1; then
        grep -q "Permission denied to resize" "$E2E_TMP/resize2fs.txt" || {
            cat "$E2E_TMP/resize2fs.txt"
            fail "resize2fs (online) failed"
        }
        log "online resize2fs not permitted here (no CAP_SYS_RESOURCE): growing it unmounted"
        umount_fs 0
        e2fsck -fp "${LOOPS[0]}" >"$E2E_TMP/e2fsck-p.txt" 2>&1 || { cat "$E2E_TMP/e2fsck-p.txt"; fail "e2fsck -fp before resize2fs: not clean"; }
        resize2fs "${LOOPS[0]}" >"$E2E_TMP/resize2fs.txt" 2>&1 || { cat "$E2E_TMP/resize2fs.txt"; fail "resize2fs failed"; }
        mount_fs 0
    fi
    local df_bytes
    df_bytes=$(df -B1 --output=size "$E2E_TMP/fs0" | tail -n 1 | tr -d ' ')
    log "df after resize2fs: $(mib "$df_bytes")"
    ((df_bytes > 450 * MIB)) || fail "df shows $(mib "$df_bytes") after resize2fs, expected about 512 MiB"
    cmp "$E2E_TMP/r.bin" "$E2E_TMP/fs0/r.bin" || fail "the file differs after the grow"
    umount_fs 0
    fsck_clean 0 "after resize2fs"

    step "resize: a shrink below the data is refused, --discard shrinks"
    "$CVOL" volume resize "$POOL" r --size 128M >"$E2E_TMP/shrink.out" 2>&1 || rc=$?
    ((rc == 2)) || fail "shrinking r below its data exited $rc (expected 2): $(cat "$E2E_TMP/shrink.out")"
    grep -q "beyond the new size" "$E2E_TMP/shrink.out" || fail "shrink refusal does not say 'beyond the new size': $(cat "$E2E_TMP/shrink.out")"
    log "refused: $(grep -v INFO "$E2E_TMP/shrink.out" | head -n 1)"
    (($(vsize r) == 512 * MIB)) || fail "the refused shrink changed the size to $(vsize r)"
    fsck_clean 0 "after a refused shrink"
    detach 0
    vol resize "$POOL" r --size 128M --discard
    (($(vsize r) == 128 * MIB)) || fail "after resize --discard, export r has size $(vsize r), expected 128 MiB"
    [[ " $(names_sizes "$POOL") " == *" r:$((128 * MIB)) "* ]] || fail "volume list does not show r at 128 MiB"
    # What --discard dropped is gone: grown again, the range reads zero.
    vol resize "$POOL" r --size 256M
    nbdcopy "$(uri r)" "$E2E_TMP/r.out" || fail "reading r back failed"
    cmp <(tail -c +$((128 * MIB + 1)) "$E2E_TMP/r.out") <(head -c $((128 * MIB)) /dev/zero) ||
        fail "after a --discard shrink and a grow, r's new range is not zero"
    rm -f "$E2E_TMP/r.out"
    log "shrunk with --discard to 128 MiB, grown to 256 MiB again: the new range reads zero"
    stop_server
}

# ---------------------------------------------------------- physical ----

part_physical() {
    local rc=0 len wpid
    step "physical: a served 96 MiB pool with 64 MiB of random data grows to 400 MiB while a client writes"
    "$CVOL" create "$PPOOL" --size 1G --physical-size 96M >/dev/null 2>&1 || fail "create of the 96 MiB pool failed"
    head -c $((64 * MIB)) /dev/urandom >"$E2E_TMP/p1.bin"
    head -c $((200 * MIB)) /dev/urandom >"$E2E_TMP/p2.bin"
    start_server "$PPOOL"
    nbdcopy "$E2E_TMP/p1.bin" "$(uri default)" || fail "writing 64 MiB into the 96 MiB pool failed"
    # The file grows first (as a device would), then the pool, served.
    truncate -s 400M "$PPOOL"
    # pwrite_p2 FROM TO PAUSE -- bytes [FROM, TO) of p2.bin at 64 MiB + FROM,
    # 1 MiB a request, PAUSE seconds apart, then a flush
    pwrite_p2() {
        "$NBD_PY" - "$(uri default)" "$E2E_TMP/p2.bin" "$1" "$2" "$3" <<'PYEOF'
import nbd, sys, time
h = nbd.NBD(); h.connect_uri(sys.argv[1])
data = open(sys.argv[2], "rb").read()
a, b, pause = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for i in range(a, b, 1 << 20):
    h.pwrite(data[i:min(b, i + (1 << 20))], (64 << 20) + i)
    time.sleep(pause)
h.flush(); h.shutdown()
PYEOF
    }
    # 16 MiB more while the store grows: it fits the old store too.
    pwrite_p2 0 $((16 * MIB)) 0.02 &
    wpid=$!
    sleep 0.1
    "$CVOL" resize "$PPOOL" --physical-size 400M >"$E2E_TMP/presize.out" 2>&1 ||
        fail "resize of the served pool to 400M failed: $(cat "$E2E_TMP/presize.out")"
    grep -q "grew from 96.0 MiB to 400.0 MiB" "$E2E_TMP/presize.out" ||
        fail "resize said: $(cat "$E2E_TMP/presize.out")"
    log "$(head -n 1 "$E2E_TMP/presize.out")"
    wait "$wpid" || fail "the client writing during the grow failed"
    len=$(stat_key "$PPOOL" physical_size_bytes)
    ((len == 400 * MIB)) || fail "cvol stat shows physical_size_bytes $len after the grow, expected 400 MiB"
    (($(stat -c %s "$PPOOL") == 400 * MIB)) || fail "the file is $(stat -c %s "$PPOOL") bytes after the grow"
    # 184 MiB more (264 MiB in all: more than the 96 MiB store held).
    pwrite_p2 $((16 * MIB)) $((200 * MIB)) 0 || fail "writing 184 MiB more after the grow failed"
    log "physical_used $(mib "$(stat_key "$PPOOL" physical_used_bytes)") of $(mib "$len")"
    nbdcopy "$(uri default)" "$E2E_TMP/pall.out" || fail "reading the pool back failed"
    cmp <(head -c $((64 * MIB)) "$E2E_TMP/pall.out") "$E2E_TMP/p1.bin" || fail "the data written before the grow differs"
    cmp <(tail -c +$((64 * MIB + 1)) "$E2E_TMP/pall.out" | head -c $((200 * MIB))) "$E2E_TMP/p2.bin" ||
        fail "the data written during and after the grow differs"
    log "64 MiB before the grow and 200 MiB during and after it read back exact"
    rm -f "$E2E_TMP/pall.out"

    step "physical: a shrink below the data is refused, served and offline (exit 2, file unchanged)"
    len=$(stat -c %s "$PPOOL")
    rc=0
    "$CVOL" resize "$PPOOL" --physical-size 100M >"$E2E_TMP/presize.out" 2>&1 || rc=$?
    ((rc == 2)) && grep -q "cannot shrink below them" "$E2E_TMP/presize.out" ||
        fail "shrink below the data (served): exit $rc, $(cat "$E2E_TMP/presize.out")"
    log "  refused: $(grep -v ' WARN \| INFO ' "$E2E_TMP/presize.out" | head -n 1)"
    (($(stat_key "$PPOOL" physical_size_bytes) == 400 * MIB)) || fail "a refused shrink changed the pool's size"
    stop_server
    (($(stat -c %s "$PPOOL") == len)) || fail "a refused shrink changed the file's size"
    cvol_check "$PPOOL"
    rc=0
    "$CVOL" resize "$PPOOL" --physical-size 100M >"$E2E_TMP/presize.out" 2>&1 || rc=$?
    ((rc == 2)) && grep -q "cannot shrink below them" "$E2E_TMP/presize.out" ||
        fail "shrink below the data (offline): exit $rc, $(cat "$E2E_TMP/presize.out")"
    (($(stat -c %s "$PPOOL") == len)) || fail "a refused shrink changed the file's size"

    step "physical: an empty pool's file is cut, served and offline"
    rm -f "$E2E_TMP/e.cvol"
    "$CVOL" create "$E2E_TMP/e.cvol" --size 1G --physical-size 1G >/dev/null 2>&1 || fail "create e.cvol failed"
    start_server "$E2E_TMP/e.cvol"
    "$CVOL" resize "$E2E_TMP/e.cvol" --physical-size 256M >"$E2E_TMP/presize.out" 2>&1 ||
        fail "shrinking a served empty pool failed: $(cat "$E2E_TMP/presize.out")"
    # (Rounded down to whole segments after the first MiB.)
    len=$(stat_key "$E2E_TMP/e.cvol" physical_size_bytes)
    ((len <= 256 * MIB && len > 240 * MIB)) || fail "cvol stat shows physical_size_bytes $len after the served shrink to 256 MiB"
    (($(stat -c %s "$E2E_TMP/e.cvol") == len)) || fail "the empty pool's file is $(stat -c %s "$E2E_TMP/e.cvol") bytes after a served shrink to $len"
    stop_server
    "$CVOL" resize "$E2E_TMP/e.cvol" --physical-size 128M >"$E2E_TMP/presize.out" 2>&1 ||
        fail "shrinking an empty pool offline failed: $(cat "$E2E_TMP/presize.out")"
    len=$(stat -c %s "$E2E_TMP/e.cvol")
    ((len <= 128 * MIB)) || fail "the empty pool's file is $len bytes after a shrink to 128 MiB"
    cvol_check "$E2E_TMP/e.cvol"
    log "an empty pool shrank to $(mib "$len") (served to 256 MiB, then offline)"
}

# ------------------------------------------------------------ errors ----

# refuse WHAT PATTERN CMD... -- CMD exits 2 with PATTERN in its output, no
# panic, and `cvol volume list` is unchanged
refuse() {
    local what=$1 pat=$2 rc=0
    shift 2
    list_json "$POOL" "$E2E_TMP/before.json"
    "$@" >"$E2E_TMP/refused.out" 2>&1 || rc=$?
    ((rc == 2)) || fail "$what: exit $rc, expected 2: $(cat "$E2E_TMP/refused.out")"
    grep -qF -- "$pat" "$E2E_TMP/refused.out" || fail "$what: message lacks '$pat': $(cat "$E2E_TMP/refused.out")"
    if grep -q panicked "$E2E_TMP/refused.out"; then fail "$what: panic: $(cat "$E2E_TMP/refused.out")"; fi
    list_json "$POOL" "$E2E_TMP/after.json"
    cmp -s "$E2E_TMP/before.json" "$E2E_TMP/after.json" ||
        fail "$what: volume list changed: $(cat "$E2E_TMP/before.json") -> $(cat "$E2E_TMP/after.json")"
    log "  $what: $(grep -v ' INFO ' "$E2E_TMP/refused.out" | head -n 1)"
}

refusals() {
    local names
    names=$("$PY" -c 'import json,sys; print(", ".join(sorted(v["name"] for v in json.load(open(sys.argv[1]))["volumes"])))' \
        "$E2E_TMP/list.json")
    refuse "an existing name" "already has a volume named 'default'" "$CVOL" volume create "$POOL" default --size 1M
    refuse "a name with '/'" "cannot contain '/'" "$CVOL" volume create "$POOL" x/y --size 1M
    refuse "a name with '@'" "cannot contain '@'" "$CVOL" volume create "$POOL" x@y --size 1M
    refuse "size 0" "multiple of 4096" "$CVOL" volume create "$POOL" z --size 0
    refuse "size 4095" "multiple of 4096" "$CVOL" volume create "$POOL" z --size 4095
    refuse "delete of an unknown name" "no volume named 'nosuch' (it has: $names)" "$CVOL" volume delete "$POOL" nosuch
    refuse "resize of an unknown name" "no volume named 'nosuch'" "$CVOL" volume resize "$POOL" nosuch --size 1G
}

part_errors() {
    step "errors: refused offline"
    names_sizes "$POOL" >/dev/null
    refusals
    step "errors: refused while served"
    start_server "$POOL"
    names_sizes "$POOL" >/dev/null
    refusals

    step "errors: deleting a volume a client holds open needs --force"
    vol create "$POOL" held --size 64M
    "$NBD_PY" -c 'import nbd, os, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(b"x" * 4096, 0)
h.flush()
open(sys.argv[2], "w").write("connected\n")
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
try:
    h.pread(4096, 0)
    print("read ok")
except nbd.Error as e:
    print("read failed:", e)' "$(uri held)" "$E2E_TMP/held.ready" "$E2E_TMP/held.go" >"$E2E_TMP/held.out" 2>&1 &
    local holder=$!
    reg_pid "$holder"
    wait_until 20 "the client to open 'held'" test -s "$E2E_TMP/held.ready"
    refuse "delete of a volume a client has open" "--force" "$CVOL" volume delete "$POOL" held
    grep -q "open by 1 client" "$E2E_TMP/refused.out" || fail "the refusal does not say one client has it open: $(cat "$E2E_TMP/refused.out")"
    vol delete "$POOL" held --force
    [[ " $(names_sizes "$POOL") " != *" held:"* ]] || fail "'held' still listed after delete --force"
    touch "$E2E_TMP/held.go"
    wait "$holder" || fail "the holding client failed: $(cat "$E2E_TMP/held.out")"
    unreg_pid "$holder"
    log "the holding client after delete --force: $(cat "$E2E_TMP/held.out")"
    grep -q "^read failed" "$E2E_TMP/held.out" || fail "a client of a force-deleted volume still reads it: $(cat "$E2E_TMP/held.out")"
    stop_server
}

# ------------------------------------------------------------- check ----

part_check() {
    step "check: both pools"
    cvol_check "$POOL"
    if [[ -e $DPOOL ]]; then cvol_check "$DPOOL"; fi
}

for p in $PARTS; do timed "part_$p"; done
summary=""
for p in $PARTS; do summary+="$p ${TOOK[part_$p]}s, "; done
pass "${summary}total $(($(date +%s) - T_START))s"
