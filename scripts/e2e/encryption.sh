#!/usr/bin/env bash
# Encryption at rest (`cvol create --encryption C --key-file K`), with stock
# clients on unix sockets:
#
#   clear     a volume in the clear (`--codec none`) gets E2E_ENC_MB MiB of
#             real data (a tar of /usr/share/doc) by nbdcopy --flush: every
#             one of eight distinctive 48-byte strings of the data (printable,
#             16+ different characters, inside one 4 KiB block) is found in the
#             backing file by `grep -c -F -a`: the search works
#   ciphers   for aes-256-gcm (raw 32-byte key file, `--codec none`: the
#             bytes would be stored as they are) and chacha20-poly1305
#             (a passphrase key file, default codec): create, serve
#             `--key-file`, the same data in (nbdcopy --flush) and out, cmp
#             equal; stopped: not one of the strings is in the backing file;
#             `cvol check --key-file` passes; `cvol stat` without the key
#             names the cipher and the physical size and asks for
#             `--key-file` for the rest
#   refusals  serve and check without a key (exit 2, "encrypted" and
#             "--key-file"), with a wrong key, also through CVOL_KEY_FILE
#             (exit 2, "wrong key"), a key for the volume in the clear
#             (exit 2, "not encrypted"), a too short passphrase file (exit
#             2, "passphrase"): every time the file's sha256 is unchanged and no socket
#             is left
#   rotate    `cvol key rotate --key-file OLD --new-key-file NEW` (a
#             passphrase): only the two superblock copies (first 8 KiB)
#             change; a rotation with a wrong old key is refused (exit 2,
#             "wrong key", file unchanged); the old key is then refused, the
#             new one (through CVOL_KEY_FILE, and with its trailing newline
#             left off) opens, reads the same data and checks clean; `serve`
#             takes it from $CREDENTIALS_DIRECTORY/cvol.key (systemd
#             LoadCredential) when given no key file
#
#   E2E_ENC_MB   MiB of real data (default 24)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need nbdcopy sha256sum cmp grep tar
need_server
is_cvol || skip "cvol only: encryption has no stand-in"

MB=${E2E_ENC_MB:-24}
CLEAR=$E2E_TMP/clear.cvol
OUT=$E2E_TMP/out.bin
NEEDLES=$E2E_TMP/needles
PASS='correct horse battery staple, twice'

tar_image usr-doc "$MB" /usr/share/doc
DATA=$TAR_IMAGE
WANT_SHA=$(sha256sum "$DATA" | cut -d' ' -f1)

# Eight distinctive strings of the data (py/needles.py: 48 printable bytes,
# inside one 4 KiB block, stored whole in the clear with --codec none).
"$PY" "$E2E_DIR/py/needles.py" "$DATA" "$NEEDLES" 8 || fail "no search strings in $DATA"
[[ $(wc -l <"$NEEDLES") -eq 8 ]] || fail "expected 8 search strings, got $(wc -l <"$NEEDLES")"

# plaintext_hits FILE -- prints, per search string, how often it occurs in FILE
plaintext_hits() {
    local s counts=()
    while IFS= read -r s; do
        counts+=("$(grep -c -F -a -e "$s" "$1" || true)")
    done <"$NEEDLES"
    echo "${counts[*]}"
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# copy_in_out LABEL -- the data into $SRV_URI (flushed) and back out, equal
copy_in_out() {
    nbdcopy --flush "$DATA" "$SRV_URI" || fail "$1: nbdcopy into the volume failed"
    rm -f "$OUT"
    nbdcopy "$SRV_URI" "$OUT" || fail "$1: nbdcopy out of the volume failed"
    cmp "$DATA" "$OUT" || fail "$1: the data read back differs"
    rm -f "$OUT"
    log "$1: $MB MiB in and out, equal"
}

# read_back LABEL -- the volume served at $SRV_URI reads as the data
read_back() {
    rm -f "$OUT"
    nbdcopy "$SRV_URI" "$OUT" || fail "$1: nbdcopy out of the volume failed"
    [[ $(sha "$OUT") == "$WANT_SHA" ]] || fail "$1: the data read back differs"
    rm -f "$OUT"
    log "$1: reads back the same data"
}

# refused RC FILE 'PATTERN;PATTERN...' CMD... -- CMD exits RC (within 60 s)
# with every PATTERN (fixed, case-insensitive) in its output; FILE's sha256
# is unchanged and no socket is left in $E2E_TMP
refused() {
    local want=$1 file=$2 pats=$3 before rc=0 p what out=$E2E_TMP/refused.out
    shift 3
    what="$*"
    what=${what//"$CVOL"/cvol}
    what=${what//$E2E_TMP\//}
    before=$(sha "$file")
    timeout 60 "$@" >"$out" 2>&1 </dev/null || rc=$?
    ((rc == want)) || fail "'$what' exited $rc, expected $want: $(head -c 600 "$out")"
    IFS=';' read -ra list <<<"$pats"
    for p in "${list[@]}"; do
        grep -qiF -e "$p" "$out" || fail "'$what': no '$p' in its message: $(head -c 600 "$out")"
    done
    [[ $(sha "$file") == "$before" ]] || fail "'$what' changed ${file##*/}"
    [[ -z $(find "$E2E_TMP" -maxdepth 1 -name '*.sock') ]] || fail "'$what' left a socket"
    log "refused (exit $rc): $what -- $(grep -v '^\s*$' "$out" | head -n 1 | sed "s|$E2E_TMP/||g" | cut -c1-140)"
}

# ---------------------------------------------------------------- clear ----
step "clear: $MB MiB of real data into a volume in the clear (--codec none)"
make_volume "$CLEAR" "${MB}M" --physical-size 64M --codec none
start_server "$CLEAR"
copy_in_out clear
stop_server
hits=$(plaintext_hits "$CLEAR")
log "clear: the search strings occur ($hits) times in the backing file"
[[ " $hits " != *" 0 "* ]] || fail "a search string is missing from the volume in the clear ($hits): the search cannot prove anything"

# -------------------------------------------------------------- ciphers ----
umask 077
head -c 32 /dev/urandom >"$E2E_TMP/aes.key"
head -c 32 /dev/urandom >"$E2E_TMP/other.key"
printf '%s\n' "$PASS" >"$E2E_TMP/chacha.pass"
declare -A KEY=([aes-256-gcm]=$E2E_TMP/aes.key [chacha20-poly1305]=$E2E_TMP/chacha.pass)
declare -A CODEC=([aes-256-gcm]=none [chacha20-poly1305]=auto)
declare -A VOL=([aes-256-gcm]=$E2E_TMP/aes.cvol [chacha20-poly1305]=$E2E_TMP/chacha.cvol)
for c in aes-256-gcm chacha20-poly1305; do
    step "$c: create (--codec ${CODEC[$c]}), serve, copy in and out, search the file"
    make_volume "${VOL[$c]}" "${MB}M" --physical-size 64M --codec "${CODEC[$c]}" --encryption "$c" --key-file "${KEY[$c]}"
    start_server "${VOL[$c]}" --key-file "${KEY[$c]}"
    copy_in_out "$c"
    stop_server
    hits=$(plaintext_hits "${VOL[$c]}")
    log "$c: the search strings occur ($hits) times in the backing file"
    [[ "$hits" == "0 0 0 0 0 0 0 0" ]] || fail "$c: plaintext of the data is in the backing file ($hits)"
    "$CVOL" check "${VOL[$c]}" --key-file "${KEY[$c]}" >"$E2E_TMP/check.out" 2>&1 ||
        fail "$c: cvol check --key-file failed: $(tail -n 5 "$E2E_TMP/check.out")"
    log "$c: cvol check --key-file: ok"
    before=$(sha "${VOL[$c]}")
    "$CVOL" stat "${VOL[$c]}" >"$E2E_TMP/stat.out" 2>&1 ||
        fail "$c: cvol stat without the key exited $?: $(cat "$E2E_TMP/stat.out")"
    for p in "$c" "64.0 MiB" "--key-file"; do
        grep -qiF -e "$p" "$E2E_TMP/stat.out" || fail "$c: cvol stat without the key does not say '$p': $(cat "$E2E_TMP/stat.out")"
    done
    [[ $(sha "${VOL[$c]}") == "$before" ]] || fail "$c: cvol stat without the key changed the file"
    log "$c: stat without the key: $(tr '\n' ' ' <"$E2E_TMP/stat.out" | tr -s ' ' | cut -c1-200)"
done

# ------------------------------------------------------------- refusals ----
step "refusals: no key, a wrong key, a key for a volume in the clear, a short passphrase"
AES=${VOL[aes-256-gcm]}
refused 2 "$AES" "encrypted;--key-file" "$CVOL" serve "$AES" --socket "$E2E_TMP/r.sock"
refused 2 "$AES" "encrypted;--key-file" "$CVOL" check "$AES"
refused 2 "$AES" "wrong key" "$CVOL" serve "$AES" --socket "$E2E_TMP/r.sock" --key-file "$E2E_TMP/other.key"
refused 2 "$AES" "wrong key" "$CVOL" check "$AES" --key-file "$E2E_TMP/chacha.pass"
refused 2 "$AES" "wrong key" env CVOL_KEY_FILE="$E2E_TMP/other.key" "$CVOL" serve "$AES" --socket "$E2E_TMP/r.sock"
refused 2 "$CLEAR" "not encrypted" "$CVOL" serve "$CLEAR" --socket "$E2E_TMP/r.sock" --key-file "$E2E_TMP/aes.key"
refused 2 "$CLEAR" "not encrypted" env CVOL_KEY_FILE="$E2E_TMP/aes.key" "$CVOL" check "$CLEAR"
printf 'short\n' >"$E2E_TMP/short.pass"
refused 2 "$AES" "passphrase" "$CVOL" serve "$AES" --socket "$E2E_TMP/r.sock" --key-file "$E2E_TMP/short.pass"

# --------------------------------------------------------------- rotate ----
step "rotate: the aes-256-gcm volume's raw key to a passphrase"
printf '%s\n' "$PASS rotated" >"$E2E_TMP/new.pass"
printf '%s' "$PASS rotated" >"$E2E_TMP/new-nonl.pass"
cp "$AES" "$E2E_TMP/before-rotate.cvol"
refused 2 "$AES" "wrong key" "$CVOL" key rotate "$AES" --key-file "$E2E_TMP/other.key" --new-key-file "$E2E_TMP/new.pass"
"$CVOL" key rotate "$AES" --key-file "$E2E_TMP/aes.key" --new-key-file "$E2E_TMP/new.pass" \
    >"$E2E_TMP/rotate.out" 2>&1 || fail "cvol key rotate failed: $(cat "$E2E_TMP/rotate.out")"
# cmp -l: 1-based offsets of the bytes that differ
changed=$(cmp -l "$E2E_TMP/before-rotate.cvol" "$AES" | awk '{ n++; if ($1 > m) m = $1 } END { print n + 0, m + 0 }' || true)
read -r nchanged last <<<"$changed"
log "rotate: $nchanged bytes changed, the last at offset $((last - 1))"
((nchanged > 0 && last <= 8192)) || fail "key rotate changed $nchanged bytes up to offset $last (expected some, all in the superblocks' first 8 KiB)"
rm -f "$E2E_TMP/before-rotate.cvol"
refused 2 "$AES" "wrong key" "$CVOL" serve "$AES" --socket "$E2E_TMP/r.sock" --key-file "$E2E_TMP/aes.key"
CVOL_KEY_FILE=$E2E_TMP/new.pass start_server "$AES"
read_back "rotated, CVOL_KEY_FILE"
stop_server
"$CVOL" check "$AES" --key-file "$E2E_TMP/new-nonl.pass" >"$E2E_TMP/check.out" 2>&1 ||
    fail "cvol check with the new passphrase without its newline failed: $(tail -n 5 "$E2E_TMP/check.out")"
log "rotated: cvol check with the passphrase without its trailing newline: ok"

step "serve: the key from \$CREDENTIALS_DIRECTORY/cvol.key"
mkdir -m 700 "$E2E_TMP/cred"
cp "$E2E_TMP/new.pass" "$E2E_TMP/cred/cvol.key"
CREDENTIALS_DIRECTORY=$E2E_TMP/cred start_server "$AES"
read_back "credential"
stop_server

pass "aes-256-gcm and chacha20-poly1305: no plaintext in the file, refusals, rotation"
