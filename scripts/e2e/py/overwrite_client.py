#!/usr/bin/env python3
"""Client side of overwrite.sh (libnbd Python bindings).

  overwrite_client.py write  URI PASSES   -- overwrite the whole export PASSES
                                            times, flushing after each pass
  overwrite_client.py verify URI PASS     -- every block holds pass PASS's data

Block i of pass p is written with seed p * 10_000_000 + i, using the same
compressible (~4x) content generator as kill9_client.py.
"""
import os
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbd  # noqa: E402
from kill9_client import BLOCK, CHUNK, PER_BLOCK, block_data, describe  # noqa: E402


def seed_of(p, i):
    return p * 10_000_000 + i


def do_write(uri, passes):
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    nblocks = size // BLOCK
    for p in range(1, passes + 1):
        t0 = time.monotonic()
        for i in range(nblocks):
            try:
                h.pwrite(block_data(seed_of(p, i)), i * BLOCK)
            except nbd.Error as e:
                print("overwrite: pass %d/%d failed at offset %d (%.0f%% of the pass, "
                      "%d MiB written in total): %s"
                      % (p, passes, i * BLOCK, 100.0 * i / nblocks,
                         ((p - 1) * size + i * BLOCK) >> 20, e))
                return 1
        h.flush()
        print("overwrite: pass %d/%d: %d MiB in %.1fs" % (p, passes, size >> 20, time.monotonic() - t0))
    h.shutdown()
    return 0


def do_verify(uri, p):
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    bad = 0
    for i in range(size // BLOCK):
        got = h.pread(BLOCK, i * BLOCK)
        want = block_data(seed_of(p, i))
        if got != want:
            for k in range(PER_BLOCK):
                g = got[k * CHUNK:(k + 1) * CHUNK]
                if g != want[k * CHUNK:(k + 1) * CHUNK]:
                    bad += 1
                    if bad <= 20:
                        print("  MISMATCH at offset %d: found %s" % (i * BLOCK + k * CHUNK, describe(g)))
    h.shutdown()
    print("overwrite: verify pass %d: %s" % (p, "%d bad 4 KiB chunks" % bad if bad else "all data correct"))
    return 1 if bad else 0


def main(argv):
    if len(argv) == 4 and argv[1] == "write":
        return do_write(argv[2], int(argv[3]))
    if len(argv) == 4 and argv[1] == "verify":
        return do_verify(argv[2], int(argv[3]))
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
