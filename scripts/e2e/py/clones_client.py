#!/usr/bin/env python3
"""Client side of dedup.sh (libnbd Python bindings).

  clones_client.py write     URI IMAGE FIRST LAST  -- write clones FIRST..LAST of IMAGE, flush
  clones_client.py verify    URI IMAGE FIRST LAST  -- clones FIRST..LAST read back as IMAGE
  clones_client.py overwrite URI IMAGE N           -- overwrite clone N with other data, flush
  clones_client.py verify-overwritten URI IMAGE N  -- clone N holds that other data

Clone i starts at byte i * (len(IMAGE) + 7 * 4096): every clone sits at a
different block offset, none at a multiple of the image size.
"""
import hashlib
import os
import sys

sys.dont_write_bytecode = True
import nbd  # noqa: E402

BLOCK = 4096
CHUNK = 1 << 20


def offset_of(i, n):
    return i * (n + 7 * BLOCK)


def other_data(n):
    """Deterministic, compressible data unlike the image."""
    out = bytearray()
    k = 0
    while len(out) < n:
        out += hashlib.sha256(b"other %d" % k).hexdigest().encode() * 16
        k += 1
    return bytes(out[:n])


def write_at(h, data, base):
    for at in range(0, len(data), CHUNK):
        h.pwrite(data[at:at + CHUNK], base + at)


def same_at(h, data, base):
    for at in range(0, len(data), CHUNK):
        want = data[at:at + CHUNK]
        got = h.pread(len(want), base + at)
        if got != want:
            for b in range(0, len(want), BLOCK):
                if got[b:b + BLOCK] != want[b:b + BLOCK]:
                    return base + at + b
    return None


def main():
    cmd, uri, image = sys.argv[1], sys.argv[2], sys.argv[3]
    img = open(image, "rb").read()
    h = nbd.NBD()
    h.connect_uri(uri)
    if cmd in ("write", "verify"):
        first, last = int(sys.argv[4]), int(sys.argv[5])
        for i in range(first, last + 1):
            base = offset_of(i, len(img))
            if cmd == "write":
                write_at(h, img, base)
            else:
                bad = same_at(h, img, base)
                if bad is not None:
                    print("clone %d differs at byte %d" % (i, bad))
                    return 1
        if cmd == "write":
            h.flush()
    elif cmd == "overwrite":
        write_at(h, other_data(len(img)), offset_of(int(sys.argv[4]), len(img)))
        h.flush()
    elif cmd == "verify-overwritten":
        bad = same_at(h, other_data(len(img)), offset_of(int(sys.argv[4]), len(img)))
        if bad is not None:
            print("overwritten clone differs at byte %d" % bad)
            return 1
    else:
        sys.exit("unknown command " + cmd)
    h.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
