#!/usr/bin/env python3
"""A tiny in-memory S3 endpoint for tests that need a store but not a real
one (hostile-local.sh): path-style GET (with one Range), HEAD, PUT (with
If-None-Match: * as a create-only PUT), DELETE, DeleteObjects and
ListObjectsV2 (prefix, no paging). No authentication: every signature is accepted.

    tiny_s3.py PORTFILE    # listens on 127.0.0.1, a free port written to PORTFILE
"""
import http.server
import socketserver
import sys
import threading
from urllib.parse import parse_qs, unquote, urlparse
from xml.sax.saxutils import escape, unescape

OBJECTS = {}  # (bucket, key) -> bytes
LOCK = threading.Lock()
STAMP = "Sat, 01 Jan 2022 00:00:00 GMT"
ISO = "2022-01-01T00:00:00.000Z"


def etag(b):
    return '"%08x-%d"' % (hash(b) & 0xFFFFFFFF, len(b))


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def split(self):
        u = urlparse(self.path)
        parts = unquote(u.path).lstrip("/").split("/", 1)
        return parts[0], parts[1] if len(parts) > 1 else "", parse_qs(u.query)

    def reply(self, code, body=b"", headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def not_found(self):
        self.reply(404, b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>",
                   [("Content-Type", "application/xml")])

    def do_GET(self):
        bucket, key, q = self.split()
        if not key:
            prefix = q.get("prefix", [""])[0]
            with LOCK:
                items = sorted((k, v) for (b, k), v in OBJECTS.items()
                               if b == bucket and k.startswith(prefix))
            xml = ['<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>',
                   "<Name>%s</Name><Prefix>%s</Prefix><KeyCount>%d</KeyCount>"
                   "<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
                   % (escape(bucket), escape(prefix), len(items))]
            for k, v in items:
                xml.append("<Contents><Key>%s</Key><LastModified>%s</LastModified>"
                           "<ETag>%s</ETag><Size>%d</Size><StorageClass>STANDARD"
                           "</StorageClass></Contents>" % (escape(k), ISO, escape(etag(v)), len(v)))
            xml.append("</ListBucketResult>")
            return self.reply(200, "".join(xml).encode(), [("Content-Type", "application/xml")])
        with LOCK:
            body = OBJECTS.get((bucket, key))
        if body is None:
            return self.not_found()
        meta = [("ETag", etag(body)), ("Last-Modified", STAMP),
                ("Content-Type", "application/octet-stream"), ("Accept-Ranges", "bytes")]
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            a = int(a)
            b = min(int(b) if b else len(body) - 1, len(body) - 1)
            if a >= len(body):
                return self.reply(416)
            return self.reply(206, body[a:b + 1],
                              meta + [("Content-Range", "bytes %d-%d/%d" % (a, b, len(body)))])
        self.reply(200, body, meta)

    do_HEAD = do_GET

    def do_PUT(self):
        bucket, key, _ = self.split()
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n) if n else b""
        with LOCK:
            if self.headers.get("If-None-Match") == "*" and (bucket, key) in OBJECTS:
                return self.reply(412, b"<Error><Code>PreconditionFailed</Code></Error>",
                                  [("Content-Type", "application/xml")])
            OBJECTS[(bucket, key)] = body
        self.reply(200, b"", [("ETag", etag(body))])

    def do_POST(self):
        # DeleteObjects (POST /BUCKET?delete): every key deleted.
        import re
        bucket, _, q = self.split()
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n).decode() if n else ""
        if "delete" not in q and "delete" not in urlparse(self.path).query:
            return self.reply(501)
        keys = [unescape(k) for k in re.findall(r"<Key>(.*?)</Key>", body, re.S)]
        with LOCK:
            for k in keys:
                OBJECTS.pop((bucket, k), None)
        xml = "".join("<Deleted><Key>%s</Key></Deleted>" % escape(k) for k in keys)
        self.reply(200, ('<?xml version="1.0" encoding="UTF-8"?><DeleteResult>%s</DeleteResult>'
                         % xml).encode(), [("Content-Type", "application/xml")])

    def do_DELETE(self):
        bucket, key, _ = self.split()
        with LOCK:
            OBJECTS.pop((bucket, key), None)
        self.reply(204)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def main():
    srv = Server(("127.0.0.1", 0), Handler)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    import os
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    srv.serve_forever()


if __name__ == "__main__":
    main()
