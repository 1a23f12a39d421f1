"""Side-by-side NBD benchmark: cvol against qemu-nbd and nbdkit.

Every run starts a fresh server on a fresh backing file in a temp dir,
prefills the whole device, then drives one profile through one client and
measures client-side throughput and p99 latency, plus the server's CPU seconds
(/proc/PID/stat) and peak RSS (VmHWM).  Runs alternate between targets
(profile -> rep -> target, target order rotated every rep) so that noise on
this shared machine hits all of them alike.  See scripts/bench/README.md.
"""

import argparse
import datetime
import glob
import hashlib
import json
import math
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402

REPO = benchlib.REPO
CLK_TCK = os.sysconf("SC_CLK_TCK")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# name, fio rw, block size, queue depth, read percentage (mixed only)
PROFILES = [
    ("seq-write", "write", MiB, 8, 0),
    ("seq-read", "read", MiB, 8, 100),
    ("rand-write-qd32", "randwrite", 4 * KiB, 32, 0),
    ("rand-read-qd32", "randread", 4 * KiB, 32, 100),
    ("rand-write-qd1", "randwrite", 4 * KiB, 1, 0),
    ("rand-read-qd1", "randread", 4 * KiB, 1, 100),
    ("mixed-70-30", "randrw", 4 * KiB, 32, 70),
]
PROFILE_NAMES = [p[0] for p in PROFILES]
TARGETS = ["cvol", "qemu-nbd", "nbdkit"]
PEERS = ["qemu-nbd", "nbdkit"]

# fio's 50-60%-compressible buffers: in every 4 KiB chunk 45% random bytes and
# 55% zeros, new contents for every write (refill_buffers).
# fio seeds its offsets and its buffer contents from one seed: the prefill and
# the measured runs use different seeds (the same for every target), else the
# measured writes repeat the prefill's blocks and cvol would deduplicate them.
PREFILL_SEED = 4242
RUN_SEED = 1
SYNTH_DATA_OPTS = ["--buffer_compress_percentage=55", "--buffer_compress_chunk=4k", "--refill_buffers"]

DEFAULT_REAL_SRC = [
    "/usr/share/doc", "/usr/lib/python3*", "/usr/share/man", "/usr/share/locale",
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/bin", "/usr/lib/gcc",
    "/usr/lib/jvm", "/usr/lib/llvm*",
]

# The real-data writer.  fio can only write synthetic buffers, so writes of
# real data go through this small libnbd client instead (same library as fio's
# nbd engine, same queue depths and block sizes).  It copies blocks of a real
# data file and stamps 8 unique bytes into every 4 KiB (fio's scramble_buffers
# idea) so that re-used source blocks are not deduplicated.  Prototypes are
# declared here so that only the runtime library libnbd.so.0 is needed.
NBDLOAD_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct nbd_handle;
typedef struct {
    int (*callback)(void *user_data, int *error);
    void *user_data;
    void (*free)(void *user_data);
} nbd_completion_callback;
extern struct nbd_handle *nbd_create(void);
extern int nbd_connect_uri(struct nbd_handle *, const char *);
extern int64_t nbd_get_size(struct nbd_handle *);
extern int64_t nbd_aio_pwrite(struct nbd_handle *, const void *, size_t, uint64_t,
                              nbd_completion_callback, uint32_t);
extern int64_t nbd_aio_pread(struct nbd_handle *, void *, size_t, uint64_t,
                             nbd_completion_callback, uint32_t);
extern int nbd_poll(struct nbd_handle *, int);
extern int nbd_aio_in_flight(struct nbd_handle *);
extern const char *nbd_get_error(void);
extern int nbd_shutdown(struct nbd_handle *, uint32_t);
extern void nbd_close(struct nbd_handle *);

#define HBUCKETS 2000000 /* 1 us buckets up to 2 s; the last one takes the rest */

struct slot { char *buf; struct timespec t0; int is_read; int busy; };

static uint32_t *hist[2];
static uint64_t nops[2], nbytes[2], nerr, bs;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t next_rand(void) {
    rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}
static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}
static int done_cb(void *user_data, int *error) {
    struct slot *s = user_data;
    struct timespec t1; clock_gettime(CLOCK_MONOTONIC, &t1);
    uint64_t us = ((t1.tv_sec - s->t0.tv_sec) * 1000000000ull + t1.tv_nsec - s->t0.tv_nsec) / 1000;
    if (us >= HBUCKETS) us = HBUCKETS - 1;
    if (*error) nerr++;
    hist[s->is_read][us]++;
    nops[s->is_read]++;
    nbytes[s->is_read] += bs;
    s->busy = 0;
    return 1; /* retire the command */
}
static double pct(const uint32_t *h, uint64_t n, double p) {
    if (!n) return 0;
    uint64_t want = (uint64_t)(n * p / 100.0), acc = 0;
    if (want >= n) want = n - 1;
    for (uint64_t i = 0; i < HBUCKETS; i++) { acc += h[i]; if (acc > want) return (double)i; }
    return HBUCKETS - 1;
}
static double mean(const uint32_t *h, uint64_t n) {
    if (!n) return 0;
    double s = 0;
    for (uint64_t i = 0; i < HBUCKETS; i++) s += (double)h[i] * (i + 0.5);
    return s / n;
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: nbdload URI DATAFILE seq|rand BS QD SECONDS BYTE_LIMIT READ_PCT SEED\n");
        return 2;
    }
    const char *uri = argv[1], *path = argv[2];
    int seq = strcmp(argv[3], "seq") == 0;
    bs = strtoull(argv[4], 0, 10);
    int qd = atoi(argv[5]);
    double secs = atof(argv[6]);
    uint64_t limit = strtoull(argv[7], 0, 10);
    int read_pct = atoi(argv[8]);
    rng ^= strtoull(argv[9], 0, 10) * 0x2545F4914F6CDD1Dull;
    if (!bs || bs % 4096 || qd < 1 || qd > 256) { fprintf(stderr, "nbdload: bad BS/QD\n"); return 2; }

    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) { perror(path); return 2; }
    uint64_t srclen = (uint64_t)st.st_size / bs * bs;
    if (srclen < bs) { fprintf(stderr, "nbdload: %s is smaller than one block\n", path); return 2; }
    const char *src = mmap(0, srclen, PROT_READ, MAP_SHARED, fd, 0);
    if (src == MAP_FAILED) { perror("mmap"); return 2; }
    volatile char sink = 0; /* fault the source in before the clock starts */
    for (uint64_t o = 0; o < srclen; o += 4096) sink ^= src[o];

    struct nbd_handle *h = nbd_create();
    if (!h || nbd_connect_uri(h, uri) < 0) { fprintf(stderr, "nbdload: %s\n", nbd_get_error()); return 1; }
    int64_t size = nbd_get_size(h);
    uint64_t nblk = size > 0 ? (uint64_t)size / bs : 0, nsrc = srclen / bs;
    if (!nblk) { fprintf(stderr, "nbdload: export too small\n"); return 1; }

    hist[0] = calloc(HBUCKETS, sizeof(uint32_t));
    hist[1] = calloc(HBUCKETS, sizeof(uint32_t));
    struct slot *slots = calloc(qd, sizeof *slots);
    if (!hist[0] || !hist[1] || !slots) return 2;
    for (int i = 0; i < qd; i++)
        if (posix_memalign((void **)&slots[i].buf, 4096, bs)) return 2;

    uint64_t k = 0, issued = 0, stamp = 0;
    double t0 = now(), end = t0 + secs;
    int stop = 0;
    for (;;) {
        if (!stop && (now() >= end || (limit && issued >= limit))) stop = 1;
        for (int i = 0; !stop && i < qd; i++) {
            struct slot *s = &slots[i];
            if (s->busy) continue;
            uint64_t dst = seq ? (k % nblk) * bs : (next_rand() % nblk) * bs;
            int rd = read_pct > 0 && (int)(next_rand() % 100) < read_pct;
            nbd_completion_callback cb = { done_cb, s, 0 };
            int64_t c;
            s->is_read = rd;
            s->busy = 1;
            if (rd) {
                clock_gettime(CLOCK_MONOTONIC, &s->t0);
                c = nbd_aio_pread(h, s->buf, bs, dst, cb, 0);
            } else {
                uint64_t so = seq ? (k % nsrc) * bs : (next_rand() % nsrc) * bs;
                memcpy(s->buf, src + so, bs);
                for (uint64_t o = 0; o < bs; o += 4096) { stamp++; memcpy(s->buf + o, &stamp, 8); }
                clock_gettime(CLOCK_MONOTONIC, &s->t0);
                c = nbd_aio_pwrite(h, s->buf, bs, dst, cb, 0);
            }
            if (c < 0) { fprintf(stderr, "nbdload: %s\n", nbd_get_error()); return 1; }
            k++;
            issued += bs;
        }
        if (nbd_aio_in_flight(h) == 0) {
            if (stop) break;
            continue;
        }
        if (nbd_poll(h, -1) < 0) { fprintf(stderr, "nbdload: poll: %s\n", nbd_get_error()); return 1; }
    }
    double el = now() - t0;
    nbd_shutdown(h, 0);
    nbd_close(h);
    uint64_t n = nops[0] + nops[1];
    printf("{\"elapsed_s\": %.6f, \"read_ops\": %llu, \"write_ops\": %llu, \"read_bytes\": %llu, "
           "\"write_bytes\": %llu, \"errors\": %llu, \"iops\": %.1f, "
           "\"read_p99_us\": %.0f, \"write_p99_us\": %.0f, \"read_mean_us\": %.1f, \"write_mean_us\": %.1f}\n",
           el, (unsigned long long)nops[1], (unsigned long long)nops[0],
           (unsigned long long)nbytes[1], (unsigned long long)nbytes[0], (unsigned long long)nerr,
           n / el, pct(hist[1], nops[1], 99), pct(hist[0], nops[0], 99),
           mean(hist[1], nops[1]), mean(hist[0], nops[0]));
    return nerr ? 1 : 0;
}
"""


Interrupted = benchlib.Interrupted


class RunError(Exception):
    pass


# Everything that has to go on exit, Ctrl-C or SIGTERM.
STATE = {"servers": [], "clients": [], "workdir": None, "keep": False}


log = benchlib.log_plain
parse_size = benchlib.parse_size
fmt_size = benchlib.fmt_size
tail = benchlib.tail


# ------------------------------------------------------------- processes ----

def alive(proc):
    return proc is not None and proc.poll() is None


terminate = benchlib.terminate  # logs as `log` does, "  pid N ignored SIGTERM ..."


def run_client(cmd, timeout, stdout=None):
    """Run a client to completion (tracked for cleanup); returns (rc, cpu_s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, start_new_session=True)
    STATE["clients"].append(proc)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate(proc, 5)
        raise RunError("%s did not finish within %ds" % (cmd[0], timeout))
    finally:
        STATE["clients"].remove(proc)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RunError("%s exited %d: %s" % (os.path.basename(cmd[0]), proc.returncode,
                                             (err or b"").decode("utf-8", "replace").strip()[-800:]))
    return cpu


class Server:
    """One server process on one fresh backing file."""

    def __init__(self, kind, workdir, seq, cfg):
        self.kind, self.cfg = kind, cfg
        self.sock = os.path.join(workdir, "%s-%d.sock" % (kind, seq))
        self.out = os.path.join(workdir, "%s-%d.out" % (kind, seq))
        self.err = os.path.join(workdir, "%s-%d.err" % (kind, seq))
        ext = "cvol" if kind == "cvol" else "img"
        self.path = os.path.join(workdir, "%s-%d.%s" % (kind, seq, ext))
        self.proc = None
        self.uri = None

    def start(self):
        c = self.cfg
        if self.kind == "cvol":
            cmd = [c["cvol"], "create", self.path, "--size", str(c["size"]),
                   "--physical-size", str(c["physical"])]
            if c["codec"]:
                cmd += ["--codec", c["codec"]]
            cmd += c["cvol_create_args"]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
            if r.returncode != 0:
                raise RunError("cvol create failed: %s" % r.stdout.decode("utf-8", "replace").strip())
            cmd = [c["cvol"], "serve", self.path, "--socket", self.sock] + c["cvol_serve_args"]
        else:
            with open(self.path, "wb") as f:
                f.truncate(c["size"])
            if self.kind == "qemu-nbd":
                cmd = ["qemu-nbd", "-f", "raw", "-t", "-k", self.sock,
                       "--cache=" + c["qemu_cache"], "--aio=" + c["qemu_aio"], self.path]
            else:
                cmd = ["nbdkit", "-f", "-U", self.sock, "file", self.path]
        self.cmd = cmd
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        STATE["servers"].append(self)
        self.error = RunError
        benchlib.wait_server_ready(self)

    def cpu_seconds(self):
        """utime + stime of the whole process (all threads, live and exited)."""
        with open("/proc/%d/stat" % self.proc.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def status(self):
        st = {}
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                k, _, v = line.partition(":")
                st[k] = v.strip()
        return st

    def stop(self):
        if self.proc is None:
            return None
        rc = terminate(self.proc, 60)
        if self in STATE["servers"]:
            STATE["servers"].remove(self)
        return rc

    def remove_files(self):
        for p in (self.path, self.sock):
            try:
                os.unlink(p)
            except OSError:
                pass


def cleanup():
    benchlib.ignore_signals()
    for proc in list(STATE["clients"]):
        terminate(proc, 5)
    STATE["clients"] = []
    for srv in list(STATE["servers"]):
        rc = srv.stop()
        if rc not in (0, None):
            log("cleanup: %s (pid %d) exited %s" % (srv.kind, srv.proc.pid, rc))
    benchlib.remove_workdir(STATE, log)


def machine_busy_seconds():
    """CPU seconds spent not idle by the whole machine (all CPUs) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / CLK_TCK


# ------------------------------------------------------------------ tools ----

def check_tools(args):
    missing = []

    def need(tool, pkg):
        if shutil.which(tool) is None:
            missing.append((tool, pkg))

    need("fio", "fio")
    if "qemu-nbd" in args.targets:
        need("qemu-nbd", "qemu-utils")
    if "nbdkit" in args.targets:
        need("nbdkit", "nbdkit")
    if args.real_data:
        need("nbdcopy", "libnbd-bin")
        need("tar", "tar")
        if shutil.which("cc") is None and shutil.which("gcc") is None:
            missing.append(("cc", "gcc"))
    if missing:
        log("missing tools: " + ", ".join(t for t, _ in missing))
        log("install them with:  apt-get install " + " ".join(sorted(set(p for _, p in missing))))
        sys.exit(2)
    r = subprocess.run(["fio", "--enghelp=nbd"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if r.returncode != 0:
        log("this fio has no nbd ioengine (Debian's fio package has it; built from source it needs libnbd-dev)")
        sys.exit(2)
    if "nbdkit" in args.targets:
        r = subprocess.run(["nbdkit", "file", "--version"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        if r.returncode != 0:
            log("nbdkit has no file plugin: apt-get install nbdkit (nbdkit-plugin-file on some distros)")
            sys.exit(2)


tool_version = benchlib.tool_version
git_describe = benchlib.git_describe


def build_loader(cache_dir):
    tag = hashlib.sha1(NBDLOAD_C.encode()).hexdigest()[:12]
    exe = os.path.join(cache_dir, "nbdload-" + tag)
    if os.access(exe, os.X_OK):
        return exe
    src = exe + ".c"
    with open(src, "w") as f:
        f.write(NBDLOAD_C)
    cc = shutil.which("cc") or shutil.which("gcc")
    r = subprocess.run([cc, "-O2", "-Wall", "-o", exe + ".tmp", src, "-l:libnbd.so.0"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        log(r.stdout.decode("utf-8", "replace"))
        log("could not build the real-data writer: it needs a C compiler and libnbd.so.0 "
            "(apt-get install gcc libnbd0)")
        sys.exit(2)
    os.rename(exe + ".tmp", exe)
    return exe


def real_data_file(cache_dir, size, srcs):
    paths = []
    for pat in srcs:
        paths += sorted(glob.glob(pat))
    paths = [p for p in paths if os.path.exists(p)]
    if not paths:
        log("--real-data: none of %s exists (use --real-data-src)" % " ".join(srcs))
        sys.exit(2)
    tag = hashlib.sha1(("\0".join(paths)).encode()).hexdigest()[:8]
    path = os.path.join(cache_dir, "real-%s-%s.bin" % (fmt_size(size), tag))
    if os.path.exists(path) and os.path.getsize(path) == size:
        return path, paths
    log("preparing %s of real data: tar of %s ..." % (fmt_size(size), " ".join(paths)))
    tmp = path + ".tmp"
    got = 0
    tar = subprocess.Popen(["tar", "-cf", "-", "--sort=name", "--ignore-failed-read"] + paths,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    STATE["clients"].append(tar)
    try:
        with open(tmp, "wb") as out:
            while got < size:
                chunk = tar.stdout.read(min(4 * MiB, size - got))
                if not chunk:
                    break
                out.write(chunk)
                got += len(chunk)
    finally:
        tar.stdout.close()
        terminate(tar, 5)
        STATE["clients"].remove(tar)
    if got < size:
        os.unlink(tmp)
        log("only %d bytes of real data under %s; pass more --real-data-src or a smaller --size"
            % (got, " ".join(paths)))
        sys.exit(2)
    os.rename(tmp, path)
    return path, paths


# ----------------------------------------------------------------- clients ----

def fio_base(name, uri, size):
    return ["fio", "--name=" + name, "--ioengine=nbd", "--uri=" + uri, "--size=" + str(size),
            "--output-format=json"]


def parse_fio(path):
    with open(path) as f:
        text = f.read()
    text = text[text.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0]
    res = {"client": "fio", "read_bytes": 0, "write_bytes": 0, "iops": 0.0,
           "read_p99_us": None, "write_p99_us": None, "read_mean_us": None, "write_mean_us": None}
    for d in ("read", "write"):
        j = job[d]
        res["iops"] += j["iops"]
        res["%s_bytes" % d] = j["io_bytes"]
        if j["total_ios"]:
            pct = j["clat_ns"].get("percentile", {})
            if "99.000000" in pct:
                res["%s_p99_us" % d] = pct["99.000000"] / 1000.0
            res["%s_mean_us" % d] = j["clat_ns"]["mean"] / 1000.0
    res["elapsed_s"] = job["job_runtime"] / 1000.0
    res["errors"] = job.get("error", 0)
    return res


def prefill(cfg, uri, raw_dir, tag):
    """Write the whole device once, so that reads read written data and writes overwrite."""
    if cfg["real_data"]:
        run_client(["nbdcopy", "--connections=1", cfg["data_file"], uri], timeout=3600)
    else:
        out = os.path.join(raw_dir, tag + "-prefill.json")
        run_client(fio_base("prefill", uri, cfg["size"])
                   + ["--rw=write", "--bs=1M", "--iodepth=8", "--randseed=%d" % PREFILL_SEED,
                      "--output=" + out] + SYNTH_DATA_OPTS,
                   timeout=3600)


def run_profile(cfg, prof, uri, raw_dir, tag):
    name, rw, bs, qd, read_pct = prof
    writes = rw != "read" and rw != "randread"
    runtime = cfg["runtime"]
    timeout = int(runtime * 3 + 120)
    if cfg["real_data"] and writes:
        mode = "seq" if rw == "write" else "rand"
        cmd = [cfg["loader"], uri, cfg["data_file"], mode, str(bs), str(qd), str(runtime),
               str(cfg["write_cap"]), str(read_pct if rw == "randrw" else 0), "1"]
        out = os.path.join(raw_dir, tag + ".json")
        with open(out, "wb") as f:
            cpu = run_client(cmd, timeout, stdout=f)
        with open(out) as f:
            res = json.load(f)
        res["client"] = "nbdload"
    else:
        out = os.path.join(raw_dir, tag + ".json")
        cmd = fio_base(name, uri, cfg["size"]) + [
            "--rw=" + rw, "--bs=" + str(bs), "--iodepth=" + str(qd), "--runtime=" + str(runtime),
            "--norandommap", "--randseed=%d" % RUN_SEED, "--output=" + out]
        if rw == "randrw":
            cmd.append("--rwmixread=%d" % read_pct)
        if writes:
            # stop at the runtime or after write_cap bytes, whichever comes first
            cmd += ["--io_size=" + str(cfg["write_cap"])] + SYNTH_DATA_OPTS
        else:
            cmd.append("--time_based")
        cpu = run_client(cmd, timeout)
        res = parse_fio(out)
    res["client_cpu_s"] = cpu
    res["bytes"] = res["read_bytes"] + res["write_bytes"]
    res["mb_s"] = res["bytes"] / 1e6 / res["elapsed_s"] if res["elapsed_s"] else 0.0
    p = [v for v in (res["read_p99_us"], res["write_p99_us"]) if v]
    res["p99_us"] = max(p) if p else None
    return res


# ------------------------------------------------------------------ output ----

def human(n):
    if n is None:
        return "-"
    if n >= 1e6:
        return "%.2fM" % (n / 1e6)
    if n >= 1e4:
        return "%.1fk" % (n / 1e3)
    if n >= 1e3:
        return "%.2fk" % (n / 1e3)
    return "%.0f" % n


med = benchlib.med


def summarize(runs, profiles, targets):
    rows = []
    for prof in profiles:
        by_t = {}
        for t in targets:
            rs = [r for r in runs if r["profile"] == prof and r["target"] == t and not r.get("error")]
            if not rs:
                continue
            row = {
                "profile": prof, "target": t, "reps": len(rs),
                "iops": med([r["iops"] for r in rs]),
                "iops_min": min(r["iops"] for r in rs), "iops_max": max(r["iops"] for r in rs),
                "mb_s": med([r["mb_s"] for r in rs]),
                "p99_us": med([r["p99_us"] for r in rs]),
                "read_p99_us": med([r["read_p99_us"] for r in rs]),
                "write_p99_us": med([r["write_p99_us"] for r in rs]),
                "cpu_s_per_gb": med([r["cpu_s_per_gb"] for r in rs]),
                "rss_peak_mib": max(r["rss_peak_mib"] for r in rs),
                "client": rs[0]["client"],
            }
            if t == "cvol":
                for k in ("compression_ratio", "write_amplification", "cleaner_segments_cleaned",
                          "dedup_hits"):
                    vals = [r.get("cvol_stat", {}).get(k) for r in rs]
                    row[k] = med(vals) if k not in ("cleaner_segments_cleaned", "dedup_hits") else max(
                        [v for v in vals if v is not None] or [0])
            by_t[t] = row
            rows.append(row)
        if "cvol" in by_t:
            c = by_t["cvol"]
            for peer in PEERS:
                if peer in by_t and by_t[peer]["iops"]:
                    p = by_t[peer]
                    c["vs_" + peer] = c["iops"] / p["iops"]
                    if c["p99_us"] and p["p99_us"]:
                        c["p99_vs_" + peer] = c["p99_us"] / p["p99_us"]
                    if c["cpu_s_per_gb"] and p["cpu_s_per_gb"]:
                        c["cpu_vs_" + peer] = c["cpu_s_per_gb"] / p["cpu_s_per_gb"]
    return rows


def p99_cell(row):
    if row["profile"].startswith("mixed") and row["read_p99_us"] and row["write_p99_us"]:
        return "%.0f/%.0f" % (row["read_p99_us"], row["write_p99_us"])
    return "-" if row["p99_us"] is None else "%.0f" % row["p99_us"]


def table_rows(rows, targets):
    peers = [p for p in PEERS if p in targets] if "cvol" in targets else []
    head = ["profile", "target", "IOPS", "MB/s", "p99 µs", "CPU s/GB", "RSS MiB"] + \
        ["cvol/" + p for p in peers]
    out = []
    for r in rows:
        cells = [r["profile"], r["target"], human(r["iops"]), "%.0f" % r["mb_s"], p99_cell(r),
                 "-" if r["cpu_s_per_gb"] is None else "%.2f" % r["cpu_s_per_gb"],
                 "%.0f" % r["rss_peak_mib"]]
        for p in peers:
            v = r.get("vs_" + p)
            cells.append("%.2f" % v if v is not None else "")
        out.append(cells)
    return head, out


def text_table(head, rows):
    w = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w[i]) if i < 2 else h.rjust(w[i]) for i, h in enumerate(head))]
    lines.append("  ".join("-" * x for x in w))
    prev = None
    for r in rows:
        if prev is not None and r[0] != prev:
            lines.append("")
        prev = r[0]
        lines.append("  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r)))
    return "\n".join(lines)


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(r) + " |")
    return "\n".join(lines)


COLORS = {"cvol": "#e6550d", "qemu-nbd": "#3182bd", "nbdkit": "#31a354"}


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_step(raw):
    """The smallest 1, 2, 2.5 or 5 times a power of ten >= raw."""
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def svg_chart(rows, profiles, targets, title):
    """Two panels: throughput relative to the reference peer, and server CPU s/GB."""
    ref = next((p for p in ("qemu-nbd", "nbdkit") if p in targets), targets[0])
    get = {(r["profile"], r["target"]): r for r in rows}
    profs = [p for p in profiles if any((p, t) in get for t in targets)]
    W, left, right, ph, top_pad = 980, 70, 20, 220, 60
    gw = (W - left - right) / max(1, len(profs))
    bw = min(34.0, gw * 0.8 / max(1, len(targets)))
    H = top_pad + 3 * (ph + 80) + 30
    o = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
         'font-family="sans-serif" font-size="11">' % (W, H, W, H),
         '<rect width="100%" height="100%" fill="white"/>',
         '<text x="%d" y="22" font-size="15" font-weight="bold">%s</text>' % (left, esc(title))]
    lx = left
    for t in targets:
        o.append('<rect x="%d" y="32" width="12" height="12" fill="%s"/>' % (lx, COLORS.get(t, "#888")))
        o.append('<text x="%d" y="42">%s</text>' % (lx + 16, esc(t)))
        lx += 100

    def panel(y0, label, value, lo_hi, fmt, ref_line):
        vals = []
        for p in profs:
            for t in targets:
                r = get.get((p, t))
                if r:
                    v = value(r)
                    if v is not None:
                        vals.append(v)
                        vals.extend(x for x in lo_hi(r) if x is not None)
        vmax = max(vals + [1.0 if ref_line else 0.0]) * 1.12 or 1.0
        step = nice_step(vmax / 5)
        vmax = step * -(-vmax // step)
        y = lambda v: y0 + ph - (v / vmax) * ph
        o.append('<text x="%d" y="%d" font-size="13" font-weight="bold">%s</text>' % (left, y0 - 10, esc(label)))
        for i in range(int(round(vmax / step)) + 1):
            v = step * i
            o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (left, W - right, y(v), y(v)))
            o.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (left - 6, y(v) + 4, fmt(v)))
        if ref_line:
            o.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#333" stroke-dasharray="4 3"/>'
                     % (left, W - right, y(1.0), y(1.0)))
        for gi, p in enumerate(profs):
            gx = left + gi * gw + (gw - bw * len(targets)) / 2
            for ti, t in enumerate(targets):
                r = get.get((p, t))
                if not r:
                    continue
                v = value(r)
                if v is None:
                    continue
                x = gx + ti * bw
                o.append('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %s</title></rect>'
                         % (x + 1, y(v), bw - 2, y0 + ph - y(v), COLORS.get(t, "#888"), esc(p), esc(t), fmt(v)))
                lo, hi = lo_hi(r)
                if lo is not None and hi is not None and hi > lo:
                    cx = x + bw / 2
                    o.append('<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#000"/>' % (cx, cx, y(lo), y(hi)))
                o.append('<text x="%.1f" y="%.1f" text-anchor="middle" font-size="9">%s</text>'
                         % (x + bw / 2, y(v) - 3, fmt(v)))
            o.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (left + gi * gw + gw / 2, y0 + ph + 16, esc(p)))
        o.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#000"/>' % (left, W - right, y0 + ph, y0 + ph))

    def rel(r):
        b = get.get((r["profile"], ref))
        return r["iops"] / b["iops"] if b and b["iops"] else None

    def rel_range(r):
        b = get.get((r["profile"], ref))
        if not b or not b["iops"]:
            return (None, None)
        return (r["iops_min"] / b["iops"], r["iops_max"] / b["iops"])

    panel(top_pad + 30, "throughput relative to %s (= 1.0; higher is better; whiskers: min-max over reps)" % ref,
          rel, rel_range, lambda v: "%.2f" % v, True)
    panel(top_pad + 30 + ph + 80, "server CPU seconds per GB moved (lower is better)",
          lambda r: r["cpu_s_per_gb"], lambda r: (None, None), lambda v: "%.2f" % v, False)
    panel(top_pad + 30 + 2 * (ph + 80), "server peak RSS, MiB",
          lambda r: r["rss_peak_mib"], lambda r: (None, None), lambda v: "%.0f" % v, False)
    o.append("</svg>")
    return "\n".join(o) + "\n"


# -------------------------------------------------------------------- main ----

def main():
    ap = argparse.ArgumentParser(
        prog="scripts/bench/run",
        description="fio side by side: cvol vs qemu-nbd and nbdkit serving a raw file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="profiles: " + ", ".join(PROFILE_NAMES))
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 256M device, 3 s per run, 1 rep (~2 min)")
    ap.add_argument("--runtime", type=float, help="seconds per run (default 30, --quick 3)")
    ap.add_argument("--size", help="device size = region prefilled and exercised (default 1G, --quick 256M)")
    ap.add_argument("--reps", type=int, help="repetitions of every (profile, target) (default 2, --quick 1)")
    ap.add_argument("--profiles", default=",".join(PROFILE_NAMES), help="comma-separated subset")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of cvol,qemu-nbd,nbdkit")
    ap.add_argument("--cvol", help="cvol binary (default target/release/cvol, built if missing)")
    ap.add_argument("--codec", help="passed to cvol create --codec (default: cvol's default, lz4)")
    ap.add_argument("--cvol-create-args", default="", help="extra args for cvol create, e.g. '--dedup off'")
    ap.add_argument("--cvol-serve-args", default="", help="extra args for cvol serve, e.g. '--workers 2'")
    ap.add_argument("--write-cap", help="a write run stops after this many bytes even before --runtime "
                    "(default 16x --size); bounds the log cvol needs")
    ap.add_argument("--physical-size", help="cvol --physical-size (default 2x (size + write cap): "
                    "the cleaner never has to run)")
    ap.add_argument("--real-data", action="store_true",
                    help="real data (a tar of system files) instead of fio's 55%%-compressible buffers")
    ap.add_argument("--real-data-src", default=" ".join(DEFAULT_REAL_SRC),
                    help="space-separated dirs/globs tarred for --real-data (default: %(default)s)")
    ap.add_argument("--qemu-cache", default="writeback",
                    help="qemu-nbd --cache (default writeback: page cache, like cvol and nbdkit)")
    ap.add_argument("--qemu-aio", default="threads", help="qemu-nbd --aio (default threads)")
    ap.add_argument("--dir", help="where volumes and raw files go (default $TMPDIR or /tmp)")
    ap.add_argument("--out", default=os.path.join(REPO, "target", "bench"), help="output dir (default target/bench)")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "cvol-bench-cache"),
                    help="cache for the real-data file and the compiled writer")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (server logs)")
    args = ap.parse_args()

    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.targets = ["qemu-nbd" if t == "qemu" else t for t in args.targets]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad or not args.targets:
        ap.error("unknown target(s) %s; choose from %s" % (",".join(bad), ",".join(TARGETS)))
    args.profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in args.profiles if p not in PROFILE_NAMES]
    if bad or not args.profiles:
        ap.error("unknown profile(s) %s; choose from %s" % (",".join(bad), ",".join(PROFILE_NAMES)))

    size = parse_size(args.size or ("256M" if args.quick else "1G"))
    runtime = args.runtime if args.runtime is not None else (3 if args.quick else 30)
    reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    write_cap = parse_size(args.write_cap) if args.write_cap else 16 * size
    physical = parse_size(args.physical_size) if args.physical_size else 2 * (size + write_cap)
    physical = (physical + MiB - 1) // MiB * MiB
    if size % MiB:
        ap.error("--size must be a multiple of 1 MiB")

    check_tools(args)
    cvol = benchlib.find_cvol(args.cvol, log) if "cvol" in args.targets else None
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    mode = "real" if args.real_data else "synthetic"
    raw_dir = os.path.join(args.out, "raw-" + mode)
    shutil.rmtree(raw_dir, ignore_errors=True)
    os.makedirs(raw_dir)

    cfg = {
        "size": size, "runtime": runtime, "write_cap": write_cap, "physical": physical,
        "cvol": cvol, "codec": args.codec, "real_data": args.real_data,
        "cvol_create_args": shlex.split(args.cvol_create_args),
        "cvol_serve_args": shlex.split(args.cvol_serve_args),
        "qemu_cache": args.qemu_cache, "qemu_aio": args.qemu_aio,
    }
    real_paths = None
    if args.real_data:
        cfg["loader"] = build_loader(args.cache_dir)
        cfg["data_file"], real_paths = real_data_file(args.cache_dir, size, args.real_data_src.split())

    STATE["keep"] = args.keep
    STATE["workdir"] = tempfile.mkdtemp(prefix="cvol-bench.", dir=args.dir)
    workdir = STATE["workdir"]

    profiles = [p for p in PROFILES if p[0] in args.profiles]
    targets = [t for t in TARGETS if t in args.targets]
    total = len(profiles) * reps * len(targets)
    machine = {
        "hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
    }
    versions = {"fio": tool_version(["fio", "--version"]), "git": git_describe()}
    if cvol:
        versions["cvol"] = tool_version([cvol, "--version"])
    if "qemu-nbd" in targets:
        versions["qemu-nbd"] = tool_version(["qemu-nbd", "--version"])
    if "nbdkit" in targets:
        versions["nbdkit"] = tool_version(["nbdkit", "--version"])
    if args.real_data:
        versions["nbdcopy"] = tool_version(["nbdcopy", "--version"])
    config = {
        "mode": mode, "size_bytes": size, "runtime_s": runtime, "reps": reps,
        "write_cap_bytes": write_cap, "cvol_physical_size_bytes": physical,
        "codec": args.codec or "default (lz4)", "cvol_create_args": args.cvol_create_args,
        "cvol_serve_args": args.cvol_serve_args, "workdir": workdir,
        "qemu_nbd": "qemu-nbd -f raw -t -k SOCK --cache=%s --aio=%s FILE" % (args.qemu_cache, args.qemu_aio),
        "nbdkit": "nbdkit -f -U SOCK file FILE",
        "cvol_serve": "cvol serve VOL --socket SOCK %s" % args.cvol_serve_args,
        "data": ("real: tar of %s (%s); reads via fio, writes via nbdload (libnbd, 8 unique bytes "
                 "per 4 KiB against dedup); prefill via nbdcopy" % (" ".join(real_paths), cfg["data_file"])
                 if args.real_data else
                 "fio buffer_compress_percentage=55 buffer_compress_chunk=4k refill_buffers; prefill via fio"),
        "targets": targets, "profiles": [p[0] for p in profiles],
    }
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in sys.argv),
              "machine": machine, "versions": versions, "config": config, "runs": [], "summary": []}
    json_path = os.path.join(args.out, "results-%s.json" % mode)

    log("cvol bench (%s data): %d runs = %d profiles x %d reps x %d targets, %gs each, device %s, "
        "write cap %s, cvol physical %s, work dir %s"
        % (mode, total, len(profiles), reps, len(targets), runtime, fmt_size(size), fmt_size(write_cap),
           fmt_size(physical), workdir))
    log("  qemu-nbd: %s" % config["qemu_nbd"])
    log("  data: %s" % config["data"])

    n = 0
    seq = 0
    failures = 0
    for prof in profiles:
        for rep in range(reps):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                n += 1
                seq += 1
                tag = "%s-%s-%d" % (prof[0], t, rep + 1)
                run = {"profile": prof[0], "target": t, "rep": rep + 1}
                srv = Server(t, workdir, seq, cfg)
                t0 = time.monotonic()
                try:
                    srv.start()
                    prefill(cfg, srv.uri, raw_dir, tag)
                    os.sync()
                    t_pre = time.monotonic() - t0
                    load0 = os.getloadavg()[0]
                    busy0 = machine_busy_seconds()
                    cpu0 = srv.cpu_seconds()
                    res = run_profile(cfg, prof, srv.uri, raw_dir, tag)
                    cpu1 = srv.cpu_seconds()
                    busy1 = machine_busy_seconds()
                    st = srv.status()
                    run.update(res)
                    run["server_cpu_s"] = cpu1 - cpu0
                    run["cpu_s_per_gb"] = (cpu1 - cpu0) / (res["bytes"] / 1e9) if res["bytes"] else None
                    run["rss_peak_mib"] = int(st.get("VmHWM", "0 kB").split()[0]) / 1024.0
                    run["rss_end_mib"] = int(st.get("VmRSS", "0 kB").split()[0]) / 1024.0
                    run["server_threads"] = int(st.get("Threads", "0"))
                    run["prefill_s"] = t_pre
                    # CPU used by anything but this server and its client during the run
                    # (kernel threads, page-cache writeback, other users of the machine)
                    run["other_cpu_s"] = (busy1 - busy0) - run["server_cpu_s"] - res["client_cpu_s"]
                    run["loadavg_1m_before"] = load0
                    if t == "cvol":
                        r = subprocess.run([cvol, "stat", srv.path, "--json"], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, timeout=60)
                        if r.returncode == 0:
                            run["cvol_stat"] = json.loads(r.stdout)
                    rc = srv.stop()
                    run["server_exit"] = rc
                    if rc != 0:
                        run["warning"] = "%s exited %s after SIGTERM" % (t, rc)
                    p99 = p99_cell({"profile": prof[0], "p99_us": run["p99_us"],
                                    "read_p99_us": run["read_p99_us"], "write_p99_us": run["write_p99_us"]})
                    extra = ""
                    if t == "cvol" and "cvol_stat" in run:
                        cs = run["cvol_stat"]
                        extra = "  comp %.2fx cleaned %s dedup hits %s" % (
                            cs.get("compression_ratio", 0), cs.get("cleaner_segments_cleaned", "?"),
                            cs.get("dedup_hits", "?"))
                    log("[%2d/%d] %-15s rep %d  %-8s %8s IOPS %7.0f MB/s  p99 %9s us  cpu %5.2f s/GB  "
                        "rss %5.0f MiB  %4.1fs (prefill %.1fs, cpu s: server %.1f client %.1f other %.1f)%s%s"
                        % (n, total, prof[0], rep + 1, t, human(run["iops"]), run["mb_s"], p99,
                           run["cpu_s_per_gb"] or 0, run["rss_peak_mib"], run["elapsed_s"], t_pre,
                           run["server_cpu_s"], res["client_cpu_s"], run["other_cpu_s"], extra,
                           ("  WARNING " + run["warning"]) if "warning" in run else ""))
                except RunError as e:
                    failures += 1
                    run["error"] = str(e)
                    log("[%2d/%d] %-15s rep %d  %-8s FAILED: %s" % (n, total, prof[0], rep + 1, t, e))
                    if os.path.exists(srv.err):
                        log("  server stderr: " + tail(srv.err, 10).replace("\n", "\n    "))
                finally:
                    if srv in STATE["servers"]:
                        srv.stop()
                    srv.remove_files()
                result["runs"].append(run)
                with open(json_path, "w") as f:
                    json.dump(result, f, indent=1)

    rows = summarize(result["runs"], [p[0] for p in profiles], targets)
    result["summary"] = rows
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    head, trows = table_rows(rows, targets)
    notes = [
        "IOPS and MB/s (10^6 bytes/s) are medians over reps; p99 is completion latency"
        " (mixed: read/write); CPU s/GB = server utime+stime per 10^9 bytes moved; RSS = peak (VmHWM)"
        " over the server's life (prefill + run). cvol/peer = IOPS ratio (>1: cvol faster).",
    ]
    cv = [r for r in rows if r["target"] == "cvol"]
    if cv:
        notes.append("cvol stat after each run: " + "; ".join(
            "%s comp %.2fx, WA %.2f, cleaned %s, dedup hits %s" % (
                r["profile"], r.get("compression_ratio") or 0, r.get("write_amplification") or 0,
                r.get("cleaner_segments_cleaned", "?"), r.get("dedup_hits", "?")) for r in cv))
    if args.real_data:
        notes.append("real-data writes use nbdload (libnbd client), reads use fio.")
    svg_path = os.path.join(args.out, "chart-%s.svg" % mode)
    with open(svg_path, "w") as f:
        f.write(svg_chart(rows, [p[0] for p in profiles], targets,
                          "cvol vs peers, %s data, %s device, %gs x %d reps (%s)"
                          % (mode, fmt_size(size), runtime, reps, result["date"][:10])))
    md_path = os.path.join(args.out, "table-%s.md" % mode)
    with open(md_path, "w") as f:
        f.write(md_table(head, trows) + "\n\n" + "\n\n".join(notes) + "\n")
    print(text_table(head, trows))
    print()
    for line in notes:
        print(line)
    print()
    print("results: %s\ntable:   %s\nchart:   %s" % (json_path, md_path, svg_path))
    return 1 if failures else 0


def entry():
    """`scripts/bench/run`: main() with cleanup on exit and on a signal."""
    benchlib.run_main(main, cleanup, log, "stopping servers, removing temp files")


if __name__ == "__main__":
    entry()
