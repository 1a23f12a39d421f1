#!/usr/bin/env bash
# Scrub: real data written with nbdcopy; `cvol scrub` on the served volume
# reports it clean (exit 0), also rate-limited in the background
# (--no-wait, --status, a second request answers "already running", stat
# shows the progress; SIGTERM during a scrub still exits 0).  Then one DATA
# record's payload byte is flipped in the backing file while the server is
# stopped: served again, `cvol scrub` exits 1 and names the record's LBAs,
# every other range reads back exact (nbdcopy of the gaps through nbdkit's
# offset filter), a read of a damaged block fails and the server keeps
# serving; offline `cvol scrub` and `cvol check` agree.
#
#   E2E_SCRUB_MB   data size in MiB (default 16)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy
need nbdkit
need tar
need_server
is_cvol || skip "cvol only: scrub has no stand-in"

MB=${E2E_SCRUB_MB:-16}
BYTES=$((MB * 1024 * 1024))
VOL=$E2E_TMP/vol.cvol
tar_image doc "$MB" /usr/share/doc /usr/share
IMG=$TAR_IMAGE

stat_get() { cvol_stat_json "$VOL" "$E2E_TMP/stat.json"; json_get "$E2E_TMP/stat.json" "$1"; }

# read_range OFFSET LENGTH OUT -- nbdcopy a byte range of the served volume
read_range() {
    nbdcopy -- [ nbdkit --exit-with-parent --filter=offset nbd socket="$SRV_SOCK" \
        offset="$1" range="$2" ] "$3"
}

step "write $MB MiB of real data (nbdcopy), scrub while served"
make_volume "$VOL" $((MB * 4))M --codec lz4
start_server "$VOL"
nbdcopy "$IMG" "$SRV_URI" || fail "nbdcopy in"
rc=0
"$CVOL" scrub "$VOL" --rate 0 >"$E2E_TMP/scrub1.txt" 2>&1 || rc=$?
cat "$E2E_TMP/scrub1.txt"
((rc == 0)) || fail "scrub of an intact served volume exited $rc"
grep -q ": clean (" "$E2E_TMP/scrub1.txt" || fail "scrub did not say clean"
"$CVOL" scrub "$VOL" --rate 0 --json >"$E2E_TMP/scrub1.json" || fail "scrub --json exited $?"
checked=$(json_get "$E2E_TMP/scrub1.json" blocks_checked)
[[ $(json_get "$E2E_TMP/scrub1.json" served) == True ]] || fail "scrub --json: not served"
((checked >= MB * 256 * 9 / 10)) || fail "scrub checked only $checked blocks of $((MB * 256))"

step "background scrub at 4M/s: --no-wait, already running, progress in stat, --status"
"$CVOL" scrub "$VOL" --rate 4M --no-wait >"$E2E_TMP/nowait.txt" || fail "scrub --no-wait exited $?"
grep -q "started" "$E2E_TMP/nowait.txt" || fail "scrub --no-wait: $(cat "$E2E_TMP/nowait.txt")"
"$CVOL" scrub "$VOL" --no-wait 2>"$E2E_TMP/again.txt" || fail "second scrub --no-wait exited $?"
grep -q "already running" "$E2E_TMP/again.txt" || fail "second scrub: $(cat "$E2E_TMP/again.txt")"
[[ $(stat_get scrub_in_progress) == True ]] || fail "stat: scrub_in_progress is not true"
(($(json_get "$E2E_TMP/stat.json" scrub_total_blocks) >= checked)) || fail "stat: scrub_total_blocks"
not_running() {
    "$CVOL" scrub "$VOL" --status >"$E2E_TMP/status.json" &&
        [[ $(json_get "$E2E_TMP/status.json" running) == False ]]
}
wait_until 120 "the background scrub to finish" not_running
"$PY" - "$E2E_TMP/status.json" <<'EOF' || fail "scrub --status: last report not clean"
import json, sys
r = json.load(open(sys.argv[1]))["last_report"]
assert r["corrupt_blocks"] == 0 and not r["cancelled"] and r["blocks_checked"] > 0, r
EOF
(($(stat_get scrub_runs) == 3)) || fail "stat: scrub_runs $(json_get "$E2E_TMP/stat.json" scrub_runs), expected 3"
# A scrub still running at SIGTERM is cancelled; the server stops cleanly.
"$CVOL" scrub "$VOL" --rate 1M --no-wait >/dev/null || fail "scrub --no-wait exited $?"
stop_server

step "flip one payload byte of a DATA record in the backing file"
read -r AT LBA N < <("$PY" - "$VOL" "$MB" <<'EOF'
import struct, sys
img = open(sys.argv[1], "rb").read()
blocks = int(sys.argv[2]) * 256
magic = struct.pack("<I", 0x524C5643)
i = 1 << 20
while True:
    i = img.find(magic, i)
    if i < 0:
        sys.exit("no DATA record found")
    kind = img[i + 4]
    epoch, = struct.unpack_from("<I", img, i + 12)
    lba, nblocks, plen = struct.unpack_from("<QII", img, i + 24)
    if kind == 1 and 0 < epoch < 100 and 1 <= nblocks <= 16 and 64 <= plen <= 16 * 4096 \
            and blocks // 2 <= lba < blocks:
        print(i + 44 + plen // 2, lba, nblocks)
        break
    i += 1
EOF
)
[[ -n "${AT:-}" ]] || fail "no DATA record found in the backing file"
log "record of lba $LBA (+$N blocks): flipping the byte at $AT"
"$PY" - "$VOL" "$AT" <<'EOF'
import sys
with open(sys.argv[1], "r+b") as f:
    at = int(sys.argv[2]); f.seek(at); b = f.read(1); f.seek(at); f.write(bytes([b[0] ^ 0xFF]))
EOF

step "served again: scrub exits 1 and names the LBAs"
start_server "$VOL"
rc=0
"$CVOL" scrub "$VOL" --rate 0 >"$E2E_TMP/scrub2.txt" 2>&1 || rc=$?
cat "$E2E_TMP/scrub2.txt"
((rc == 1)) || fail "scrub of a damaged volume exited $rc, expected 1"
for ((k = 0; k < N; k++)); do
    grep -q "lba $((LBA + k)) corrupt" "$E2E_TMP/scrub2.txt" || fail "scrub did not name lba $((LBA + k))"
done
rc=0
"$CVOL" scrub "$VOL" --rate 0 --json >"$E2E_TMP/scrub2.json" || rc=$?
((rc == 1)) || fail "scrub --json exited $rc, expected 1"
mapfile -t BAD < <("$PY" - "$E2E_TMP/scrub2.json" "$LBA" "$N" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
lba, n = int(sys.argv[2]), int(sys.argv[3])
bad = sorted(f["lba"] for f in r["corrupt"])
assert set(range(lba, lba + n)) <= set(bad), (bad, lba, n)
assert r["corrupt_blocks"] == len(bad) and len(bad) <= n + 16, r
assert r["unreadable_blocks"] == 0 and not r["metadata_errors"] and not r["clean"], r
print("\n".join(map(str, bad)))
EOF
) || fail "scrub --json report"
log "corrupt blocks reported: ${BAD[*]}"
(($(stat_get scrub_corrupt_blocks) == 2 * ${#BAD[@]})) || fail "stat: scrub_corrupt_blocks"
(($(json_get "$E2E_TMP/stat.json" corrupt_reads) == 0)) || fail "stat: scrub findings counted as corrupt_reads"

step "every other range reads back exact; a damaged block fails; the server keeps serving"
start=0
for b in "${BAD[@]}" $((MB * 256)); do
    if ((b > start)); then
        read_range $((start * 4096)) $(((b - start) * 4096)) "$E2E_TMP/range.bin" ||
            fail "reading blocks $start..$b failed"
        cmp -s "$E2E_TMP/range.bin" <(tail -c +$((start * 4096 + 1)) "$IMG" | head -c $(((b - start) * 4096))) ||
            fail "blocks $start..$b read back wrong"
    fi
    start=$((b + 1))
done
if read_range $((LBA * 4096)) 4096 "$E2E_TMP/bad.bin" 2>/dev/null; then
    fail "a read of damaged lba $LBA succeeded"
fi
(($(stat_get corrupt_reads) >= 1)) || fail "stat: the refused read is not in corrupt_reads"
read_range 0 65536 "$E2E_TMP/range.bin" || fail "the server stopped serving after a corrupt read"
cmp -s "$E2E_TMP/range.bin" <(head -c 65536 "$IMG") || fail "first 64 KiB wrong after a corrupt read"
stop_server

step "offline: cvol scrub and cvol check agree"
rc=0
"$CVOL" scrub "$VOL" --rate 0 >"$E2E_TMP/scrub3.txt" 2>&1 || rc=$?
((rc == 1)) || { cat "$E2E_TMP/scrub3.txt"; fail "offline scrub exited $rc, expected 1"; }
grep -q "lba $LBA corrupt" "$E2E_TMP/scrub3.txt" || fail "offline scrub did not name lba $LBA"
rc=0
"$CVOL" check "$VOL" >"$E2E_TMP/check.txt" 2>&1 || rc=$?
((rc == 1)) || { cat "$E2E_TMP/check.txt"; fail "cvol check exited $rc, expected 1"; }
grep -q "lba $LBA " "$E2E_TMP/check.txt" || fail "cvol check did not name lba $LBA"

pass "$checked blocks scrubbed clean; a flipped byte cost lba $LBA+$N (${#BAD[@]} blocks reported), the rest read back exact"
