#!/usr/bin/env python3
"""`cvol stat --json` and `cvol serve` until it prints its URI, on the
pools `snap_open_bench /dev/shm/snapopen` leaves (pool-none, pool-snaps;
serve on copies in /dev/shm/snapserve, since it writes an epoch), each
binary in turn, ROUNDS rounds of REPS runs (median per round, median of
the rounds):

    cp --sparse=always /dev/shm/snapopen/pool-* /dev/shm/snapserve/
    python3 cli_open.py ROUNDS REPS CVOL_BINARY...

A binary given as BINARY=SUFFIX times pools of its own, /dev/shm/snapopenSUFFIX
and /dev/shm/snapserveSUFFIX (copies the binary has opened for writing once:
pools whose tables it wrote, when formats differ).
"""
import os, resource, statistics, subprocess, sys, time, tempfile
rounds, reps = int(sys.argv[1]), int(sys.argv[2])
suffix = dict(a.partition("=")[::2] for a in sys.argv[3:])
bins = list(suffix)
def pools_of(b, kind):
    return {k: f"/dev/shm/{kind}{suffix[b]}/pool-{k}" for k in ("none", "snaps")}
# CLI_OPEN_CPU=1: `cvol stat`'s CPU time (user and system) instead of its
# wall-clock time, which a busy machine disturbs less.
CPU = bool(os.environ.get("CLI_OPEN_CPU"))
def cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN); return r.ru_utime + r.ru_stime
def stat(b, p):
    t, c = time.monotonic(), cpu()
    subprocess.run([b, "stat", p, "--json"], check=True, stdout=subprocess.DEVNULL)
    return cpu() - c if CPU else time.monotonic() - t
def serve(b, p):
    d = tempfile.mkdtemp(dir="/tmp"); sock = d + "/s"; out = d + "/out"
    t = time.monotonic()
    pr = subprocess.Popen([b, "serve", p, "--socket", sock], stdout=open(out, "wb"), stderr=subprocess.DEVNULL)
    while True:
        with open(out, "rb") as f:
            if f.read().startswith(b"nbd"): dt = time.monotonic() - t; break
        if pr.poll() is not None: raise SystemExit("serve exited")
        time.sleep(0.001)
    pr.terminate(); pr.wait(60)
    return dt
res = {}
for r in range(rounds):
    for b in bins:
        for k in ("none", "snaps"):
            st = [stat(b, pools_of(b, "snapopen")[k]) for _ in range(reps)]
            sv = [serve(b, pools_of(b, "snapserve")[k]) for _ in range(reps)]
            res.setdefault((b, k, "stat"), []).append(statistics.median(st))
            res.setdefault((b, k, "serve"), []).append(statistics.median(sv))
    print("round", r, {f"{os.path.basename(b)} {k} {w}": round(v[-1]*1e3, 1) for (b, k, w), v in res.items()}, flush=True)
for b in bins:
    for w in ("stat", "serve"):
        n, s = statistics.median(res[(b, "none", w)]), statistics.median(res[(b, "snaps", w)])
        print(f"{os.path.basename(b)} {w}: none {n*1e3:.1f} ms, 100 snapshots {s*1e3:.1f} ms ({s/n:.2f}x)")
