#!/usr/bin/env bash
# Snapshots, clones, rollback and incremental backup of a pool's volumes,
# with stock clients, on a served pool (the commands go through the
# server's control socket).
#
#   ext4     an ext4 on volume `default` (nbdfuse + loop) gets a real tree;
#            `default@one` is taken while it is mounted and served (after
#            sync and `fsfreeze -f` when that works); then files are deleted
#            and another tree added; the snapshot's export `default@one`
#            mounted read-only (`ro,noload`) diff -r's equal to a copy of the
#            file system taken at snapshot time, its image checks clean
#            (e2fsck -fn), writes to it fail (qemu-io, and a libnbd write
#            sent anyway: EPERM); the blocks `qemu:dirty-bitmap:one` flags
#            total exactly the snapshot's `changed_bytes`
#   clone    `cvol clone` of `default@one` while served: `du` of the pool
#            grows by at most 1 MiB, the clone is served at once and reads
#            exactly as the snapshot; mounted read-write it takes a tree and
#            checks clean; the origin and the snapshot read the same as before
#   backup   a 1 GiB volume full of data (half compressible), a full backup
#            of its snapshot `b0` with nbdcopy; 5% of it rewritten with
#            random 64 KiB writes; `py/incremental_backup.py` walks
#            `qemu:dirty-bitmap:b0` with libnbd and copies only the dirty
#            extents into the backup: it reads exactly the changed bytes
#            (<= 6% of the volume), `nbdinfo --map` totals the same, and the
#            updated backup is identical to the volume (cmp)
#   rollback `snapshot rollback default@one` is refused while a client has
#            `default` open (exit 2, naming the volume); with it gone, the
#            volume reads exactly as the snapshot did (sha256), nothing is
#            dirty since it any more, the clone reads as before
#   kill9    a snapshot of written data, then kill -9 of the server while a
#            libnbd client writes (a second snapshot taken in the middle):
#            after a restart both snapshots are listed and the first reads
#            exactly as recorded before the writes (sha256)
#   errors   refused, offline and served: a snapshot of an unknown volume,
#            bad names (`default@a/b`, no '@'), an existing snapshot, a
#            rollback past a newer snapshot, a clone onto an existing name, an
#            unknown snapshot: exit 2, a message naming the problem,
#            `snapshot list` and `volume list` unchanged
#   delete   deleting a snapshot a clone reads through is refused naming the
#            clone (exit 2); the clone deleted, then every snapshot: the list
#            is empty, the volumes read as before, `du` of the pool falls by
#            most of the snapshots' unique bytes once the idle cleaner has
#            settled; `cvol check`
#
#   E2E_SNAP_PARTS      parts to run, in this order (default: all of the above);
#                       clone, rollback and delete take `default@one` from ext4
#                       and make a small one if it did not run
#   E2E_SNAP_SRCS       two directory trees for ext4 and clone (default: picked,
#                       15-60 MB each)
#   E2E_SNAP_BACKUP_MB  the backup volume's size in MiB (default 512)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=pool-lib.sh
. "$E2E_DIR/pool-lib.sh"

need_root
need nbdinfo nbdcopy nbdfuse qemu-io losetup mkfs.ext4 e2fsck mount umount mountpoint diff sha256sum cmp
[[ -e /dev/fuse ]] || skip "/dev/fuse missing"
need_nbd_python
need_server
is_cvol || skip "cvol only: snapshots have no stand-in"

ALL_PARTS="ext4 clone backup rollback kill9 errors delete"
PARTS=${E2E_SNAP_PARTS:-$ALL_PARTS}
BACKUP_MB=${E2E_SNAP_BACKUP_MB:-512}
POOL=$E2E_TMP/pool.cvol
BK=$E2E_DIR/py/incremental_backup.py
MIB=$((1 << 20))
VOL_BYTES=$((512 * MIB)) # default (ext4)

for p in $PARTS; do
    [[ " $ALL_PARTS " == *" $p "* ]] || fail "E2E_SNAP_PARTS: unknown part '$p' (known: $ALL_PARTS)"
done

# uri NAME -- the export NAME of the current server ('@' percent-encoded as
# %40: libnbd and qemu accept it raw too, the ext4 part checks both)
uri() { echo "nbd+unix:///${1//@/%40}?socket=$SRV_SOCK"; }
# sha NAME -- sha256 of the whole export NAME
sha() {
    local s
    s=$(set -o pipefail; nbdcopy "$(uri "$1")" - | sha256sum | cut -d' ' -f1) || fail "reading export '$1' failed"
    echo "$s"
}
# cv CMD... -- a cvol command that must succeed (output in cv.out)
cv() {
    "$CVOL" "$@" >"$E2E_TMP/cv.out" 2>&1 || fail "cvol $* failed: $(cat "$E2E_TMP/cv.out")"
}
# snap_names -- "VOL@SNAP ..." sorted, from `snapshot list --json`
snap_names() {
    "$CVOL" snapshot list "$POOL" --json >"$E2E_TMP/snaps.json" || fail "cvol snapshot list --json failed"
    "$PY" -c 'import json,sys
print(" ".join(sorted(s["name"] for s in json.load(open(sys.argv[1]))["snapshots"])))' "$E2E_TMP/snaps.json"
}
has_snap() { [[ " $(snap_names) " == *" $1 "* ]]; }
# snap_stat VOL@SNAP KEY
snap_stat() {
    "$CVOL" stat "$POOL" --volume "$1" --json >"$E2E_TMP/sstat.json" || fail "cvol stat --volume $1 --json failed"
    json_get "$E2E_TMP/sstat.json" "$2"
}
# dirty_total VOL SNAP -- bytes `nbdinfo --map=qemu:dirty-bitmap:SNAP` flags dirty
dirty_total() {
    nbdinfo --map="qemu:dirty-bitmap:$2" "$(uri "$1")" >"$E2E_TMP/map.txt" ||
        fail "nbdinfo --map=qemu:dirty-bitmap:$2 of '$1' failed"
    awk '$3 == 1 { s += $2 } END { printf "%d\n", s }' "$E2E_TMP/map.txt"
}

SERVING=0
serve() {
    start_server "$POOL" --recompress off
    SERVING=1
}
ensure_server() { ((SERVING)) || serve; }
halt() {
    if ((SERVING)); then stop_server; fi
    SERVING=0
}

# ------------------------------------------------------- nbdfuse + loop ----

# attach I NAME BYTES [ro] -- nbdfuse + loop of export NAME (pool-lib.sh);
# nbdfuse takes the '@' raw here (the ext4 part's read-only mount)
attach() {
    local u
    u=$(uri "$2")
    if [[ -n ${4:-} ]]; then u="nbd+unix:///$2?socket=$SRV_SOCK"; fi
    fuse_attach "$1" "$u" "$3" "${4:-}"
}

pick_sources() { pick_trees 2 E2E_SNAP_SRCS; }

T_START=$(date +%s)

"$CVOL" create "$POOL" --size $((VOL_BYTES / MIB))M --physical-size 4G >/dev/null 2>&1 || fail "cvol create $POOL failed"
SHA_ONE="" # what default@one reads, once taken

# -------------------------------------------------------------- ext4 ----

# freeze_snapshot FS NAME -- sync, fsfreeze -f FS (if it works here), take
# snapshot NAME, unfreeze
freeze_snapshot() {
    local fs=$1 name=$2 frozen=0 rc=0 t0
    sync -f "$fs"
    if fsfreeze -f "$fs" 2>"$E2E_TMP/fsfreeze.err"; then
        frozen=1
    else
        log "fsfreeze -f not possible here ($(head -n 1 "$E2E_TMP/fsfreeze.err")): snapshot after sync only"
    fi
    t0=$(now)
    "$CVOL" snapshot create "$POOL" "$name" >"$E2E_TMP/cv.out" 2>&1 || rc=$?
    local took changed=-1 dirty=-1
    took=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", (b - a) * 1000 }')
    if ((frozen && rc == 0)); then
        # Nothing writes while frozen: nothing changed since the snapshot.
        changed=$(snap_stat "$name" changed_bytes)
        dirty=$(dirty_total "${name%@*}" "${name#*@}")
    fi
    if ((frozen)); then fsfreeze -u "$fs" || fail "fsfreeze -u $fs failed"; fi
    ((rc == 0)) || fail "cvol snapshot create $name (served, mounted) failed: $(cat "$E2E_TMP/cv.out")"
    if ((frozen)); then
        ((changed == 0 && dirty == 0)) ||
            fail "a fresh snapshot of a frozen file system: changed_bytes $changed, dirty bytes $dirty (expected 0, 0)"
    fi
    log "snapshot $name taken in $took ms (the command, through the control socket)$( ((frozen)) && echo ", file system frozen")"
}

part_ext4() {
    local rc=0 got want
    pick_sources
    step "ext4: an ext4 on 'default', ${SRCS[0]} copied in, snapshot default@one while mounted and served"
    ensure_server
    attach 0 default "$VOL_BYTES"
    mkfs.ext4 -q -F "${LOOPS[0]}" || fail "mkfs.ext4 on default failed"
    mount_fs 0
    cp -a "${SRCS[0]}" "$E2E_TMP/fs0/a" || fail "copying ${SRCS[0]} failed"
    sync -f "$E2E_TMP/fs0"
    rm -rf "$E2E_TMP/at-one"
    cp -a "$E2E_TMP/fs0" "$E2E_TMP/at-one" || fail "copying the tree at snapshot time failed"
    freeze_snapshot "$E2E_TMP/fs0" default@one
    [[ $(snap_names) == "default@one" ]] || fail "snapshot list after create: '$(snap_names)', expected 'default@one'"

    step "ext4: files deleted, ${SRCS[1]} added, synced"
    find "$E2E_TMP/fs0/a" -type f | sort | awk 'NR % 2 == 0' | xargs -d '\n' rm -f
    cp -a "${SRCS[1]}" "$E2E_TMP/fs0/b" || fail "copying ${SRCS[1]} failed"
    sync -f "$E2E_TMP/fs0"
    ! diff -rq "$E2E_TMP/at-one" "$E2E_TMP/fs0" >/dev/null 2>&1 || fail "the live file system did not change"

    step "ext4: the export default@one, read-only: same tree, fsck clean"
    for want in "nbd+unix:///default@one?socket=$SRV_SOCK" "nbd+unix:///default%40one?socket=$SRV_SOCK"; do
        got=$(nbdinfo --size "$want") || fail "nbdinfo --size $want failed"
        ((got == VOL_BYTES)) || fail "nbdinfo --size $want: $got, expected $VOL_BYTES"
        nbdinfo --json "$want" >"$E2E_TMP/info.json" || fail "nbdinfo --json $want failed"
        grep -q '"is_read_only": true' "$E2E_TMP/info.json" || fail "$want is not read-only (nbdinfo)"
        qemu-io -r -f raw -c 'read 0 4k' "$want" >"$E2E_TMP/qio.out" 2>&1 || fail "qemu-io -r of $want failed: $(cat "$E2E_TMP/qio.out")"
    done
    log "'@' in the URI's export name works raw and as %40 (nbdinfo, qemu-io); the export is read-only"
    attach 1 default@one "$VOL_BYTES" ro
    mount_fs 1 ro,noload
    same_tree "$E2E_TMP/at-one" "$E2E_TMP/fs1" "the snapshot default@one"
    umount_fs 1
    fsck_clean 1 "the snapshot default@one"
    detach 1
    log "default@one: diff -r equal to the tree at snapshot time, e2fsck -fn clean"

    step "ext4: writes to the snapshot export fail"
    SHA_ONE=$(sha default@one)
    rc=0
    qemu-io -f raw -c 'write -P 0x55 0 64k' "$(uri default@one)" >"$E2E_TMP/qio.out" 2>&1 || rc=$?
    ((rc != 0)) || fail "qemu-io write to default@one succeeded: $(cat "$E2E_TMP/qio.out")"
    log "qemu-io write: exit $rc, $(head -n 1 "$E2E_TMP/qio.out")"
    "$NBD_PY" - "$(uri default@one)" >"$E2E_TMP/w.out" 2>&1 <<'PYEOF' || fail "libnbd write to default@one: $(cat "$E2E_TMP/w.out")"
import nbd, sys
h = nbd.NBD(); h.connect_uri(sys.argv[1])
assert h.is_read_only(), "export not flagged read-only"
h.set_strict_mode(0)  # send it anyway: the server must refuse it
for what, f in (("write", lambda: h.pwrite(b"x" * 4096, 0)), ("trim", lambda: h.trim(4096, 0)),
                ("zero", lambda: h.zero(4096, 0))):
    try:
        f(); sys.exit("%s to the snapshot succeeded" % what)
    except nbd.Error as e:
        assert e.errno == "EPERM", "%s: %s (expected EPERM)" % (what, e)
print("write, trim, zero: EPERM")
PYEOF
    log "libnbd requests sent to the read-only export: $(cat "$E2E_TMP/w.out")"
    [[ $(sha default@one) == "$SHA_ONE" ]] || fail "default@one changed after refused writes"

    step "ext4: qemu:dirty-bitmap:one totals the snapshot's changed_bytes"
    umount_fs 0
    fsck_clean 0 "default after the changes"
    detach 0
    local dirty changed
    dirty=$(dirty_total default one)
    changed=$(snap_stat default@one changed_bytes)
    log "dirty since one: $(mib "$dirty") in $(awk '$3 == 1' "$E2E_TMP/map.txt" | wc -l) runs; stat --volume default@one: changed $(mib "$changed"), unique $(mib "$(json_get "$E2E_TMP/sstat.json" unique_bytes)")"
    ((dirty > 0 && dirty == changed)) || fail "dirty bytes since one $dirty != the snapshot's changed_bytes $changed"
    "$CVOL" stat "$POOL" --volume default --json >"$E2E_TMP/vstat.json" || fail "cvol stat --volume default failed"
    got=$("$PY" -c 'import json,sys
s = json.load(open(sys.argv[1]))["snapshots"]
print(" ".join("%s:%d" % (x["name"], x["changed_bytes"]) for x in s))' "$E2E_TMP/vstat.json")
    [[ $got == "default@one:$changed" ]] || fail "stat --volume default: snapshots '$got', expected 'default@one:$changed'"
}

# need_one -- default@one, made from 8 MiB of random data if ext4 did not run
need_one() {
    ensure_server
    [[ -n $SHA_ONE ]] && return 0
    if ! has_snap default@one; then
        head -c $((8 * MIB)) /dev/urandom >"$E2E_TMP/one.bin"
        nbdcopy "$E2E_TMP/one.bin" "$(uri default)" || fail "writing default failed"
        cv snapshot create "$POOL" default@one
        rm -f "$E2E_TMP/one.bin"
    fi
    SHA_ONE=$(sha default@one)
}

# ------------------------------------------------------------- clone ----

part_clone() {
    local before after sha_def sha_c1 got
    need_one
    pick_sources
    step "clone: cvol clone default@one c1 while served"
    sha_def=$(sha default)
    sync
    before=$(du_b "$POOL")
    cv clone "$POOL" default@one c1
    after=$(du_b "$POOL")
    log "du of the pool: $(mib "$before") before the clone, $(mib "$after") after (+$((after - before)) bytes)"
    ((after - before <= MIB)) || fail "a clone of a $(mib "$VOL_BYTES") volume grew du by $((after - before)) bytes (> 1 MiB)"
    got=$(nbdinfo --size "$(uri c1)") || fail "the clone c1 is not served"
    ((got == VOL_BYTES)) || fail "c1 has size $got, expected $VOL_BYTES"
    [[ $(sha c1) == "$SHA_ONE" ]] || fail "c1 does not read as default@one"
    log "c1 served at once, reads exactly as default@one"

    step "clone: c1 mounted read-write takes ${SRCS[1]}"
    attach 2 c1 "$VOL_BYTES"
    # Without the ext4 part, default@one holds no file system: make one.
    if [[ ! -d $E2E_TMP/at-one ]]; then mkfs.ext4 -q -F "${LOOPS[2]}" || fail "mkfs.ext4 on c1 failed"; fi
    mount_fs 2
    if [[ -d $E2E_TMP/at-one ]]; then same_tree "$E2E_TMP/at-one" "$E2E_TMP/fs2" "c1 as mounted"; fi
    cp -a "${SRCS[1]}" "$E2E_TMP/fs2/c" || fail "copying ${SRCS[1]} into c1 failed"
    umount_fs 2
    fsck_clean 2 "the clone c1 after writes"
    mount_fs 2 ro
    same_tree "${SRCS[1]}" "$E2E_TMP/fs2/c" "c1's new tree"
    umount_fs 2
    detach 2
    sha_c1=$(sha c1)
    [[ $sha_c1 != "$SHA_ONE" ]] || fail "c1 reads the same as default@one after writes"
    [[ $(sha default@one) == "$SHA_ONE" ]] || fail "default@one changed when its clone was written"
    [[ $(sha default) == "$sha_def" ]] || fail "default changed when its snapshot's clone was written"
    log "c1 written and fsck clean; default and default@one read as before (sha256)"
    SHA_C1=$sha_c1
}
SHA_C1=""

# ------------------------------------------------------------ backup ----

part_backup() {
    local size=$((BACKUP_MB * MIB)) out t0 ch dirty read map
    ensure_server
    step "backup: a ${BACKUP_MB} MiB volume full of data, a full backup of bk@b0"
    cv volume create "$POOL" bk --size "${BACKUP_MB}M"
    t0=$(now)
    "$NBD_PY" "$BK" fill "$(uri bk)" || fail "filling bk failed"
    log "filled in $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }') s"
    cv snapshot create "$POOL" bk@b0
    t0=$(now)
    nbdcopy "$(uri bk@b0)" "$E2E_TMP/bk.raw" || fail "the full backup (nbdcopy of bk@b0) failed"
    (($(stat -c %s "$E2E_TMP/bk.raw") == size)) || fail "the full backup is not $size bytes"
    log "full backup: $(mib "$size") in $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }') s"

    step "backup: 5% of bk rewritten (random 64 KiB writes)"
    "$NBD_PY" "$BK" change "$(uri bk)" 5 43 >"$E2E_TMP/change.json" || fail "changing bk failed"
    ch=$(json_get "$E2E_TMP/change.json" bytes)
    log "changed $(json_get "$E2E_TMP/change.json" chunks) chunks of 64 KiB: $(mib "$ch")"
    map=$(dirty_total bk b0)
    log "nbdinfo --map=qemu:dirty-bitmap:b0: $(mib "$map") dirty in $(awk '$3 == 1' "$E2E_TMP/map.txt" | wc -l) runs"
    ((map == ch)) || fail "nbdinfo --map=qemu:dirty-bitmap:b0 totals $map dirty bytes, $ch were changed"

    step "backup: the dirty extents copied into the backup (libnbd)"
    t0=$(now)
    "$NBD_PY" "$BK" backup "$(uri bk)" qemu:dirty-bitmap:b0 "$E2E_TMP/bk.raw" >"$E2E_TMP/inc.json" ||
        fail "the incremental backup failed"
    dirty=$(json_get "$E2E_TMP/inc.json" dirty_bytes)
    read=$(json_get "$E2E_TMP/inc.json" bytes_read)
    log "incremental: read $(mib "$read") of $(mib "$size") ($(awk -v a="$read" -v b="$size" 'BEGIN { printf "%.2f", 100 * a / b }')%) in $(json_get "$E2E_TMP/inc.json" runs) runs, $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }') s"
    ((dirty == ch && read == ch)) || fail "the backup read $read bytes ($dirty flagged dirty); $ch were changed"
    ((read * 100 <= size * 6)) || fail "the backup read $read bytes, more than 6% of $size"
    (set -o pipefail; nbdcopy "$(uri bk)" - | cmp - "$E2E_TMP/bk.raw") || fail "the updated backup differs from bk"
    log "the updated backup equals a full read of bk (cmp)"
    rm -f "$E2E_TMP/bk.raw"
}

# ---------------------------------------------------------- rollback ----

part_rollback() {
    local rc=0 before
    need_one
    step "rollback: refused while a client has 'default' open"
    before=$(snap_names)
    attach 0 default "$VOL_BYTES"
    "$CVOL" snapshot rollback "$POOL" default@one >"$E2E_TMP/rb.out" 2>&1 || rc=$?
    log "refused: $(grep -v ' INFO ' "$E2E_TMP/rb.out" | head -n 1)"
    ((rc == 2)) || fail "rollback with a client attached: exit $rc, expected 2: $(cat "$E2E_TMP/rb.out")"
    # nbdfuse opens several connections (multi-conn).
    grep -Eq "volume 'default' is open by [1-9][0-9]* client\(s\): disconnect them before a rollback" "$E2E_TMP/rb.out" ||
        fail "the refusal does not say 'default' is open by clients: $(cat "$E2E_TMP/rb.out")"
    # Rollback has no --force: the refusal must not offer one.
    if grep -q -- "--force" "$E2E_TMP/rb.out"; then
        fail "the rollback refusal suggests --force, which 'cvol snapshot rollback' does not take: $(cat "$E2E_TMP/rb.out")"
    fi
    [[ $(snap_names) == "$before" ]] || fail "a refused rollback changed the snapshot list"
    detach 0

    step "rollback: with the client gone"
    local sha_c1_before=""
    if [[ -n $SHA_C1 ]]; then sha_c1_before=$SHA_C1; fi
    cv snapshot rollback "$POOL" default@one
    [[ $(sha default) == "$SHA_ONE" ]] || fail "after the rollback, default does not read as default@one"
    [[ $(sha default@one) == "$SHA_ONE" ]] || fail "after the rollback, default@one reads differently"
    (($(dirty_total default one) == 0)) || fail "after the rollback, qemu:dirty-bitmap:one still flags $(dirty_total default one) bytes"
    (($(snap_stat default@one changed_bytes) == 0)) || fail "after the rollback, default@one has changed_bytes $(json_get "$E2E_TMP/sstat.json" changed_bytes)"
    if [[ -n $sha_c1_before ]]; then
        [[ $(sha c1) == "$sha_c1_before" ]] || fail "the rollback of default changed its snapshot's clone c1"
    fi
    log "default reads exactly as default@one (sha256), nothing dirty since it${sha_c1_before:+, the clone c1 unchanged}"
}

# ------------------------------------------------------------- kill9 ----

part_kill9() {
    local sha_s wpid
    ensure_server
    step "kill9: volume k, 64 MiB written, snapshot k@s"
    cv volume create "$POOL" k --size 256M
    head -c $((64 * MIB)) /dev/urandom >"$E2E_TMP/k.bin"
    nbdcopy --flush "$E2E_TMP/k.bin" "$(uri k)" || fail "writing k failed"
    rm -f "$E2E_TMP/k.bin"
    cv snapshot create "$POOL" k@s
    sha_s=$(sha k@s)

    step "kill9: writes to k, a snapshot k@s2 in the middle, kill -9"
    "$NBD_PY" "$BK" writer "$(uri k)" >"$E2E_TMP/writer.out" 2>&1 &
    wpid=$!
    reg_pid "$wpid"
    wait_until 30 "the writer to flush" grep -q flushed "$E2E_TMP/writer.out"
    cv snapshot create "$POOL" k@s2
    sleep 0.5
    _alive "$wpid" || fail "the writer stopped before the kill: $(tail -n 2 "$E2E_TMP/writer.out")"
    kill9_server
    SERVING=0
    wait "$wpid" || true
    unreg_pid "$wpid"
    log "writer: $(tail -n 1 "$E2E_TMP/writer.out")"
    grep -q "^stopped after" "$E2E_TMP/writer.out" || fail "the writer did not see the server go: $(tail -n 2 "$E2E_TMP/writer.out")"

    step "kill9: restart; k@s reads as before the writes"
    serve
    [[ " $(snap_names) " == *" k@s k@s2 "* ]] || fail "after kill -9, the snapshots are '$(snap_names)', expected k@s and k@s2 among them"
    [[ $(sha k@s) == "$sha_s" ]] || fail "after kill -9, k@s does not read as recorded before the writes"
    sha k@s2 >/dev/null
    # Dirty since the newest snapshot is exactly what it holds; since an
    # older one, what it or a newer one holds.
    local d1 d2 c1 c2
    d1=$(dirty_total k s)
    d2=$(dirty_total k s2)
    c1=$(snap_stat k@s changed_bytes)
    c2=$(snap_stat k@s2 changed_bytes)
    log "after the restart: dirty since s $(mib "$d1"), since s2 $(mib "$d2"); changed_bytes of k@s $(mib "$c1"), of k@s2 $(mib "$c2")"
    ((d2 == c2)) || fail "after kill -9, dirty since k@s2 ($d2) != its changed_bytes ($c2)"
    ((d1 >= c1 && d1 >= c2 && d1 <= c1 + c2 && c1 > 0)) ||
        fail "after kill -9, dirty since k@s ($d1) is not between max and sum of the changed_bytes of k@s ($c1) and k@s2 ($c2)"
    log "after kill -9: k@s and k@s2 listed, k@s reads exactly as before (sha256)"
}

# ------------------------------------------------------------ errors ----

# refuse WHAT PATTERN CMD... -- exit 2, PATTERN in the output, no panic,
# `snapshot list` and `volume list` unchanged
refuse() {
    local what=$1 pat=$2 rc=0
    shift 2
    snap_names >/dev/null
    cp "$E2E_TMP/snaps.json" "$E2E_TMP/snaps.before"
    "$CVOL" volume list "$POOL" --json >"$E2E_TMP/vols.before" || fail "volume list failed"
    timeout -k 5 20 "$@" >"$E2E_TMP/refused.out" 2>&1 || rc=$?
    ((rc != 124 && rc != 137)) || fail "$what: '${*##*/}' hung (killed after 20 s): $(cat "$E2E_TMP/refused.out")"
    ((rc == 2)) || fail "$what: exit $rc, expected 2: $(cat "$E2E_TMP/refused.out")"
    grep -qF -- "$pat" "$E2E_TMP/refused.out" || fail "$what: message lacks '$pat': $(cat "$E2E_TMP/refused.out")"
    if grep -q panicked "$E2E_TMP/refused.out"; then fail "$what: panic: $(cat "$E2E_TMP/refused.out")"; fi
    snap_names >/dev/null
    cmp -s "$E2E_TMP/snaps.before" "$E2E_TMP/snaps.json" || fail "$what: snapshot list changed: $(cat "$E2E_TMP/snaps.json")"
    "$CVOL" volume list "$POOL" --json >"$E2E_TMP/vols.after" || fail "volume list failed"
    cmp -s "$E2E_TMP/vols.before" "$E2E_TMP/vols.after" || fail "$what: volume list changed"
    log "  $what: $(grep -v ' INFO \| WARN ' "$E2E_TMP/refused.out" | head -n 1)"
}

refusals() {
    local c=(snapshot create "$POOL") vols
    vols=$("$CVOL" volume list "$POOL" --json | "$PY" -c 'import json,sys
print(", ".join(sorted(v["name"] for v in json.load(sys.stdin)["volumes"])))')
    refuse "a snapshot of an unknown volume" "the pool has no volume named 'nosuch' (it has: $vols)" \
        "$CVOL" "${c[@]}" nosuch@x
    refuse "'/' in a snapshot name" "a snapshot name cannot contain '/'" "$CVOL" "${c[@]}" ev@a/b
    refuse "no '@'" "a snapshot is named VOLUME@SNAPSHOT" "$CVOL" "${c[@]}" ev
    refuse "an empty snapshot name" "a snapshot name cannot be empty" "$CVOL" "${c[@]}" ev@
    refuse "an existing snapshot" "snapshot 'ev@s1' already exists" "$CVOL" "${c[@]}" ev@s1
    refuse "a rollback past a newer snapshot" "'ev@s1' is not the volume's newest snapshot (newer: ev@s2)" \
        "$CVOL" snapshot rollback "$POOL" ev@s1
    refuse "a clone onto an existing name" "the pool already has a volume named 'default'" \
        "$CVOL" clone "$POOL" ev@s1 default
    refuse "a snapshot of a snapshot" "a snapshot name cannot contain '@'" "$CVOL" "${c[@]}" ev@s1@x
    refuse "a clone named 'a/b'" "invalid volume name 'a/b': a volume name cannot contain '/'" \
        "$CVOL" clone "$POOL" ev@s1 a/b
    refuse "a volume delete of a snapshot's name" "the pool has no volume named 'ev@s1' (it has: $vols)" \
        "$CVOL" volume delete "$POOL" ev@s1
    refuse "a volume with snapshots deleted" "volume 'ev' has snapshots (s1, s2): delete them first" "$CVOL" volume delete "$POOL" ev
    local snaps
    snaps=$(snap_names | sed 's/ /, /g')
    refuse "a clone of an unknown snapshot" "there is no snapshot 'ev@nosuch' (snapshots: $snaps)" \
        "$CVOL" clone "$POOL" ev@nosuch c9
    refuse "a delete of an unknown snapshot" "there is no snapshot 'ev@nosuch'" "$CVOL" snapshot delete "$POOL" ev@nosuch
    refuse "a rollback to an unknown snapshot" "there is no snapshot 'ev@nosuch'" "$CVOL" snapshot rollback "$POOL" ev@nosuch
}

part_errors() {
    ensure_server
    cv volume create "$POOL" ev --size 64M
    cv snapshot create "$POOL" ev@s1
    cv snapshot create "$POOL" ev@s2
    step "errors: refused while served"
    refusals
    step "errors: refused offline"
    halt
    refusals
}

# ------------------------------------------------------------ delete ----


part_delete() {
    local rc=0 s unique=0 u x before after vols v
    need_one
    ensure_server
    "$CVOL" volume list "$POOL" --json >"$E2E_TMP/vols.json" || fail "cvol volume list failed"
    grep -q '"name": "c1"' "$E2E_TMP/vols.json" || cv clone "$POOL" default@one c1
    step "delete: default@one, which c1 reads through, is refused"
    snap_names >/dev/null
    cp "$E2E_TMP/snaps.json" "$E2E_TMP/snaps.before"
    "$CVOL" snapshot delete "$POOL" default@one >"$E2E_TMP/del.out" 2>&1 || rc=$?
    ((rc == 2)) || fail "deleting default@one with a clone: exit $rc, expected 2: $(cat "$E2E_TMP/del.out")"
    grep -qF "snapshot 'default@one' has clones that read through it (c1)" "$E2E_TMP/del.out" ||
        fail "the refusal does not name the clone c1: $(cat "$E2E_TMP/del.out")"
    snap_names >/dev/null
    cmp -s "$E2E_TMP/snaps.before" "$E2E_TMP/snaps.json" || fail "a refused delete changed the snapshot list"
    log "refused: $(grep -v ' INFO \| WARN ' "$E2E_TMP/del.out" | head -n 1)"

    step "delete: u@s made to hold 32 MiB alone; c1, then every snapshot deleted"
    cv volume delete "$POOL" c1
    cv volume create "$POOL" u --size 64M
    head -c $((32 * MIB)) /dev/urandom >"$E2E_TMP/u.bin"
    nbdcopy --flush "$E2E_TMP/u.bin" "$(uri u)" || fail "writing u failed"
    cv snapshot create "$POOL" u@s
    head -c $((32 * MIB)) /dev/urandom >"$E2E_TMP/u.bin"
    nbdcopy --flush "$E2E_TMP/u.bin" "$(uri u)" || fail "overwriting u failed"
    rm -f "$E2E_TMP/u.bin"
    u=$(snap_stat u@s unique_bytes)
    log "u@s: changed $(mib "$(json_get "$E2E_TMP/sstat.json" changed_bytes)"), unique $(mib "$u")"
    ((u >= 32 * MIB && u <= 33 * MIB)) || fail "u@s holds $u unique bytes, expected 32 MiB (its overwritten random data) plus at most 1 MiB"
    vols=$("$CVOL" volume list "$POOL" --json | "$PY" -c 'import json,sys; print(" ".join(sorted(v["name"] for v in json.load(sys.stdin)["volumes"])))')
    declare -A SHAS
    for v in $vols; do SHAS[$v]=$(sha "$v"); done
    for s in $(snap_names); do
        x=$(snap_stat "$s" unique_bytes)
        unique=$((unique + x))
    done
    before=$(du_b "$POOL")
    log "snapshots $(snap_names): $(mib "$unique") unique; du $(mib "$before")"
    for s in $(snap_names); do cv snapshot delete "$POOL" "$s"; done
    [[ -z $(snap_names) ]] || fail "snapshot list after deleting them all: '$(snap_names)'"
    "$PY" -c 'import json,sys; assert json.load(open(sys.argv[1])) == {"snapshots": []}' "$E2E_TMP/snaps.json" ||
        fail "snapshot list --json is not {\"snapshots\": []}: $(cat "$E2E_TMP/snaps.json")"
    for v in $vols; do [[ $(sha "$v") == "${SHAS[$v]}" ]] || fail "volume $v reads differently after its snapshots were deleted"; done
    log "all deleted; the volumes ($vols) read as before"

    step "delete: the idle cleaner gives the space back"
    settle "$POOL"
    after=$(du_b "$POOL")
    local dead reclaimable live
    dead=$(json_get "$E2E_TMP/stat.json" dead_bytes)
    reclaimable=$(json_get "$E2E_TMP/stat.json" reclaimable_bytes)
    live=$(json_get "$E2E_TMP/stat.json" live_bytes)
    log "du $(mib "$before") -> $(mib "$after") after ${SETTLE_S} s idle; the snapshots held $(mib "$unique") alone (u@s $(mib "$u")); dead left $(mib "$dead")"
    # u@s's data filled segments of its own: the cleaner frees them whole.
    ((before - after >= u * 9 / 10)) ||
        fail "du fell by $(mib $((before - after))), expected at least 90% of u@s's $(mib "$u")"
    # The rest is scattered (bk@b0's 64 KiB chunks): idle cleaning leaves
    # dead space in segments more than 90% live, at most 5% of the live data.
    ((before - after + dead >= unique * 9 / 10)) ||
        fail "du fell by $(mib $((before - after))) and $(mib "$dead") is dead: less than 90% of the $(mib "$unique") the snapshots held alone"
    ((reclaimable * 20 <= live)) ||
        fail "idle cleaning settled with $(mib "$reclaimable") reclaimable > 5% of the $(mib "$live") live"
    halt
    cvol_check "$POOL"
}

for p in $PARTS; do timed "part_$p"; done
halt
# A pool table whose other slot holds the previous generation is the normal
# state after any change: no warning about it.
if grep -h "generation in the wrong slot" "$E2E_TMP"/*.err >"$E2E_TMP/slot.txt" 2>/dev/null; then
    fail "$(wc -l <"$E2E_TMP/slot.txt") server log line(s) warn about the pool table although nothing was torn or damaged: $(head -n 1 "$E2E_TMP/slot.txt")"
fi
summary=""
for p in $PARTS; do summary+="$p ${TOOK[part_$p]}s, "; done
pass "${summary}total $(($(date +%s) - T_START))s"
