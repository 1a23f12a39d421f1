"""PostgreSQL 15 pgbench on ext4 on an NBD export: cvol against qemu-nbd serving a raw file.

Every run starts a fresh server on a fresh backing file in a temp dir, attaches
it the way scripts/e2e/ext4.sh does (nbdfuse -> loop device -> mkfs.ext4 ->
mount), puts a fresh PostgreSQL cluster on it (default settings, fsync on),
loads `pgbench -i -s SCALE` and times `pgbench -c C -j J -T S`.  It records TPS
and latency, the server's CPU seconds during the timed run (/proc/PID/stat),
`cvol stat --json`, and the host space of the backing file (`du`) once the
client stack is torn down.  Before that, a short fio run through fio's nbd
engine on another fresh export measures FLUSH latency the same way for both
servers (4 jobs, 8 KiB random writes, fsync after every write).  Runs
alternate between targets (rep -> target, order rotated every rep) so that
noise on this shared machine hits both alike.  Needs root (loop devices,
mounts, FUSE).  See scripts/bench/README.md.
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import pwd
import re
import shlex
import shutil
import signal
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
TARGETS = ["cvol", "qemu-nbd", "nbdkit-memory"]
# Run unless --targets names others. nbdkit-memory (nbdkit's memory plugin:
# the data in RAM, no disk, no work per request) is the ceiling: the TPS
# this client stack gives with the cheapest server there is.
DEFAULT_TARGETS = ["cvol", "qemu-nbd"]
SIGNALS = benchlib.SIGNALS

# The flush probe writes fio's 55%-compressible buffers, as scripts/bench/run does.
SYNTH_DATA_OPTS = ["--buffer_compress_percentage=55", "--buffer_compress_chunk=4k", "--refill_buffers"]

# cvol stat keys kept in the run summary (the whole object is kept in the JSON too).
STAT_KEYS = [
    "logical_size_bytes", "mapped_bytes", "zero_bytes", "unmapped_bytes", "stored_bytes",
    "physical_used_bytes", "host_allocated_bytes", "live_bytes", "dead_bytes", "reduction_ratio",
    "compression_ratio", "dedup_ratio", "client_bytes_written", "media_bytes_written",
    "write_amplification", "checkpoints_written", "cleaner_segments_cleaned", "segments_reclaimed",
    "dedup_hits", "idle_clean_passes", "recompressed_blocks", "poisoned",
]
FLUSH_KEY_RE = re.compile(r"flush|fsync|sync|commit", re.I)


Interrupted = benchlib.Interrupted


class RunError(Exception):
    pass


log = benchlib.log
parse_size = benchlib.parse_size
fmt_size = benchlib.fmt_size
tail = benchlib.tail
on_signal = benchlib.on_signal


def _child_setup():
    # Children never inherit a blocked SIGINT/SIGTERM from a teardown section.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


# ----------------------------------------------------------- teardown stack ----

class Teardown:
    """Undo actions, newest first.  Every step is pushed *before* the action it
    undoes and checks what is really there, so an interruption between an
    action and its bookkeeping leaks nothing.  Steps run with SIGINT/SIGTERM
    blocked (a Ctrl-C during teardown is delivered once it is done) and each
    has its own timeouts."""

    def __init__(self):
        self.steps = []

    def push(self, name, fn):
        self.steps.append((name, fn))

    def _run(self, upto, strict):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        errors = []
        try:
            while self.steps:
                name, fn = self.steps.pop()
                try:
                    fn()
                except Exception as e:  # keep going: the rest must still be undone
                    errors.append("%s: %s" % (name, e))
                    log("  teardown %s failed: %s" % (name, e))
                if name == upto:
                    break
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if strict and errors:
            raise RunError("teardown: " + "; ".join(errors))

    def close(self, name, strict=True):
        """Undo everything down to and including the step called name."""
        if any(n == name for n, _ in self.steps):
            self._run(name, strict)

    def unwind(self):
        self._run(None, False)


TD = Teardown()
STATE = {"workdir": None, "keep": False}


def cmd_run(cmd, timeout, what=None, user=None, env=None, check=True):
    """Run a command to completion; returns CompletedProcess (stdout+stderr text)."""
    if user:
        cmd = ["runuser", "-u", user, "--"] + cmd
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                           stdin=subprocess.DEVNULL, preexec_fn=_child_setup, env=env)
    except subprocess.TimeoutExpired:
        raise RunError("%s did not finish within %ds" % (what or " ".join(cmd), timeout))
    r.out = r.stdout.decode("utf-8", "replace")
    r.err = r.stderr.decode("utf-8", "replace")
    if check and r.returncode != 0:
        raise RunError("%s exited %d: %s" % (what or " ".join(cmd), r.returncode,
                                             (r.err + r.out).strip()[-800:]))
    return r


def terminate(proc, timeout=10.0):
    return benchlib.terminate(proc, timeout, log)


def run_client(cmd, timeout, user=None):
    """Run a benchmark client; Ctrl-C or a timeout stops it.  Returns (rc, stdout, stderr)."""
    if user:
        cmd = ["runuser", "-u", user, "--"] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_child_setup)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate(proc, 10)
        raise RunError("%s did not finish within %ds" % (os.path.basename(cmd[-1] if user else cmd[0]), timeout))
    except BaseException:
        terminate(proc, 10)
        raise
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def proc_cpu_seconds(pid):
    """utime + stime of the whole process (all threads, live and exited)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu_seconds(pid):
    """utime + stime per thread name of a live process ({comm: seconds}, threads of a name summed)."""
    out = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        comm = head.split("(", 1)[1]
        fields = rest.split()
        out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def machine_busy_seconds():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / CLK_TCK


def du_bytes(path):
    """What `du` shows for a file: allocated blocks x 512."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return None


# ------------------------------------------------------------------ servers ----

class Server:
    """One NBD server process on one fresh backing file."""

    def __init__(self, kind, workdir, tag, cfg):
        self.kind, self.cfg = kind, cfg
        self.sock = os.path.join(workdir, "%s.sock" % tag)
        self.out = os.path.join(workdir, "%s.out" % tag)
        self.err = os.path.join(workdir, "%s.err" % tag)
        self.path = os.path.join(workdir, "%s.%s" % (tag, "cvol" if kind == "cvol" else "img"))
        self.proc = None
        self.uri = None
        self.cmd = None

    def start(self):
        c = self.cfg
        TD.push("server " + self.sock, self.stop_quietly)
        if self.kind == "cvol":
            cmd = [c["cvol"], "create", self.path, "--size", str(c["size"])] + c["cvol_create_args"]
            cmd_run(cmd, 120, "cvol create")
            cmd = [c["cvol"], "serve", self.path, "--socket", self.sock] + c["cvol_serve_args"]
        elif self.kind == "nbdkit-memory":
            cmd = ["nbdkit", "--foreground", "-U", self.sock, "memory", "size=%d" % c["size"]]
        else:
            with open(self.path, "wb") as f:
                f.truncate(c["size"])
            cmd = ["qemu-nbd", "-f", "raw", "-t", "-k", self.sock,
                   "--cache=" + c["qemu_cache"], "--aio=" + c["qemu_aio"]]
            if c["qemu_shared"]:
                cmd.append("--shared=%d" % c["qemu_shared"])
            cmd.append(self.path)
        self.cmd = cmd
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_child_setup)
        self.error = RunError
        benchlib.wait_server_ready(self)

    def cpu_seconds(self):
        return proc_cpu_seconds(self.proc.pid)

    def rss_peak_mib(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
        return None

    def stat(self):
        """cvol stat --json (asks the running server over its control socket)."""
        r = cmd_run([self.cfg["cvol"], "stat", self.path, "--json"], 120, "cvol stat", check=False)
        if r.returncode != 0:
            log("  cvol stat failed (%d): %s" % (r.returncode, r.err.strip()[-300:]))
            return None
        return json.loads(r.out)

    def stop(self):
        """SIGTERM and wait (cvol flushes and checkpoints); returns the exit status."""
        if self.proc is None:
            return None
        return terminate(self.proc, 120)

    def stop_quietly(self):
        if self.proc is not None:
            rc = terminate(self.proc, 120)
            if rc not in (0, None):
                log("  %s (pid %d) exited %s" % (self.kind, self.proc.pid, rc))

    def remove_files(self):
        for p in (self.path, self.sock):
            try:
                os.unlink(p)
            except OSError:
                pass


def multi_conn(uri):
    r = cmd_run(["nbdinfo", "--json", uri], 30, "nbdinfo", check=False)
    try:
        return json.loads(r.out)["exports"][0].get("can_multi_conn")
    except (ValueError, KeyError, IndexError):
        return None


# ------------------------------------------------------------ flush probe ----

def flush_probe(cfg, workdir, tag, target):
    """fio (nbd engine) on a fresh export: N jobs of 8 KiB random writes, fsync=1."""
    srv = Server(target, workdir, tag + "-fio", cfg)
    res = {}
    try:
        srv.start()
        out = os.path.join(cfg["raw_dir"], tag + "-flush.json")
        cmd = ["fio", "--name=flush", "--ioengine=nbd", "--uri=" + srv.uri, "--size=" + str(cfg["size"]),
               "--rw=randwrite", "--bs=8k", "--iodepth=1", "--fsync=1",
               "--numjobs=%d" % cfg["flush_jobs"], "--group_reporting", "--time_based",
               "--runtime=%g" % cfg["flush_runtime"], "--norandommap", "--randseed=1",
               "--output-format=json", "--output=" + out] + SYNTH_DATA_OPTS
        cpu0, busy0 = srv.cpu_seconds(), machine_busy_seconds()
        rc, _, err = run_client(cmd, int(cfg["flush_runtime"] * 3 + 120))
        cpu1, busy1 = srv.cpu_seconds(), machine_busy_seconds()
        if rc != 0:
            raise RunError("fio exited %d: %s" % (rc, err.strip()[-800:]))
        with open(out) as f:
            text = f.read()
        job = json.loads(text[text.index("{"):])["jobs"][0]
        sync, write = job["sync"], job["write"]
        sp = sync["lat_ns"].get("percentile", {})
        wp = write["clat_ns"].get("percentile", {})
        us = lambda v: None if v is None else v / 1000.0
        res = {
            "flush_ops": sync["total_ios"],
            "flush_p50_us": us(sp.get("50.000000")), "flush_p99_us": us(sp.get("99.000000")),
            "flush_p999_us": us(sp.get("99.900000")), "flush_mean_us": us(sync["lat_ns"].get("mean")),
            "flush_max_us": us(sync["lat_ns"].get("max")),
            "write_iops": write["iops"], "write_p50_us": us(wp.get("50.000000")),
            "write_p99_us": us(wp.get("99.000000")),
            "errors": job.get("error", 0),
            "server_cpu_s": cpu1 - cpu0, "other_cpu_s": (busy1 - busy0) - (cpu1 - cpu0),
            "multi_conn": multi_conn(srv.uri),
        }
        # fsync=1 makes one sync per write; each pair is one durable 8 KiB write
        res["durable_writes_per_s"] = res["write_iops"]
        rc = srv.stop()
        res["server_exit"] = rc
        if rc != 0:
            res["warning"] = "%s exited %s after SIGTERM" % (target, rc)
    finally:
        TD.close("server " + srv.sock, strict=False)
        srv.remove_files()
    return res


# -------------------------------------------------------- the pgbench stack ----

def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RunError("timed out after %ds waiting for %s" % (timeout, what))
        time.sleep(0.1)


def loops_on(path):
    r = cmd_run(["losetup", "--list", "-n", "-O", "NAME", "-j", path], 30, "losetup -j", check=False)
    return [l.strip() for l in r.out.splitlines() if l.strip()]


def detach_loop(dev):
    cmd_run(["losetup", "-d", dev], 120, "losetup -d " + dev)
    # losetup -d is asynchronous: wait for the device to be released
    wait_for(lambda: cmd_run(["losetup", dev], 10, check=False).returncode != 0, 60, dev + " to detach")


def umount_fs(mnt):
    if not os.path.ismount(mnt):
        return
    last = ""
    for _ in range(10):
        r = cmd_run(["umount", mnt], 600, "umount " + mnt, check=False)
        if r.returncode == 0:
            return
        last = r.err.strip()
        time.sleep(1)
    cmd_run(["umount", "-l", mnt], 60, "umount -l " + mnt, check=False)
    raise RunError("umount %s failed (%s); lazily unmounted" % (mnt, last))


def fuse_unmount(d, proc):
    if os.path.ismount(d):
        fm = shutil.which("fusermount3") or shutil.which("fusermount")
        r = cmd_run([fm, "-u", d] if fm else ["umount", d], 120, "fusermount3 -u", check=False)
        if r.returncode != 0:
            cmd_run(["umount", "-l", d], 60, "umount -l " + d, check=False)
            raise RunError("fusermount3 -u %s failed: %s" % (d, r.err.strip()))
    if proc is not None:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            terminate(proc, 10)
            raise RunError("nbdfuse did not exit after the unmount")
        if proc.returncode != 0:
            raise RunError("nbdfuse exited %d" % proc.returncode)


class Postgres:
    def __init__(self, cfg, data, sockdir, logfile):
        self.cfg, self.data, self.sockdir, self.logfile = cfg, data, sockdir, logfile
        self.pid = None

    def bin(self, name):
        return os.path.join(self.cfg["pg_bin"], name)

    def initdb(self):
        cmd_run([self.bin("initdb"), "-D", self.data, "--auth=trust", "-E", "UTF8", "--locale=C",
                 "--no-instructions"], 300, "initdb", user=self.cfg["pg_user"])
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("\n# scripts/bench/pgbench\nlisten_addresses = ''\n"
                    "unix_socket_directories = '%s'\nport = %d\nshared_buffers = %s\n"
                    "fsync = on\n%s\n" % (self.sockdir, self.cfg["pg_port"], self.cfg["shared_buffers"],
                                          "\n".join(self.cfg["pg_settings"])))

    def start(self):
        TD.push("postgres", self.stop_quietly)
        cmd_run([self.bin("pg_ctl"), "-D", self.data, "-l", self.logfile, "-w", "-t", "300", "start"],
                330, "pg_ctl start", user=self.cfg["pg_user"])
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            self.pid = int(f.readline())

    def psql(self, sql):
        return cmd_run([self.bin("psql"), "-X", "-q", "-h", self.sockdir, "-p", str(self.cfg["pg_port"]),
                        "-d", "postgres", "-At", "-c", sql], 600, "psql " + sql, user=self.cfg["pg_user"]).out

    def running(self):
        if self.pid is None:
            return os.path.exists(os.path.join(self.data, "postmaster.pid"))
        # the postmaster is not our child (pg_ctl daemonizes it): a zombie waiting
        # for init to reap it has exited
        try:
            with open("/proc/%d/stat" % self.pid) as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def stop(self):
        cmd_run([self.bin("pg_ctl"), "-D", self.data, "-m", "fast", "-w", "-t", "300", "stop"],
                330, "pg_ctl stop", user=self.cfg["pg_user"])

    def stop_quietly(self):
        if not self.running():
            return
        for mode in ("fast", "immediate"):
            r = cmd_run([self.bin("pg_ctl"), "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"],
                        90, "pg_ctl stop", user=self.cfg["pg_user"], check=False)
            if r.returncode == 0 or not self.running():
                return
        if self.pid:
            log("  postgres (pid %d) did not stop: SIGKILL" % self.pid)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_for(lambda: not self.running(), 30, "postgres to die")
            time.sleep(1)  # its backends exit when they notice


def parse_pgbench(out):
    res = {}
    pats = {
        "tps": r"^tps = ([\d.]+) \(without initial connection time\)",
        "latency_avg_ms": r"^latency average = ([\d.]+) ms",
        "latency_stddev_ms": r"^latency stddev = ([\d.]+) ms",
        "initial_connection_ms": r"^initial connection time = ([\d.]+) ms",
        "transactions": r"^number of transactions actually processed: (\d+)",
        "failed": r"^number of failed transactions: (\d+)",
    }
    for k, p in pats.items():
        m = re.search(p, out, re.M)
        if m:
            res[k] = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    return res


def parse_progress(err):
    prog = []
    for m in re.finditer(r"^progress: ([\d.]+) s, ([\d.]+) tps, lat ([\d.]+) ms stddev ([\d.]+|NaN)", err, re.M):
        prog.append({"t": float(m.group(1)), "tps": float(m.group(2)), "lat_ms": float(m.group(3))})
    return prog


def pgbench_run(cfg, workdir, tag, target):
    """Server -> nbdfuse -> loop -> ext4 -> PostgreSQL -> pgbench; returns the run's numbers."""
    run = {}
    srv = Server(target, workdir, tag, cfg)
    fuse_dir = os.path.join(workdir, tag + "-fuse")
    mnt = os.path.join(workdir, tag + "-fs")
    sockdir = os.path.join(workdir, tag + "-pgsock")
    pglog = os.path.join(sockdir, "postgres.log")  # written by the postgres user
    fuse_log = os.path.join(workdir, tag + "-nbdfuse.log")
    user = cfg["pg_user"]
    pw = pwd.getpwnam(user)
    for d in (fuse_dir, mnt, sockdir):
        os.mkdir(d)
    os.chown(sockdir, pw.pw_uid, pw.pw_gid)
    fuse = {"proc": None}
    fuse_file = os.path.join(fuse_dir, "nbd")
    try:
        t0 = time.monotonic()
        srv.start()
        run["multi_conn"] = multi_conn(srv.uri)

        # nbdfuse + loop device, as scripts/e2e/ext4.sh attaches them (defaults: no -C, no --direct-io)
        TD.push("nbdfuse", lambda: fuse_unmount(fuse_dir, fuse["proc"]))
        with open(fuse_log, "wb") as fl:
            fuse["proc"] = subprocess.Popen(["nbdfuse", fuse_dir, srv.uri], stdout=fl, stderr=fl,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_child_setup)

        def fuse_ready():
            if fuse["proc"].poll() is not None:
                raise RunError("nbdfuse exited %s: %s" % (fuse["proc"].returncode, tail(fuse_log)))
            return os.path.ismount(fuse_dir) and os.path.isfile(fuse_file)
        wait_for(fuse_ready, 30, "nbdfuse to expose " + fuse_file)
        if os.stat(fuse_file).st_size != cfg["size"]:
            raise RunError("%s has size %d, expected %d" % (fuse_file, os.stat(fuse_file).st_size, cfg["size"]))

        def loop_teardown():
            for dev in loops_on(fuse_file):
                detach_loop(dev)
        TD.push("loop", loop_teardown)
        loop = cmd_run(["losetup", "-f", "--show", fuse_file], 60, "losetup").out.strip()
        run["loop"] = loop

        cmd_run(["mkfs.ext4", "-q", "-F"] + cfg["mkfs_args"] + [loop], 900, "mkfs.ext4")
        TD.push("mount", lambda: umount_fs(mnt))
        cmd_run(["mount", "-t", "ext4"] + (["-o", cfg["mount_opts"]] if cfg["mount_opts"] else []) + [loop, mnt],
                120, "mount")
        cmd_run(["sync", "-f", mnt], 600, "sync -f")
        run["du_after_mkfs_bytes"] = du_bytes(srv.path)  # ext4's zeroed inode tables and journal
        data = os.path.join(mnt, "pgdata")
        os.mkdir(data, 0o700)
        os.chown(data, pw.pw_uid, pw.pw_gid)
        run["attach_s"] = time.monotonic() - t0

        pg = Postgres(cfg, data, sockdir, pglog)
        pg.initdb()
        pg.start()
        conn = ["-h", sockdir, "-p", str(cfg["pg_port"])]
        pgb = os.path.join(cfg["pg_bin"], "pgbench")

        t1 = time.monotonic()
        cpu0 = srv.cpu_seconds()
        rc, out, err = run_client([pgb] + conn + ["-i", "-s", str(cfg["scale"]), "postgres"], 7200, user=user)
        if rc != 0:
            raise RunError("pgbench -i exited %d: %s" % (rc, (err + out).strip()[-800:]))
        run["init_s"] = time.monotonic() - t1
        run["init_server_cpu_s"] = srv.cpu_seconds() - cpu0
        m = re.search(r"^done in ([\d.]+) s \((.*)\)", err, re.M)
        if m:
            run["init_detail"] = m.group(2)
        run["db_size_bytes"] = int(pg.psql("select pg_database_size('postgres')").strip())
        # start the timed run from a clean state: dirty buffers written, page cache synced
        pg.psql("CHECKPOINT")
        cmd_run(["sync", "-f", mnt], 600, "sync -f")

        stat0 = srv.stat() if target == "cvol" else None
        load0 = os.getloadavg()[0]
        fpid = fuse["proc"].pid
        cpu0, fcpu0, busy0 = srv.cpu_seconds(), proc_cpu_seconds(fpid), machine_busy_seconds()
        threads0 = thread_cpu_seconds(srv.proc.pid)
        t2 = time.monotonic()
        rc, out, err = run_client([pgb] + conn + ["-c", str(cfg["clients"]), "-j", str(cfg["threads"]),
                                                  "-T", str(cfg["runtime"]), "-P", str(cfg["progress"]),
                                                  "postgres"],
                                  int(cfg["runtime"] * 3 + 600), user=user)
        wall = time.monotonic() - t2
        cpu1, fcpu1, busy1 = srv.cpu_seconds(), proc_cpu_seconds(fpid), machine_busy_seconds()
        threads1 = thread_cpu_seconds(srv.proc.pid)
        run["server_thread_cpu_s"] = {k: round(v - threads0.get(k, 0.0), 2) for k, v in threads1.items()
                                      if v - threads0.get(k, 0.0) > 0.005}
        if rc != 0:
            raise RunError("pgbench exited %d: %s" % (rc, (err + out).strip()[-800:]))
        run.update(parse_pgbench(out))
        if "tps" not in run:
            raise RunError("no tps in pgbench output: %s" % out.strip()[-800:])
        run["progress"] = parse_progress(err)
        run["pgbench_wall_s"] = wall
        run["server_cpu_s"] = cpu1 - cpu0
        run["nbdfuse_cpu_s"] = fcpu1 - fcpu0
        run["other_cpu_s"] = (busy1 - busy0) - (cpu1 - cpu0)  # postgres, pgbench, nbdfuse, kernel, others
        run["loadavg_1m_before"] = load0
        run["server_cpu_us_per_txn"] = (1e6 * run["server_cpu_s"] / run["transactions"]
                                        if run.get("transactions") else None)
        if target == "cvol":
            stat1 = srv.stat()
            if stat0 and stat1:
                run["timed_client_bytes_written"] = stat1["client_bytes_written"] - stat0["client_bytes_written"]
                run["timed_media_bytes_written"] = stat1["media_bytes_written"] - stat0["media_bytes_written"]
        run["db_size_after_bytes"] = int(pg.psql("select pg_database_size('postgres')").strip())

        # tear the client stack down; everything it wrote reaches the server
        t3 = time.monotonic()
        pg.stop()
        TD.close("postgres")
        vfs = os.statvfs(mnt)
        run["fs_used_bytes"] = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        TD.close("mount")
        TD.close("loop")
        TD.close("nbdfuse")
        run["teardown_s"] = time.monotonic() - t3
        run["rss_peak_mib"] = srv.rss_peak_mib()
        run["du_served_bytes"] = du_bytes(srv.path)
        if target == "cvol" and cfg["settle"] > 0:
            # clients gone: let idle cleaning return the dead space, until du
            # has not moved for 15 s or the limit is reached
            t4, last, still = time.monotonic(), run["du_served_bytes"], time.monotonic()
            while time.monotonic() - t4 < cfg["settle"] and time.monotonic() - still < 15:
                time.sleep(3)
                now = du_bytes(srv.path)
                if now != last:
                    last, still = now, time.monotonic()
            run["settle_s"] = time.monotonic() - t4
            run["du_settled_bytes"] = last
        if target == "cvol":
            st = srv.stat()
            if st:
                run["cvol_stat"] = st
        rc = srv.stop()
        run["server_exit"] = rc
        if rc != 0:
            run["warning"] = "%s exited %s after SIGTERM: %s" % (target, rc, tail(srv.err, 5))
        run["du_bytes"] = du_bytes(srv.path)
        run["apparent_bytes"] = os.path.getsize(srv.path) if os.path.exists(srv.path) else None
        if target == "cvol":
            st = run.get("cvol_stat") or {}
            run["logical_data_bytes"] = st.get("mapped_bytes")
            run["reduction_vs_du"] = (st["mapped_bytes"] / run["du_bytes"]
                                      if st.get("mapped_bytes") and run["du_bytes"] else None)
        else:
            run["logical_data_bytes"] = None
            run["reduction_vs_du"] = None
        TD.close("server " + srv.sock)
    except RunError:
        for path, name in ((srv.err, "server"), (fuse_log, "nbdfuse"), (pglog, "postgres")):
            t = tail(path, 8)
            if t:
                log("  %s log: %s" % (name, t.replace("\n", "\n    ")))
        raise
    finally:
        TD.close("server " + srv.sock, strict=False)
        srv.remove_files()
    return run


# ------------------------------------------------------------------- output ----

med = benchlib.med


def f0(v, fmt="%.0f"):
    return "-" if v is None else fmt % v


def mib(v):
    return "-" if v is None else "%.0f" % (v / MiB)


def md_table(head, rows, left=1):
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * left + ["---:"] * (len(head) - left)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(r) + " |")
    return "\n".join(lines)


def rep_table(runs):
    head = ["target", "TPS", "lat avg ms", "lat sd ms", "server CPU s", "CPU µs/txn", "FLUSH p50 µs",
            "FLUSH p99 µs", "fs used MiB", "mapped MiB", "du MiB", "mapped/du"]
    rows = []
    for r in runs:
        if r.get("error"):
            rows.append([r["target"], "FAILED: " + r["error"][:80]] + [""] * (len(head) - 2))
            continue
        fl = r.get("flush") or {}
        rows.append([r["target"], f0(r.get("tps"), "%.1f"), f0(r.get("latency_avg_ms"), "%.2f"),
                     f0(r.get("latency_stddev_ms"), "%.2f"), f0(r.get("server_cpu_s"), "%.1f"),
                     f0(r.get("server_cpu_us_per_txn")), f0(fl.get("flush_p50_us")), f0(fl.get("flush_p99_us")),
                     mib(r.get("fs_used_bytes")), mib(r.get("logical_data_bytes")), mib(r.get("du_bytes")),
                     f0(r.get("reduction_vs_du"), "%.2f")])
    return md_table(head, rows)


def summarize(runs, targets, reps):
    ok = [r for r in runs if not r.get("error") and r.get("tps") is not None]
    summ = {"targets": {}, "pairs": []}
    for t in targets:
        rs = [r for r in ok if r["target"] == t]
        fl = [r["flush"] for r in runs if r["target"] == t and r.get("flush") and not r["flush"].get("error")]
        if not rs and not fl:
            continue
        tps = [r["tps"] for r in rs]
        summ["targets"][t] = {
            "runs": len(rs),
            "tps_median": med(tps), "tps_min": min(tps) if tps else None, "tps_max": max(tps) if tps else None,
            "latency_avg_ms_median": med([r.get("latency_avg_ms") for r in rs]),
            "server_cpu_s_median": med([r.get("server_cpu_s") for r in rs]),
            "server_cpu_us_per_txn_median": med([r.get("server_cpu_us_per_txn") for r in rs]),
            "flush_p50_us_median": med([f.get("flush_p50_us") for f in fl]),
            "flush_p99_us_median": med([f.get("flush_p99_us") for f in fl]),
            "flush_p99_us_min": min([f["flush_p99_us"] for f in fl]) if fl else None,
            "flush_p99_us_max": max([f["flush_p99_us"] for f in fl]) if fl else None,
            "flush_durable_writes_per_s_median": med([f.get("durable_writes_per_s") for f in fl]),
            "du_bytes_median": med([r.get("du_bytes") for r in rs]),
            "fs_used_bytes_median": med([r.get("fs_used_bytes") for r in rs]),
            "logical_data_bytes_median": med([r.get("logical_data_bytes") for r in rs]),
            "reduction_vs_du_median": med([r.get("reduction_vs_du") for r in rs]),
        }
    if "cvol" in targets and "qemu-nbd" in targets:
        for rep in range(1, reps + 1):
            c = next((r for r in ok if r["rep"] == rep and r["target"] == "cvol"), None)
            q = next((r for r in ok if r["rep"] == rep and r["target"] == "qemu-nbd"), None)
            pair = {"rep": rep}
            if c and q and q["tps"]:
                pair["tps_ratio"] = c["tps"] / q["tps"]
                if c.get("du_bytes") and q.get("du_bytes"):
                    pair["du_ratio_qemu_over_cvol"] = q["du_bytes"] / c["du_bytes"]
            cf = next((r.get("flush") for r in runs if r["rep"] == rep and r["target"] == "cvol"), None)
            qf = next((r.get("flush") for r in runs if r["rep"] == rep and r["target"] == "qemu-nbd"), None)
            if cf and qf and cf.get("flush_p99_us") and qf.get("flush_p99_us"):
                pair["flush_p99_ratio"] = cf["flush_p99_us"] / qf["flush_p99_us"]
            summ["pairs"].append(pair)

        def agg(k):
            v = [p[k] for p in summ["pairs"] if p.get(k) is not None]
            return {"median": med(v), "min": min(v) if v else None, "max": max(v) if v else None, "n": len(v)}
        summ["tps_ratio"] = agg("tps_ratio")
        summ["flush_p99_ratio"] = agg("flush_p99_ratio")
        summ["du_ratio_qemu_over_cvol"] = agg("du_ratio_qemu_over_cvol")
    if "nbdkit-memory" in targets and "qemu-nbd" in targets:
        v = []
        for rep in range(1, reps + 1):
            m = next((r for r in ok if r["rep"] == rep and r["target"] == "nbdkit-memory"), None)
            q = next((r for r in ok if r["rep"] == rep and r["target"] == "qemu-nbd"), None)
            if m and q and q["tps"]:
                v.append(m["tps"] / q["tps"])
        summ["ceiling_tps_ratio"] = {"median": med(v), "min": min(v) if v else None,
                                     "max": max(v) if v else None, "n": len(v), "per_rep": v}
    return summ


def summary_text(summ, cfg):
    head = ["target", "runs", "TPS median", "TPS min-max", "lat avg ms", "server CPU µs/txn",
            "FLUSH p50 µs", "FLUSH p99 µs (min-max)", "fsync'd 8K writes/s", "du MiB", "mapped/du"]
    rows = []
    for t, s in summ["targets"].items():
        rows.append([t, str(s["runs"]), f0(s["tps_median"], "%.1f"),
                     "%s-%s" % (f0(s["tps_min"], "%.1f"), f0(s["tps_max"], "%.1f")),
                     f0(s["latency_avg_ms_median"], "%.2f"), f0(s["server_cpu_us_per_txn_median"]),
                     f0(s["flush_p50_us_median"]),
                     "%s (%s-%s)" % (f0(s["flush_p99_us_median"]), f0(s["flush_p99_us_min"]),
                                     f0(s["flush_p99_us_max"])),
                     f0(s["flush_durable_writes_per_s_median"]),
                     mib(s["du_bytes_median"]), f0(s["reduction_vs_du_median"], "%.2f")])
    lines = [md_table(head, rows)]
    if "tps_ratio" in summ:
        def rr(a, fmt="%.2f"):
            return "%s (min %s, max %s, %d pairs)" % (f0(a["median"], fmt), f0(a["min"], fmt), f0(a["max"], fmt),
                                                    a["n"])
        lines.append("")
        lines.append("cvol/qemu-nbd TPS per rep: " + ", ".join(
            "rep %d %s" % (p["rep"], f0(p.get("tps_ratio"), "%.2f")) for p in summ["pairs"]))
        lines.append("cvol/qemu-nbd TPS: median " + rr(summ["tps_ratio"]))
        if not cfg["skip_flush_fio"]:
            lines.append("cvol/qemu-nbd FLUSH p99: median " + rr(summ["flush_p99_ratio"]))
        lines.append("host space qemu-nbd du / cvol du: median " + rr(summ["du_ratio_qemu_over_cvol"]))
    if "ceiling_tps_ratio" in summ:
        c = summ["ceiling_tps_ratio"]
        lines.append("nbdkit-memory/qemu-nbd TPS (the most any server could give this client stack): median "
                     "%s (min %s, max %s, %d pairs)" % (f0(c["median"], "%.2f"), f0(c["min"], "%.2f"),
                                                       f0(c["max"], "%.2f"), c["n"]))
    return "\n".join(lines)


# --------------------------------------------------------------------- main ----

tool_version = benchlib.tool_version
git_describe = benchlib.git_describe


def check_tools(args):
    if os.geteuid() != 0:
        log("needs root (loop devices, mount, FUSE)")
        sys.exit(2)
    if not os.path.exists("/dev/fuse"):
        log("/dev/fuse missing")
        sys.exit(2)
    missing = []
    for tool, pkg in (("nbdfuse", "nbdfuse"), ("nbdinfo", "libnbd-bin"), ("losetup", "mount"),
                      ("mkfs.ext4", "e2fsprogs"), ("runuser", "util-linux"), ("fio", "fio"),
                      ("qemu-nbd", "qemu-utils"), ("nbdkit", "nbdkit")):
        if tool in ("qemu-nbd", "nbdkit") and not any(t.startswith(tool) for t in args.targets):
            continue
        if tool == "fio" and args.skip_flush_fio:
            continue
        if shutil.which(tool) is None:
            missing.append((tool, pkg))
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        missing.append(("fusermount3", "fuse3"))
    for b in ("initdb", "pg_ctl", "postgres", "pgbench", "psql"):
        if not os.access(os.path.join(args.pg_bin, b), os.X_OK):
            missing.append((os.path.join(args.pg_bin, b), "postgresql-15 postgresql-client-15"))
    if missing:
        log("missing: " + ", ".join(t for t, _ in missing))
        log("install with:  apt-get install " + " ".join(sorted(set(p for _, p in missing))))
        sys.exit(2)
    try:
        pwd.getpwnam(args.pg_user)
    except KeyError:
        log("no user %r to run PostgreSQL as (it refuses to run as root): pass --pg-user or create one, "
            "e.g. useradd --system --no-create-home %s" % (args.pg_user, args.pg_user))
        sys.exit(2)
    if not args.skip_flush_fio:
        r = subprocess.run(["fio", "--enghelp=nbd"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if r.returncode != 0:
            log("this fio has no nbd ioengine (Debian's fio package has it); or pass --skip-flush-fio")
            sys.exit(2)


def main():
    ap = argparse.ArgumentParser(
        prog="scripts/bench/pgbench",
        description="pgbench (PostgreSQL 15) on ext4 on an NBD export: cvol vs qemu-nbd serving a raw file, "
                    "plus FLUSH latency through fio's nbd engine.  Needs root.")
    ap.add_argument("--cvol", help="cvol binary (default target/release/cvol, built if missing)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every target (default 3)")
    ap.add_argument("--scale", type=int, default=30, help="pgbench -i -s (default 30, ~450 MB)")
    ap.add_argument("--clients", type=int, default=8, help="pgbench -c (default 8)")
    ap.add_argument("--threads", type=int, default=2, help="pgbench -j (default 2)")
    ap.add_argument("--runtime", type=int, default=60, help="pgbench -T seconds (default 60)")
    ap.add_argument("--progress", type=int, default=10, help="pgbench -P seconds (default 10)")
    ap.add_argument("--size", default="8G", help="device size, both targets (default 8G)")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help="comma-separated subset of cvol,qemu-nbd,nbdkit-memory (default cvol,qemu-nbd; "
                         "nbdkit-memory keeps the data in RAM: the ceiling any server could reach)")
    ap.add_argument("--cvol-create-args", default="", help="extra args for cvol create, e.g. '--dedup off'")
    ap.add_argument("--cvol-serve-args", default="", help="extra args for cvol serve, e.g. '--sync'")
    ap.add_argument("--qemu-cache", default="writeback", help="qemu-nbd --cache (default writeback, as scripts/bench/run)")
    ap.add_argument("--qemu-aio", default="threads", help="qemu-nbd --aio (default threads, as scripts/bench/run)")
    ap.add_argument("--qemu-shared", type=int, default=8,
                    help="qemu-nbd --shared (default 8: lets the fio probe's jobs connect and makes qemu-nbd "
                         "advertise multi-conn like cvol, so nbdfuse opens the same 4 connections to both; "
                         "0 = leave qemu-nbd's default of 1: one nbdfuse connection; the probe then needs "
                         "--flush-jobs 1)")
    ap.add_argument("--mkfs-args", default="-E lazy_itable_init=0,lazy_journal_init=0",
                    help="extra mkfs.ext4 args after '-q -F' (default: initialize inode tables and journal "
                         "now, so no ext4lazyinit thread writes during the timed run)")
    ap.add_argument("--mount-opts", default="", help="mount -o options for the ext4 (default: none)")
    ap.add_argument("--shared-buffers", default="128MB", help="PostgreSQL shared_buffers (default 128MB)")
    ap.add_argument("--pg-setting", action="append", default=[],
                    help="extra postgresql.conf line, e.g. 'synchronous_commit = off' (repeatable)")
    ap.add_argument("--pg-bin", default="/usr/lib/postgresql/15/bin", help="PostgreSQL binaries")
    ap.add_argument("--pg-user", default="postgres", help="user PostgreSQL runs as (default postgres)")
    ap.add_argument("--pg-port", type=int, default=55432,
                    help="port (only names the socket file in the run's own socket dir; default 55432)")
    ap.add_argument("--skip-flush-fio", action="store_true", help="skip the fio FLUSH-latency probe")
    ap.add_argument("--settle", type=int, default=0,
                    help="cvol: seconds, at most, to wait after the clients are gone for idle cleaning "
                         "to return dead space, then record du_settled_bytes (default 0: no wait)")
    ap.add_argument("--flush-runtime", type=float, default=20, help="seconds of the FLUSH probe (default 20)")
    ap.add_argument("--flush-jobs", type=int, default=4, help="fio jobs (connections) of the FLUSH probe (default 4)")
    ap.add_argument("--dir", default="/var/tmp", help="where the temp dir goes (default /var/tmp)")
    ap.add_argument("--out", help="JSON results (default /tmp/pgbench-TIMESTAMP.json; a .md beside it)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (server, nbdfuse, postgres logs)")
    args = ap.parse_args()

    args.targets = ["qemu-nbd" if t.strip() == "qemu" else t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad or not args.targets:
        ap.error("unknown target(s) %s; choose from %s" % (",".join(bad), ",".join(TARGETS)))
    targets = [t for t in TARGETS if t in args.targets]
    size = parse_size(args.size)
    if size % MiB:
        ap.error("--size must be a multiple of 1 MiB")
    if args.qemu_shared == 0 and "qemu-nbd" in targets and not args.skip_flush_fio and args.flush_jobs > 1:
        ap.error("--qemu-shared 0 serves one client at a time: use --flush-jobs 1 or --skip-flush-fio")
    check_tools(args)

    cvol = benchlib.find_cvol(args.cvol, log) if "cvol" in targets else None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = os.path.abspath(args.out or "/tmp/pgbench-%s.json" % stamp)
    md_path = os.path.splitext(json_path)[0] + ".md"

    STATE["keep"] = args.keep
    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="cvol-pgbench.", dir=args.dir)
    STATE["workdir"] = workdir
    os.chmod(workdir, 0o755)  # postgres must reach its data dir and socket dir
    raw_dir = os.path.join(workdir, "fio")
    os.mkdir(raw_dir)
    cvol_sha = None
    if cvol:
        # run a private copy: a concurrent `cargo build` cannot swap the binary between reps
        with open(cvol, "rb") as f:
            cvol_sha = hashlib.sha256(f.read()).hexdigest()[:16]
        private = os.path.join(workdir, "cvol")
        shutil.copy2(cvol, private)
        cvol_orig, cvol = cvol, private

    cfg = {
        "size": size, "cvol": cvol, "reps": args.reps, "scale": args.scale, "clients": args.clients,
        "threads": args.threads, "runtime": args.runtime, "progress": args.progress,
        "cvol_create_args": shlex.split(args.cvol_create_args),
        "cvol_serve_args": shlex.split(args.cvol_serve_args),
        "qemu_cache": args.qemu_cache, "qemu_aio": args.qemu_aio, "qemu_shared": args.qemu_shared,
        "mkfs_args": shlex.split(args.mkfs_args), "mount_opts": args.mount_opts,
        "shared_buffers": args.shared_buffers, "pg_settings": args.pg_setting,
        "pg_bin": args.pg_bin, "pg_user": args.pg_user, "pg_port": args.pg_port,
        "skip_flush_fio": args.skip_flush_fio, "flush_runtime": args.flush_runtime,
        "flush_jobs": args.flush_jobs, "raw_dir": raw_dir, "settle": args.settle,
    }
    machine = {
        "hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                           if l.startswith("model name")), "?"),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "dir_fs": cmd_run(["df", "--output=source,fstype", workdir], 20, check=False).out.split("\n")[1:2],
    }
    versions = {"git": git_describe(), "postgres": tool_version([os.path.join(args.pg_bin, "postgres"), "--version"]),
                "pgbench": tool_version([os.path.join(args.pg_bin, "pgbench"), "--version"]),
                "nbdfuse": tool_version(["nbdfuse", "--version"]), "kernel": platform.release()}
    if not args.skip_flush_fio:
        versions["fio"] = tool_version(["fio", "--version"])
    if cvol:
        versions["cvol"] = tool_version([cvol, "--version"])
        versions["cvol_binary"] = "%s (sha256 %s)" % (cvol_orig, cvol_sha)
    if "qemu-nbd" in targets:
        versions["qemu-nbd"] = tool_version(["qemu-nbd", "--version"])
    qemu_cmd = "qemu-nbd -f raw -t -k SOCK --cache=%s --aio=%s%s FILE" % (
        args.qemu_cache, args.qemu_aio, " --shared=%d" % args.qemu_shared if args.qemu_shared else "")
    config = {k: v for k, v in cfg.items() if k not in ("cvol", "raw_dir")}
    config.update({
        "size_bytes": size, "workdir": workdir, "targets": targets,
        "cvol_create": "cvol create VOL --size %d %s" % (size, args.cvol_create_args),
        "cvol_serve": "cvol serve VOL --socket SOCK %s" % args.cvol_serve_args,
        "qemu_nbd": qemu_cmd,
        "attach": "nbdfuse DIR URI; losetup -f --show DIR/nbd; mkfs.ext4 -q -F %s LOOP; mount -t ext4%s LOOP MNT"
                  % (args.mkfs_args, " -o " + args.mount_opts if args.mount_opts else ""),
        "postgres": "initdb --auth=trust -E UTF8 --locale=C; listen_addresses='', shared_buffers=%s, fsync=on%s"
                    % (args.shared_buffers, "".join(", " + s for s in args.pg_setting)),
        "pgbench": "pgbench -i -s %d; CHECKPOINT; sync -f; pgbench -c %d -j %d -T %g -P %d"
                   % (args.scale, args.clients, args.threads, args.runtime, args.progress),
        "flush_probe": None if args.skip_flush_fio else
        "fio ioengine=nbd numjobs=%d rw=randwrite bs=8k iodepth=1 fsync=1 runtime=%gs on a fresh export, "
        "55%%-compressible buffers; FLUSH latency = the 'sync' lat_ns percentiles"
        % (args.flush_jobs, args.flush_runtime),
    })
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in sys.argv),
              "machine": machine, "versions": versions, "config": config, "runs": [], "summary": {}}

    log("cvol pgbench: %d reps x %s, device %s, scale %d, -c %d -j %d -T %g, work dir %s"
        % (args.reps, ",".join(targets), fmt_size(size), args.scale, args.clients, args.threads,
           args.runtime, workdir))
    log("  qemu-nbd: " + qemu_cmd)
    log("  results: " + json_path)

    def save():
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)

    failures = 0
    md = ["# pgbench on ext4 on NBD: %s" % result["date"], "", "`%s`" % result["command"], "",
          "device %s, scale %d, -c %d -j %d -T %gs; %s; cvol %s; %s" % (
              fmt_size(size), args.scale, args.clients, args.threads, args.runtime, qemu_cmd,
              versions.get("cvol", "-"), versions["git"]), ""]
    for rep in range(1, args.reps + 1):
        i = (rep - 1) % len(targets)
        order = targets[i:] + targets[:i]
        rep_runs = []
        for t in order:
            tag = "%s-%d" % (t, rep)
            run = {"target": t, "rep": rep, "order": order.index(t)}
            result["runs"].append(run)
            rep_runs.append(run)
            t0 = time.monotonic()
            try:
                if not args.skip_flush_fio:
                    try:
                        run["flush"] = flush_probe(cfg, workdir, tag, t)
                        f = run["flush"]
                        log("rep %d %-8s FLUSH p50 %6.0f p99 %6.0f p99.9 %6.0f us, %5.0f fsync'd 8K writes/s, "
                            "server cpu %.1fs%s" % (rep, t, f["flush_p50_us"] or 0, f["flush_p99_us"] or 0,
                                                    f["flush_p999_us"] or 0, f["write_iops"], f["server_cpu_s"],
                                                    ("  WARNING " + f["warning"]) if "warning" in f else ""))
                    except RunError as e:
                        failures += 1
                        run["flush"] = {"error": str(e)}
                        log("rep %d %-8s FLUSH probe FAILED: %s" % (rep, t, e))
                    save()
                run.update(pgbench_run(cfg, workdir, tag, t))
                run["total_s"] = time.monotonic() - t0
                extra = ""
                st = run.get("cvol_stat")
                if st:
                    extra = "  mapped %s MiB stored %s MiB used %s MiB (reduction %.2f, WA %.2f, cleaned %s)" % (
                        mib(st.get("mapped_bytes")), mib(st.get("stored_bytes")), mib(st.get("physical_used_bytes")),
                        st.get("reduction_ratio") or 0, st.get("write_amplification") or 0,
                        st.get("cleaner_segments_cleaned"))
                log("rep %d %-8s %8.1f TPS  lat %6.2f ms  server cpu %5.1fs (%4.0f us/txn)  nbdfuse cpu %5.1fs  "
                    "other %5.1fs  fs used %s MiB  du %s MiB  init %.0fs  teardown %.0fs%s%s"
                    % (rep, t, run["tps"], run.get("latency_avg_ms") or 0, run["server_cpu_s"],
                       run.get("server_cpu_us_per_txn") or 0, run["nbdfuse_cpu_s"], run["other_cpu_s"],
                       mib(run.get("fs_used_bytes")), mib(run.get("du_bytes")), run["init_s"],
                       run["teardown_s"], extra, ("  WARNING " + run["warning"]) if "warning" in run else ""))
            except RunError as e:
                failures += 1
                run["error"] = str(e)
                log("rep %d %-8s FAILED: %s" % (rep, t, e))
            finally:
                TD.unwind()
                # keep a slim copy of the cvol stat keys that matter next to the full object
                st = run.get("cvol_stat")
                if st:
                    run["cvol_stat_summary"] = {k: st.get(k) for k in STAT_KEYS if k in st}
                    run["cvol_stat_flush_keys"] = {k: v for k, v in st.items() if FLUSH_KEY_RE.search(k)}
                save()
        tbl = "rep %d (order %s)\n\n%s" % (rep, " then ".join(order), rep_table(sorted(rep_runs, key=lambda r: targets.index(r["target"]))))
        md += ["## " + tbl.split("\n", 1)[0], "", tbl.split("\n\n", 1)[1], ""]
        print(tbl + "\n", flush=True)

    summ = summarize(result["runs"], targets, args.reps)
    result["summary"] = summ
    save()
    text = summary_text(summ, cfg)
    notes = ("TPS excludes connection setup (pgbench 'without initial connection time'); server CPU = "
             "utime+stime of the NBD server during the timed pgbench run; FLUSH = NBD FLUSH latency of fio's "
             "nbd engine (%d jobs, 8 KiB random writes, fsync=1, %gs, fresh export); du = host space of the "
             "backing file after the client stack was torn down and the server stopped; mapped = cvol's "
             "mapped_bytes (non-zero logical data).") % (args.flush_jobs, args.flush_runtime)
    print("summary\n\n" + text + "\n\n" + notes)
    md += ["## summary", "", text, "", notes, ""]
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    print("\nresults: %s\ntable:   %s" % (json_path, md_path))
    return 1 if failures else 0


def mounts_under(d):
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if mp == d or mp.startswith(d.rstrip("/") + "/"):
                out.append(mp)
    return out


def cleanup():
    benchlib.ignore_signals(SIGNALS)
    TD.unwind()
    benchlib.remove_workdir(STATE, log, mounts_under)


def entry():
    """`scripts/bench/pgbench`: main() with cleanup on exit and on a signal."""
    benchlib.run_main(main, cleanup, log,
                      "stopping postgres, unmounting, stopping servers, removing temp files", SIGNALS)


if __name__ == "__main__":
    entry()
