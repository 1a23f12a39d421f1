#!/usr/bin/env bash
# qemu-io: patterned writes at aligned and unaligned offsets, write-zeroes,
# discard; verify; restart the server (SIGTERM + serve again); verify again.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need qemu-io
need_server

SIZE=64M
VOL=$E2E_TMP/vol.cvol

# Operations, applied in order: "W PATTERN OFFSET LENGTH" (write -P),
# "Z OFFSET LENGTH" (write -z), "D OFFSET LENGTH" (discard, must read back as
# zeroes: 1 MiB aligned so it covers whole blocks), "d OFFSET LENGTH" (small
# unaligned discard: NBD makes trim advisory, so each 4 KiB piece may read back
# as zeroes or as the old data, but nothing else).
OPS=(
    "W 0x11 0 4096"
    "W 0x22 4096 65536"
    "W 0x33 1000 3000"        # unaligned, inside the first 4 KiB
    "W 0x44 8190 10"          # crosses the 8 KiB boundary
    "W 0x55 131071 131074"    # crosses two 64 KiB boundaries, odd head/tail
    "W 0x66 1048575 1"        # single byte before the 1 MiB mark
    "W 0x77 2097152 3145728"  # 2 MiB .. 5 MiB, aligned
    "W 0x88 5000000 777777"   # unaligned, overlaps the end of 0x77
    "W 0x99 67104768 4096"    # last 4 KiB of the device
    "W 0xaa 67108863 1"       # last byte
    "W 0xbb 40000 100000"     # overwrites parts of 0x22 / zero area
    "Z 2101248 8192"          # write-zeroes, 4 KiB aligned
    "Z 2359297 4097"          # write-zeroes, unaligned
    "D 3145728 1048576"       # discard 3 MiB .. 4 MiB
    "d 4500001 4095"          # small unaligned discard
)

qio() {
    local out=$E2E_TMP/qemu-io.out rc=0
    qemu-io -f raw "$@" "$SRV_URI" >"$out" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]] || grep -qiE 'fail|error|mismatch' "$out"; then
        cat "$out"
        fail "qemu-io $* (exit $rc)"
    fi
}

# qio_ok ARGS -- like qio, but return non-zero instead of failing.
qio_ok() {
    local out=$E2E_TMP/qemu-io.out rc=0
    qemu-io -f raw "$@" "$SRV_URI" >"$out" 2>&1 || rc=$?
    [[ $rc -eq 0 ]] && ! grep -qiE 'fail|error|mismatch' "$out"
}

# Compute the expected layout: strict ranges "S BYTE OFF LEN" and lenient
# 4 KiB pieces "L OLDBYTE OFF LEN".
"$PY" - "$(to_bytes "$SIZE")" "${OPS[@]}" >"$E2E_TMP/expect.txt" <<'PYEOF'
import sys
size = int(sys.argv[1])
mem = bytearray(size)
lenient = []  # (off, len, old_byte)
for op in sys.argv[2:]:
    f = op.split()
    if f[0] == "W":
        p, o, l = int(f[1], 16), int(f[2]), int(f[3])
        mem[o:o + l] = bytes([p]) * l
    elif f[0] in ("Z", "D"):
        o, l = int(f[1]), int(f[2])
        mem[o:o + l] = bytes(l)
    elif f[0] == "d":
        o, l = int(f[1]), int(f[2])
        end = o + l
        while o < end:
            n = min(end, (o // 4096 + 1) * 4096) - o
            olds = set(mem[o:o + n])
            assert len(olds) == 1, "lenient piece must have uniform old content"
            lenient.append((o, n, olds.pop()))
            o += n
# Content is uniform between operation boundaries: walk the segments.
cuts = {0, size}
for op in sys.argv[2:]:
    f = op.split()
    o, l = (int(f[2]), int(f[3])) if f[0] == "W" else (int(f[1]), int(f[2]))
    cuts.update((o, o + l))
for o, n, _ in lenient:
    cuts.update((o, o + n))
lenient_starts = {o for o, _, _ in lenient}
cuts = sorted(cuts)
runs = []  # [byte, off, len]
for a, b in zip(cuts, cuts[1:]):
    if a in lenient_starts:
        continue
    if runs and runs[-1][0] == mem[a] and runs[-1][1] + runs[-1][2] == a:
        runs[-1][2] += b - a
    else:
        runs.append([mem[a], a, b - a])
for p, o, l in runs:
    print("S 0x%02x %d %d" % (p, o, l))
for o, n, old in lenient:
    print("L 0x%02x %d %d" % (old, o, n))
PYEOF

declare -A LENIENT_STATE=()
verify_all() {
    local cmds=() kind p o l nl=0 state
    while read -r kind p o l; do
        case "$kind" in
            S) cmds+=(-c "read -q -P $p $o $l") ;;
            L)
                if qio_ok -c "read -q -P 0 $o $l"; then
                    state=zero
                elif qio_ok -c "read -q -P $p $o $l"; then
                    state=old
                    log "discarded piece $o+$l still holds old data $p (allowed: trim is advisory)"
                else
                    fail "discarded piece $o+$l reads back as neither zeroes nor the old data $p"
                fi
                # whatever it reads as, it must read the same after a restart
                if [[ -n "${LENIENT_STATE[$o]:-}" && "${LENIENT_STATE[$o]}" != "$state" ]]; then
                    fail "discarded piece $o+$l read as ${LENIENT_STATE[$o]} before the restart but as $state after"
                fi
                LENIENT_STATE[$o]=$state
                nl=$((nl + 1))
                ;;
        esac
    done <"$E2E_TMP/expect.txt"
    qio "${cmds[@]}"
    log "verified $((${#cmds[@]} / 2)) strict ranges + $nl discarded pieces over the whole device"
}

make_volume "$VOL" "$SIZE"
start_server "$VOL"

step "apply ${#OPS[@]} operations (writes aligned/unaligned, write -z, discard)"
for op in "${OPS[@]}"; do
    read -r kind a b c <<<"$op"
    case "$kind" in
        W)
            qio -c "write -q -P $a $b $c"
            # immediately read back each write
            qio -c "read -q -P $a $b $c"
            ;;
        Z)
            qio -c "write -q -z $a $b"
            qio -c "read -q -P 0 $a $b"
            ;;
        D)
            qio -c "discard -q $a $b"
            qio -c "read -q -P 0 $a $b"
            ;;
        d) qio -c "discard -q $a $b" ;;
    esac
done

step "verify whole device"
verify_all
qio -c "flush"

step "restart server (SIGTERM, serve again) and verify again"
stop_server
start_server "$VOL"
verify_all
stop_server
cvol_check "$VOL"
pass
