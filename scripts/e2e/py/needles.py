"""Distinctive strings of a data file, for a search of a volume's backing
store for its plaintext (encryption.sh, s3.sh).

    python3 needles.py DATA OUT [COUNT]

Writes COUNT (default 8) strings to OUT, one a line, spread over DATA: 48
printable bytes (no newline, so that `grep -F -f` and `grep -e` take them)
with at least 16 different characters, each inside one 4 KiB block of DATA
(a block stored uncompressed in the clear holds it whole), all different.
Exits 1 if DATA has too few.
"""

import re
import sys

LEN = 48


def pick(data, count):
    out, step = [], len(data) // count
    run = re.compile(rb"[ -~]{%d,}" % LEN)
    for k in range(count):
        for m in run.finditer(data, k * step):
            at = m.start() + (-m.start()) % 64  # a few candidates in each run
            while at + LEN <= m.end():
                w = data[at:at + LEN]
                if at % 4096 + LEN <= 4096 and len(set(w)) >= 16 and w not in out:
                    out.append(w)
                    break
                at += 64
            if len(out) > k:
                break
        else:
            sys.exit("no distinctive string in %s after offset %d" % (sys.argv[1], k * step))
    return out


def main():
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    with open(sys.argv[2], "wb") as f:
        f.write(b"\n".join(pick(data, count)) + b"\n")


if __name__ == "__main__":
    main()
