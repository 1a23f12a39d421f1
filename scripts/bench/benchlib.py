"""Helpers shared by the scripts in scripts/bench.

The scripts import it (and the library halves of `run` and `pgbench`,
benchrun.py and benchpg.py) after putting their own directory first on
sys.path:

    HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, HERE)
    import benchlib

Everything here keeps the exact messages the scripts printed before it was
shared; where two scripts printed differently (a timestamp or not, an
indent), the function takes the difference as an argument.
"""

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """Raised by `on_signal` in the main thread: unwinds to `run_main`."""



def on_signal(signum, _frame):
    raise Interrupted(signum)


def log(msg):
    """A line on stderr, stamped with the time of day."""
    sys.stderr.write("[%s] %s\n" % (time.strftime("%H:%M:%S"), msg))
    sys.stderr.flush()


def log_plain(msg):
    """A line on stderr, as `run` prints them (no timestamp)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def parse_size(s):
    s = str(s).strip()
    units = {"k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
    if s and s[-1].lower() in units:
        return int(float(s[:-1]) * units[s[-1].lower()])
    return int(s)


def fmt_size(n):
    for u, v in (("T", 1 << 40), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= v and n % v == 0:
            return "%d%s" % (n // v, u)
    return str(n)


def tail(path, n=20):
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def terminate(proc, timeout=10.0, log=log_plain, indent="  "):
    """SIGTERM, wait, then SIGKILL; returns the exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log("%spid %d ignored SIGTERM for %.0fs, sending SIGKILL" % (indent, proc.pid, timeout))
            proc.kill()
    return proc.wait()


def wait_server_ready(server, timeout=60):
    """Waits until `server` (kind, proc, out, err, sock) serves: cvol prints
    its nbd+unix:// URI on stdout once it listens; qemu-nbd and nbdkit are
    ready when their socket accepts. Sets server.uri; raises
    server.error (the caller's exception class) if it exits or is not
    ready in time."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise server.error("%s exited (%s) before it was ready: %s"
                               % (server.kind, server.proc.returncode, tail(server.err)))
        if time.monotonic() > deadline:
            raise server.error("%s not ready after %ds: %s"
                               % (server.kind, timeout, tail(server.err)))
        if server.kind == "cvol":
            with open(server.out, "rb") as f:
                for line in f.read().decode("utf-8", "replace").splitlines():
                    if line.startswith("nbd+unix://"):
                        server.uri = line.strip()
            if server.uri:
                return
        elif os.path.exists(server.sock):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(server.sock)
                server.uri = "nbd+unix:///?socket=" + server.sock
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)


def tool_version(cmd):
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=20)
        return r.stdout.decode("utf-8", "replace").strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def git_describe():
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode().strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "crates"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode().strip()
        return head + ("+uncommitted changes under crates/" if dirty else "")
    except OSError:
        return "?"


def default_cvol():
    """The release binary of this checkout (`$CARGO_TARGET_DIR` honoured)."""
    tdir = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    return os.path.join(os.path.abspath(tdir), "release", "cvol")


def find_cvol(path_arg, log=log):
    """The cvol binary to bench: PATH_ARG (`--cvol`) if given, which must be
    executable, else this checkout's release binary, built when missing.
    Exits 2 when there is none."""
    if path_arg:
        path = os.path.abspath(path_arg)
        if not os.access(path, os.X_OK):
            log("cvol binary %s not found or not executable" % path)
            sys.exit(2)
        return path
    path = default_cvol()
    if not os.access(path, os.X_OK):
        log("%s missing: cargo build --release" % path)
        r = subprocess.run(["cargo", "build", "--release"], cwd=REPO)
        if r.returncode != 0 or not os.access(path, os.X_OK):
            log("cargo build --release failed")
            sys.exit(2)
    return path


def ignore_signals(sigs=SIGNALS):
    """From now on the signals that interrupt a run are ignored (cleanup)."""
    for sig in sigs:
        signal.signal(sig, signal.SIG_IGN)


def remove_workdir(state, log=log, mounts_under=None):
    """Removes state["workdir"] unless state["keep"] (`--keep`) or, with
    `mounts_under`, something is still mounted below it: never rmtree
    through a mount, that would delete inside it."""
    wd = state["workdir"]
    if wd and os.path.isdir(wd):
        left = mounts_under(wd) if mounts_under else []
        if left:
            log("still mounted, leaving %s: %s" % (wd, " ".join(left)))
        elif state["keep"]:
            log("--keep: leaving %s" % wd)
        else:
            shutil.rmtree(wd, ignore_errors=True)


def run_main(main, cleanup, log, stopping, sigs=SIGNALS, errors=()):
    """Runs main() with SIGS raising Interrupted, then cleanup() whatever
    happens, and exits with main's code: 128 + N after signal N (logged
    with what `stopping` says is being undone), 130 after ^C. `errors`:
    (exception class, message format, exit code) for errors main may raise
    that end the run with a message and no traceback."""
    for sig in sigs:
        signal.signal(sig, on_signal)
    rc = 1
    try:
        rc = main()
    except Interrupted as e:
        log("interrupted by signal %d: %s" % (e.args[0], stopping))
        rc = 128 + e.args[0]
    except KeyboardInterrupt:
        rc = 130
    except tuple(cls for cls, _, _ in errors) as e:
        fmt, code = [(f, c) for cls, f, c in errors if isinstance(e, cls)][0]
        log(fmt % e)
        rc = code
    finally:
        cleanup()
    sys.exit(rc)
