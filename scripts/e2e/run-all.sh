#!/usr/bin/env bash
# Run the cvol end-to-end tests and print a summary.
#
#   scripts/e2e/run-all.sh            # every test
#   scripts/e2e/run-all.sh NAME...    # only these (e.g. qemu-io or qemu-io.sh)
#
# Environment: see lib.sh (CVOL, E2E_SERVER=cvol|nbdkit, E2E_KEEP, ...) and
# each test's header.  E2E_TEST_TIMEOUT bounds each test (default 300s).
# Exit status: 0 if no test failed (skips are allowed), 1 otherwise.
set -euo pipefail

DIR=$(cd "$(dirname "$0")" && pwd)
ALL=(cli bad-input hostile-local nbdinfo qemu-io nbdcopy fio ext4 ext4-paged kill9 pools snapshots metadata-device overwrite thin-full trim-du dedup dedup-window estimate elastic idle-space scrub bitrot cache tls encryption service package s3-fencing s3)
TIMEOUT=${E2E_TEST_TIMEOUT:-300}
: "${E2E_SERVER:=cvol}"
export E2E_SERVER

if (($#)); then
    TESTS=()
    for t in "$@"; do
        t=${t%.sh}
        t=${t##*/}
        [[ -f "$DIR/$t.sh" && "$t" != lib && "$t" != run-all ]] || {
            echo "unknown test '$t' (known: ${ALL[*]})" >&2
            exit 2
        }
        TESTS+=("$t")
    done
else
    TESTS=("${ALL[@]}")
fi

echo "cvol e2e: server=$E2E_SERVER cvol=${CVOL:-<repo>/target/release/cvol} tests: ${TESTS[*]}"
declare -A RESULT DURATION
npass=0 nfail=0 nskip=0
t_start=$(date +%s)
for t in "${TESTS[@]}"; do
    echo
    echo "=================== $t ==================="
    t0=$(date +%s)
    rc=0
    # timeout signals the test's whole process group; lib.sh's traps clean up.
    timeout -k 15 "$TIMEOUT" bash "$DIR/$t.sh" </dev/null || rc=$?
    DURATION[$t]=$(($(date +%s) - t0))
    case $rc in
        0)
            RESULT[$t]=PASS
            npass=$((npass + 1))
            ;;
        77)
            RESULT[$t]=SKIP
            nskip=$((nskip + 1))
            ;;
        124 | 137)
            RESULT[$t]="FAIL (timed out after ${TIMEOUT}s)"
            nfail=$((nfail + 1))
            ;;
        *)
            RESULT[$t]="FAIL (exit $rc)"
            nfail=$((nfail + 1))
            ;;
    esac
done

echo
echo "=================== summary (server=$E2E_SERVER) ==================="
for t in "${TESTS[@]}"; do
    printf '  %-10s %-28s %4ss\n' "$t" "${RESULT[$t]}" "${DURATION[$t]}"
done
echo "  total time: $(($(date +%s) - t_start))s"
echo "e2e: $npass passed, $nfail failed, $nskip skipped"
((nfail == 0))
