#!/usr/bin/env bash
# bitrot: bit rot in the backing file never makes cvol drop flushed data
# silently. A volume gets 64 MiB of real file-system data as 4 KiB writes
# through libnbd, a FLUSH and a clean stop; then, per seed, a copy of the
# backing file (192 MiB physical, so copies and compares stay cheap) gets
# one byte flipped at 24 random offsets inside non-zero 4 KiB blocks past
# its first MiB, and:
#   - `cvol check` exits 1 (it never calls a damaged volume consistent);
#   - `cvol serve` either opens it, and then every block reads exactly what
#     was flushed or fails with EIO (never zeros or other data; each EIO
#     block one that check names: a damaged record's, or one whose map page
#     is damaged in the checkpoint open takes), or refuses
#     to open (exit 2, naming `cvol check --repair`) having changed nothing;
#     then `cvol check --repair --json` lists the lost LBAs, and served
#     again, every block reads exact or EIO, and every EIO block is one that
#     repair listed as lost or check names as damaged.
#
#   E2E_BITROT_SEEDS  seeds (default 30: about a minute; 2 s a seed)
#   E2E_BITROT_FLIPS  damaged bytes per seed (default 24)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need_nbd_python
is_cvol || skip "cvol-only test (check, repair, refusal to open)"

SEEDS=${E2E_BITROT_SEEDS:-30}
FLIPS=${E2E_BITROT_FLIPS:-24}
CLIENT=$E2E_DIR/py/bitrot_client.py
VOL=$E2E_TMP/pristine.cvol
WORK=$E2E_TMP/work.cvol

tar_image usr-doc 64 /usr/share /usr/lib
DATA=$TAR_IMAGE

step "write 64 MiB of real data as 4 KiB writes, FLUSH, clean stop"
make_volume "$VOL" 1G --physical-size 192M
start_server "$VOL"
"$NBD_PY" "$CLIENT" write "$SRV_URI" "$DATA"
stop_server

# serve_try VOLUME -- starts a server; sets SRV_URI and returns 0 when it
# serves, or returns 1 (its stderr in $E2E_TMP/try.err) when it exits.
serve_try() {
    local out=$E2E_TMP/try.out deadline
    : >"$out"
    SRV_SOCK=$E2E_TMP/try.sock
    rm -f "$SRV_SOCK"
    "$CVOL" serve "$1" --socket "$SRV_SOCK" >"$out" 2>"$E2E_TMP/try.err" &
    SRV_PID=$!
    reg_pid "$SRV_PID"
    deadline=$(($(date +%s) + E2E_READY_TIMEOUT))
    while :; do
        SRV_URI=$(grep -m1 -E '^nbd\+unix://' "$out" 2>/dev/null || true)
        [[ -n "$SRV_URI" ]] && return 0
        if ! _alive "$SRV_PID"; then
            TRY_RC=0
            wait "$SRV_PID" || TRY_RC=$?
            unreg_pid "$SRV_PID"
            SRV_PID=""
            return 1
        fi
        (($(date +%s) < deadline)) || fail "serve neither served nor exited"
        sleep 0.05
    done
}

# eio_within LIST WHY -- every block that read as EIO ($E2E_TMP/eio) is in LIST.
eio_within() {
    [[ -s "$E2E_TMP/eio" ]] || return 0
    local extra
    extra=$(sort -u "$E2E_TMP/eio" | comm -23 - <(sort -u "$1") | head -5)
    [[ -z "$extra" ]] || fail "seed $seed: blocks $extra read as EIO but $2"
    eio_total=$((eio_total + $(wc -l <"$E2E_TMP/eio")))
}

opened=0 refused=0 lost_total=0 eio_total=0
for seed in $(seq 1 "$SEEDS"); do
    cp --sparse=always "$VOL" "$WORK"
    "$NBD_PY" "$CLIENT" flip "$WORK" "$seed" "$FLIPS" >/dev/null
    rc=0
    "$CVOL" check "$WORK" --json >"$E2E_TMP/check.json" 2>"$E2E_TMP/check.err" || rc=$?
    [[ $rc -eq 1 ]] || fail "seed $seed: check exited $rc on a damaged volume (want 1): $(head -c 400 "$E2E_TMP/check.json")"
    "$PY" - "$E2E_TMP/check.json" >"$E2E_TMP/named" <<'PYEOF'
import json, re, sys
rep = json.load(open(sys.argv[1]))
for e in rep["errors"]:
    m = re.match(r"lba (\d+) ", e)
    if m:
        print(m.group(1))
for l in rep.get("lost_lbas", []):
    print(l)
# Blocks whose map page is damaged in the checkpoint open takes.
for first, end in rep.get("damaged_page_lbas", []):
    for l in range(first, end):
        print(l)
PYEOF
    cp --sparse=always "$WORK" "$WORK.before"
    if serve_try "$WORK"; then
        opened=$((opened + 1))
        "$NBD_PY" "$CLIENT" verify "$SRV_URI" "$DATA" "$E2E_TMP/eio" ||
            fail "seed $seed: opened, and flushed data reads wrong (see above)"
        stop_server
        eio_within "$E2E_TMP/named" "check does not name them"
        continue
    fi
    refused=$((refused + 1))
    [[ $TRY_RC -eq 2 ]] || fail "seed $seed: serve exited $TRY_RC (want 2 for a refused open)"
    grep -q 'check --repair' "$E2E_TMP/try.err" ||
        fail "seed $seed: the refusal does not name check --repair: $(tail -c 600 "$E2E_TMP/try.err")"
    cmp -s "$WORK" "$WORK.before" ||
        fail "seed $seed: a refused open changed the volume"
    rc=0
    "$CVOL" check "$WORK" --repair --json >"$E2E_TMP/repair.json" 2>"$E2E_TMP/repair.err" || rc=$?
    [[ $rc -le 1 ]] || fail "seed $seed: check --repair exited $rc: $(cat "$E2E_TMP/repair.err")"
    "$PY" - "$E2E_TMP/repair.json" >"$E2E_TMP/lost" <<'PYEOF'
import json, re, sys
rep = json.load(open(sys.argv[1]))
if rep["unknown_records"]:
    sys.stderr.write(f"repair could not tell the blocks of records {rep['unknown_records']}\n")
for l in rep["lost_lbas"]:
    print(l)
for e in rep["after"]["errors"]:
    m = re.match(r"lba (\d+) ", e)
    if m:
        print(m.group(1))
PYEOF
    lost_total=$((lost_total + $(sort -u "$E2E_TMP/lost" | wc -l)))
    serve_try "$WORK" || fail "seed $seed: still refuses after repair: $(tail -c 600 "$E2E_TMP/try.err")"
    "$NBD_PY" "$CLIENT" verify "$SRV_URI" "$DATA" "$E2E_TMP/eio" ||
        fail "seed $seed: after repair, flushed data reads wrong (see above)"
    stop_server
    eio_within "$E2E_TMP/lost" "repair did not list them"
done
log "$SEEDS seeds: $opened opened (every block exact or EIO), $refused refused then repaired ($lost_total blocks listed lost); $eio_total EIO reads in all"
pass
