#!/usr/bin/env python3
"""Client side of snapshots.sh's incremental backup (libnbd Python bindings).

  incremental_backup.py fill   URI              -- every 4 KiB block: 2 KiB random, 2 KiB zero; flush
  incremental_backup.py change URI PERCENT SEED -- random 64 KiB writes (distinct, aligned) over
                                                   PERCENT of the export; flush
  incremental_backup.py backup URI CONTEXT FILE -- copy the extents CONTEXT flags dirty (flag 1)
                                                   from the export into FILE at the same offsets
  incremental_backup.py writer URI              -- random 64 KiB writes, a flush every 16, until
                                                   an error (the server was killed)

`change` and `backup` print one JSON object: what was written, or what the
metadata context reported and what was read.
"""
import json
import os
import random
import sys

sys.dont_write_bytecode = True
import nbd  # noqa: E402

CHUNK = 64 << 10
# A request stays under the server's 32 MiB maximum block size.
READ_MAX = 16 << 20
# How much one NBD_CMD_BLOCK_STATUS asks about (a 32-bit length).
STATUS_MAX = 1 << 30


def connect(uri, context=None):
    h = nbd.NBD()
    if context:
        h.add_meta_context(context)
    h.connect_uri(uri)
    if context and not h.can_meta_context(context):
        sys.exit("the server did not agree to metadata context %s" % context)
    return h


def fill(uri):
    h = connect(uri)
    size = h.get_size()
    step = 1 << 20
    for at in range(0, size, step):
        n = min(step, size - at)
        buf = bytearray(n)
        for b in range(0, n, 4096):
            buf[b:b + 2048] = os.urandom(2048)
        h.pwrite(bytes(buf), at)
    h.flush()
    h.shutdown()


def change(uri, percent, seed):
    h = connect(uri)
    size = h.get_size()
    n = round(size * percent / 100 / CHUNK)
    chunks = sorted(random.Random(seed).sample(range(size // CHUNK), n))
    for c in chunks:
        h.pwrite(os.urandom(CHUNK), c * CHUNK)
    h.flush()
    h.shutdown()
    print(json.dumps({"size": size, "chunks": n, "bytes": n * CHUNK}))


def dirty_runs(h, context):
    """(offset, length) of each run CONTEXT flags 1, merged, over the export."""
    size = h.get_size()
    runs = []
    at = 0
    while at < size:
        got = []

        def cb(meta, off, entries, err):
            if meta == context:
                got.extend(entries)
            return 0

        h.block_status(min(STATUS_MAX, size - at), at, cb)
        if not got:
            sys.exit("block status at %d: no extents for %s" % (at, context))
        for i in range(0, len(got), 2):
            length, flags = got[i], got[i + 1]
            length = min(length, size - at)
            if flags & 1:
                if runs and runs[-1][0] + runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], runs[-1][1] + length)
                else:
                    runs.append((at, length))
            at += length
    return runs


def backup(uri, context, path):
    h = connect(uri, context)
    size = h.get_size()
    runs = dirty_runs(h, context)
    read = 0
    with open(path, "r+b") as f:
        if os.fstat(f.fileno()).st_size != size:
            sys.exit("%s is not %d bytes (a full backup of the export)" % (path, size))
        for off, length in runs:
            for at in range(off, off + length, READ_MAX):
                n = min(READ_MAX, off + length - at)
                buf = h.pread(n, at)
                read += n
                f.seek(at)
                f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    h.shutdown()
    dirty = sum(n for _, n in runs)
    print(json.dumps({"size": size, "runs": len(runs), "dirty_bytes": dirty, "bytes_read": read}))


def writer(uri):
    h = connect(uri)
    size = h.get_size()
    rnd = random.Random(7)
    k = 0
    try:
        while True:
            h.pwrite(os.urandom(CHUNK), rnd.randrange(size // CHUNK) * CHUNK)
            k += 1
            if k % 16 == 0:
                h.flush()
                print("flushed %d" % k, flush=True)
    except nbd.Error as e:
        print("stopped after %d writes: %s" % (k, e), flush=True)


def main(argv):
    if len(argv) == 3 and argv[1] == "fill":
        fill(argv[2])
    elif len(argv) == 5 and argv[1] == "change":
        change(argv[2], float(argv[3]), int(argv[4]))
    elif len(argv) == 5 and argv[1] == "backup":
        backup(argv[2], argv[3], argv[4])
    elif len(argv) == 3 and argv[1] == "writer":
        writer(argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
