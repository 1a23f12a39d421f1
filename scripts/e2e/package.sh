#!/usr/bin/env bash
# package: the Debian package (scripts/package, cargo-deb) installs and works.
# Builds it (a release build), installs it with dpkg, checks what it put
# where (binary, unit, man pages, completions, example config, dashboard),
# verifies the unit with systemd-analyze, serves a volume with the
# installed binary the way the unit would (CVOL_VOLUME/CVOL_ARGS from an
# /etc/cvol-style environment file), then removes the package.
#
# Needs root and dpkg, and runs only with E2E_PACKAGE=1: it makes a
# release build and, when missing, installs cargo-deb (minutes that CI does
# not have). Run it by hand: `E2E_PACKAGE=1 scripts/e2e/run-all.sh package`.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

is_cvol || skip "cvol-only test (packaging)"
need_root
need dpkg
need nbdinfo
if [[ "${E2E_PACKAGE:-0}" != 1 ]]; then
    skip "E2E_PACKAGE=1 runs it (a release build, cargo-deb)"
fi
if dpkg -s cvol >/dev/null 2>&1; then
    skip "a cvol package is installed already; not touching it"
fi

step "scripts/package"
deb=$("$E2E_REPO_ROOT/scripts/package" 2>"$E2E_TMP/package.err") ||
    fail "scripts/package failed: $(tail -n 20 "$E2E_TMP/package.err")"
log "built $deb ($(stat -c %s "$deb") bytes)"
dpkg-deb --info "$deb" | sed -n '1,20p'

_purge() { dpkg -r cvol >/dev/null 2>&1 || true; }
trap 'rc=$?; _purge; (exit "$rc"); _on_exit' EXIT

step "dpkg -i"
dpkg -i "$deb" >"$E2E_TMP/dpkg.out" 2>&1 || fail "dpkg -i: $(cat "$E2E_TMP/dpkg.out")"
for f in /usr/bin/cvol /lib/systemd/system/cvol@.service \
    /usr/share/man/man1/cvol.1.gz /usr/share/man/man1/cvol-serve.1.gz \
    /usr/share/bash-completion/completions/cvol \
    /usr/share/doc/cvol/examples/example.conf \
    /usr/share/doc/cvol/examples/grafana-dashboard.json; do
    [[ -e "$f" ]] || fail "the package did not install $f"
done
/usr/bin/cvol --version | grep -q "^cvol " || fail "/usr/bin/cvol --version"
size=$(stat -c %s /usr/bin/cvol)
((size < 40 * 1024 * 1024)) || fail "/usr/bin/cvol is $size bytes: not stripped?"
if command -v man >/dev/null 2>&1; then
    man -w cvol-serve >/dev/null 2>&1 || fail "man cannot find cvol-serve"
fi
if command -v systemd-analyze >/dev/null 2>&1; then
    systemd-analyze verify --man=no /lib/systemd/system/cvol@test.service >"$E2E_TMP/verify.out" 2>&1 ||
        fail "systemd-analyze verify: $(cat "$E2E_TMP/verify.out")"
fi

step "serve the way the unit does: the environment file, then ExecStart"
VOL=$E2E_TMP/pkg.cvol
/usr/bin/cvol create "$VOL" --size 64M >/dev/null || fail "installed cvol create"
SOCK=$E2E_TMP/pkg.sock
cat >"$E2E_TMP/pkg.conf" <<EOF
CVOL_VOLUME="$VOL"
CVOL_ARGS="--socket $SOCK"
EOF
(
    set -a
    # shellcheck disable=SC1091
    . "$E2E_TMP/pkg.conf"
    set +a
    # shellcheck disable=SC2086  # CVOL_ARGS is word-split, as systemd does with $CVOL_ARGS
    exec /usr/bin/cvol serve "$CVOL_VOLUME" $CVOL_ARGS
) >"$E2E_TMP/pkg.out" 2>"$E2E_TMP/pkg.err" &
SRV_PID=$!
reg_pid "$SRV_PID"
wait_until 30 "the installed server's socket" test -S "$SOCK"
nbdinfo "nbd+unix:///?socket=$SOCK" | grep -q "export-size: 67108864" || fail "nbdinfo against the installed server"
stop_server

step "dpkg -r"
dpkg -r cvol >"$E2E_TMP/dpkg-r.out" 2>&1 || fail "dpkg -r: $(cat "$E2E_TMP/dpkg-r.out")"
[[ ! -e /usr/bin/cvol && ! -e /lib/systemd/system/cvol@.service ]] || fail "files left after dpkg -r"
pass
