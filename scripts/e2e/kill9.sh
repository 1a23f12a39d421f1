#!/usr/bin/env bash
# kill -9 the server while a client writes with periodic flushes; restart and
# check that everything acknowledged as flushed (or written with FUA) survived.
# Repeated E2E_KILL9_ROUNDS times (default 3) on the same volume, plus one
# round with `serve --sync` and no flushes at all (every acknowledged write
# must survive), plus one round where the server gets SIGTERM instead of
# SIGKILL under the same load (it must exit 0 promptly, and every write it
# acknowledged must survive, flushed or not).  After each round the server is
# stopped cleanly and `cvol check` must pass.
#
#   E2E_KILL9_ROUNDS     rounds with flushes (default 3)
#   E2E_KILL9_SYNC_ROUND 0 to skip the extra --sync round (default 1)
#   E2E_KILL9_TERM_ROUND 0 to skip the extra SIGTERM-under-load round (default 1)
#   E2E_KILL9_MIN_SECS   minimum write time before the kill (default 2)
#   E2E_KILL9_MAX_SECS   maximum write time before the kill (default 5)
#   E2E_KILL9_SIZE       volume size (default 64M)
#   E2E_KILL9_PHYS       physical size (default 2G: each round overwrites the
#                        volume several times over; space reclamation under
#                        overwrites is tested by overwrite.sh, not here)
#   E2E_KILL9_METADATA   a --metadata-size: the volume keeps its map and
#                        checkpoints on a separate metadata device file of
#                        that size (metadata-device.sh sets it)
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"

need_nbd_python
need_server

ROUNDS=${E2E_KILL9_ROUNDS:-3}
SYNC_ROUND=${E2E_KILL9_SYNC_ROUND:-1}
TERM_ROUND=${E2E_KILL9_TERM_ROUND:-1}
MIN_SECS=${E2E_KILL9_MIN_SECS:-2}
MAX_SECS=${E2E_KILL9_MAX_SECS:-5}
SIZE=${E2E_KILL9_SIZE:-64M}
PHYS=${E2E_KILL9_PHYS:-2G}
VOL=$E2E_TMP/vol.cvol
CLIENT=$E2E_DIR/py/kill9_client.py
BASELINE=$E2E_TMP/baseline.img # what the previous round verified (none: zeroes)

meta_args=()
if [[ -n ${E2E_KILL9_METADATA:-} ]]; then
    meta_args=(--metadata-device "$E2E_TMP/meta.img" --metadata-size "$E2E_KILL9_METADATA")
fi
make_volume "$VOL" "$SIZE" --physical-size "$PHYS" "${meta_args[@]}"

MODES=()
for _ in $(seq "$ROUNDS"); do MODES+=(flush); done
if ((SYNC_ROUND == 1)); then MODES+=(sync); fi
if ((TERM_ROUND == 1)); then MODES+=(term); fi
TOTAL=${#MODES[@]}
for round in $(seq "$TOTAL"); do
    mode=${MODES[round - 1]}
    serve_args=()
    case $mode in
        flush) step "round $round/$TOTAL: write with flushes, kill -9 the server mid-stream" ;;
        sync)
            serve_args=(--sync)
            step "round $round/$TOTAL: serve --sync, write without flushes, kill -9 the server mid-stream"
            ;;
        term) step "round $round/$TOTAL: write with flushes, SIGTERM the server mid-stream" ;;
    esac
    JOURNAL=$E2E_TMP/journal.$round
    : >"$JOURNAL"
    start_server "$VOL" "${serve_args[@]}"
    "$NBD_PY" "$CLIENT" write "$SRV_URI" "$JOURNAL" "$round" 120 "${mode/term/flush}" \
        >"$E2E_TMP/writer.$round.log" 2>&1 &
    WRITER=$!
    reg_pid "$WRITER"
    wait_until 30 "the writer's first durable write" grep -q '^F ' "$JOURNAL"
    delay=$(awk -v a="$MIN_SECS" -v b="$MAX_SECS" -v r="$RANDOM" \
        'BEGIN { printf "%.2f", a + (b - a) * r / 32767 }')
    log "writer pid $WRITER running; killing the server in ${delay}s"
    sleep "$delay"
    _alive "$WRITER" || fail "writer exited before the kill: $(cat "$E2E_TMP/writer.$round.log")"
    if [[ $mode == term ]]; then
        t0=$(date +%s)
        stop_server # asserts exit status 0
        log "server exited $(($(date +%s) - t0))s after SIGTERM with a client still writing"
    else
        kill9_server
    fi
    # The writer must notice the dead connection and exit by itself.
    wait_until 30 "the writer to exit after the server was killed" bash -c "! kill -0 $WRITER 2>/dev/null || grep -q '^State:.*Z' /proc/$WRITER/status"
    rc=0
    wait "$WRITER" || rc=$?
    unreg_pid "$WRITER"
    cat "$E2E_TMP/writer.$round.log"
    ((rc == 0)) || fail "writer exited with status $rc"
    if [[ $mode == term ]]; then
        # A clean stop flushes: every acknowledged write is now durable.
        last_c=$(grep '^C ' "$JOURNAL" | tail -n 1 | cut -d' ' -f2)
        echo "F $last_c" >>"$JOURNAL"
    fi

    step "round $round/$TOTAL: restart and verify flushed data"
    start_server "$VOL"
    rc=0
    "$NBD_PY" "$CLIENT" verify "$SRV_URI" "$JOURNAL" "$BASELINE" "$BASELINE.new" || rc=$?
    ((rc == 0)) || fail "round $round ($mode): data acknowledged as durable did not survive kill -9"
    mv "$BASELINE.new" "$BASELINE"
    stop_server
    cvol_check "$VOL"
done

pass "rounds: ${MODES[*]}"
