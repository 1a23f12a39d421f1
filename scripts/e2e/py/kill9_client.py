#!/usr/bin/env python3
"""Client side of kill9.sh (uses the libnbd Python bindings, as nbdsh does).

  kill9_client.py write  URI JOURNAL SEED_BASE MAX_SECONDS [sync]
  kill9_client.py verify URI JOURNAL BASELINE_IN BASELINE_OUT

write: loops writing 64 KiB blocks of seeded, compressible data at random
4 KiB-aligned offsets over two connections when the export advertises
multi-conn (one otherwise), calling flush on either every 4-16 writes (and using FUA on ~10%
of writes when the export supports it), until the server goes away or
MAX_SECONDS pass.  The journal records, in order:
    W seq offset seed fua   before a write is issued (it may or may not land)
    C seq                   after that write completed
    F seq                   after a flush issued after write `seq` completed
A write is durable if a later F covers it, or if it completed with FUA.
With `sync` (server started with --sync: every write is durable before it is
acknowledged) no flushes are sent and each completed write is journaled as
durable ("F seq" right after "C seq").

verify: reads the whole export and checks every 4 KiB chunk: it must hold the
content of the last durable write covering it, or of any write journaled after
that one (an unflushed write may legitimately have landed, even partially at
4 KiB granularity); a chunk with no durable write may also hold its baseline
content (what the previous iteration verified, or zeroes).  On success the
image read is saved as BASELINE_OUT for the next iteration.
"""
import os
import random
import struct
import sys
import time

import nbd

BLOCK = 65536
CHUNK = 4096
PER_BLOCK = BLOCK // CHUNK

_units = {}


def unit(seed):
    u = _units.get(seed)
    if u is None:
        r = random.Random(seed)
        u = bytes(r.getrandbits(8) for _ in range(1024))
        _units[seed] = u
    return u


def chunk_data(seed, k):
    """4 KiB chunk k of the block written with `seed`: a 16-byte header
    identifying it, then 1 KiB of random bytes repeated (compresses ~4x)."""
    u = unit(seed)
    return struct.pack("<QQ", seed, k) + u[16:] + u * 3


def block_data(seed):
    return b"".join(chunk_data(seed, k) for k in range(PER_BLOCK))


def describe(chunk):
    seed, k = struct.unpack("<QQ", chunk[:16])
    if seed and k < PER_BLOCK and chunk == chunk_data(seed, k):
        return "chunk %d of write seed %d" % (k, seed)
    if chunk == bytes(CHUNK):
        return "zeroes"
    return "unrecognised data (first bytes %s)" % chunk[:16].hex()


def do_write(uri, journal, seed_base, max_secs, sync=False):
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    fua_ok = h.can_fua()
    # With multi-conn advertised, a flush on any connection must cover writes
    # completed on every connection: spread writes and flushes over two.
    handles = [h]
    if h.can_multi_conn():
        h2 = nbd.NBD()
        h2.connect_uri(uri)
        handles.append(h2)
    rng = random.Random(seed_base)
    slots = (size - BLOCK) // CHUNK + 1
    seq = last_flush = nfua = 0
    next_flush = rng.randint(4, 16)
    deadline = time.monotonic() + max_secs
    err = None
    with open(journal, "a") as j:
        try:
            while time.monotonic() < deadline:
                seq += 1
                off = rng.randrange(slots) * CHUNK
                seed = seed_base * 10_000_000 + seq
                fua = fua_ok and not sync and rng.random() < 0.1
                j.write("W %d %d %d %d\n" % (seq, off, seed, int(fua)))
                j.flush()
                rng.choice(handles).pwrite(block_data(seed), off,
                                           nbd.CMD_FLAG_FUA if fua else 0)
                j.write("C %d\n" % seq)
                nfua += fua
                if sync:
                    j.write("F %d\n" % seq)
                    j.flush()
                    last_flush = seq
                    continue
                next_flush -= 1
                if next_flush == 0:
                    rng.choice(handles).flush()
                    j.write("F %d\n" % seq)
                    j.flush()
                    last_flush = seq
                    next_flush = rng.randint(4, 16)
        except nbd.Error as e:
            err = e
    print("writer: %d connection(s), %d writes issued, %d with FUA, last flush covers write %d; %s"
          % (len(handles), seq, nfua, last_flush,
             "stopped by: %s" % err if err else "time limit reached"))
    # exit 0 only if the run ended because the server went away
    return 0 if err else 3


def do_verify(uri, journal, baseline_in, baseline_out):
    writes = []  # [seq, off, seed, fua, completed]
    by_seq = {}
    flushed_upto = 0
    with open(journal) as j:
        for line in j:
            f = line.split()
            if not f:
                continue
            if f[0] == "W":
                w = [int(f[1]), int(f[2]), int(f[3]), f[4] == "1", False]
                writes.append(w)
                by_seq[w[0]] = w
            elif f[0] == "C":
                by_seq[int(f[1])][4] = True
            elif f[0] == "F":
                flushed_upto = max(flushed_upto, int(f[1]))

    def durable(w):
        return w[0] <= flushed_upto or (w[3] and w[4])

    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    img = bytearray()
    step = 4 << 20
    for off in range(0, size, step):
        img += h.pread(min(step, size - off), off)
    h.shutdown()

    if baseline_in and os.path.exists(baseline_in):
        with open(baseline_in, "rb") as b:
            base = b.read()
        assert len(base) == size, "baseline size mismatch"
    else:
        base = bytes(size)

    hist = {}  # chunk index -> [(write, k)] in journal order
    for w in writes:
        c0 = w[1] // CHUNK
        for k in range(PER_BLOCK):
            hist.setdefault(c0 + k, []).append((w, k))

    errors = []
    n_durable_checked = n_later = 0
    for c in range(size // CHUNK):
        got = bytes(img[c * CHUNK:(c + 1) * CHUNK])
        h_c = hist.get(c)
        if not h_c:
            if got != base[c * CHUNK:(c + 1) * CHUNK]:
                errors.append("chunk at %d (never written this round) changed: holds %s"
                              % (c * CHUNK, describe(got)))
            continue
        d = None
        for i, (w, _) in enumerate(h_c):
            if durable(w):
                d = i
        if d is None:
            cands = [base[c * CHUNK:(c + 1) * CHUNK]]
            cands += [chunk_data(w[2], k) for w, k in h_c]
        else:
            n_durable_checked += 1
            cands = [chunk_data(w[2], k) for w, k in h_c[d:]]
        if got in cands:
            if d is not None and got != cands[0]:
                n_later += 1
            continue
        if d is None:
            want = "baseline or any of %d unflushed writes" % len(h_c)
        else:
            w, k = h_c[d]
            want = "durable write seq %d (seed %d, chunk %d%s) or one of %d later writes" % (
                w[0], w[2], k, ", FUA" if w[3] and w[0] > flushed_upto else "",
                len(h_c) - d - 1)
        errors.append("chunk at offset %d: expected %s, found %s" % (c * CHUNK, want, describe(got)))

    n_w = len(writes)
    n_dur = sum(1 for w in writes if durable(w))
    print("verify: %d writes journaled, %d durable (flush covers seq %d); "
          "%d chunks with a durable write checked, %d of them hold a later unflushed write"
          % (n_w, n_dur, flushed_upto, n_durable_checked, n_later))
    if errors:
        for e in errors[:25]:
            print("  MISMATCH:", e)
        if len(errors) > 25:
            print("  ... and %d more mismatching chunks" % (len(errors) - 25))
        return 1
    if baseline_out:
        with open(baseline_out, "wb") as b:
            b.write(img)
    return 0


def main(argv):
    if len(argv) in (6, 7) and argv[1] == "write":
        sync = len(argv) == 7 and argv[6] == "sync"
        return do_write(argv[2], argv[3], int(argv[4]), float(argv[5]), sync)
    if len(argv) == 6 and argv[1] == "verify":
        return do_verify(argv[2], argv[3], argv[4], argv[5])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
