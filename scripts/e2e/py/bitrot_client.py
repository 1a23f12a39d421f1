#!/usr/bin/env python3
"""Helpers for bitrot.sh (damage at rest never drops flushed data
silently).

  bitrot_client.py write URI IMAGE       every 4 KiB block of IMAGE as its own
                                         write, then FLUSH
  bitrot_client.py flip FILE SEED N      flip one byte at N random offsets inside
                                         non-zero 4 KiB blocks past the first MiB
  bitrot_client.py verify URI IMAGE OUT  read every block: it must be exact or
                                         fail with EIO; the LBAs that failed go
                                         to OUT (one per line). Exit 1 on any
                                         block that reads other data (zeros
                                         included), naming it.
"""
import os
import random
import sys

import nbd

BS = 4096


def connect(uri):
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def write(uri, image):
    h = connect(uri)
    with open(image, "rb") as f:
        off = 0
        while True:
            b = f.read(BS)
            if not b:
                break
            if len(b) < BS:
                b += bytes(BS - len(b))
            h.pwrite(b, off)
            off += BS
    h.flush()
    h.shutdown()


def flip(path, seed, n):
    rng = random.Random(seed)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        done = 0
        tries = 0
        while done < n and tries < 100000:
            tries += 1
            blk = rng.randrange((1 << 20) // BS, size // BS)
            f.seek(blk * BS)
            b = f.read(BS)
            if not any(b):
                continue
            at = rng.randrange(BS)
            x = rng.randrange(1, 256)
            f.seek(blk * BS + at)
            f.write(bytes([b[at] ^ x]))
            print(blk * BS + at)
            done += 1
    if done < n:
        sys.exit("not enough non-zero blocks to damage")


def verify(uri, image, out):
    h = connect(uri)
    bad_eio = []
    wrong = []
    with open(image, "rb") as f:
        want_all = f.read()
    blocks = (len(want_all) + BS - 1) // BS
    chunk = 256  # blocks per read; on error, block by block
    for first in range(0, blocks, chunk):
        n = min(chunk, blocks - first)
        want = want_all[first * BS:(first + n) * BS].ljust(n * BS, b"\0")
        try:
            got = h.pread(n * BS, first * BS)
            if got == want:
                continue
        except nbd.Error:
            pass
        for k in range(n):
            lba = first + k
            try:
                g = h.pread(BS, lba * BS)
            except nbd.Error as e:
                if e.errnum is not None and e.errnum != 5:
                    sys.exit(f"lba {lba}: unexpected error {e}")
                bad_eio.append(lba)
                continue
            if g != want[k * BS:(k + 1) * BS]:
                wrong.append((lba, not any(g)))
    h.shutdown()
    with open(out, "w") as o:
        o.writelines(f"{l}\n" for l in bad_eio)
    if wrong:
        desc = ", ".join(f"{l}{' (zeros)' if z else ''}" for l, z in wrong[:20])
        sys.exit(f"{len(wrong)} block(s) read other data than was flushed, no error: {desc}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2], sys.argv[3])
    elif cmd == "flip":
        flip(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "verify":
        verify(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {cmd}")
