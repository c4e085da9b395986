"""A fault-injecting HTTP proxy on loopback, in front of the real SeaweedFS S3 server.

The S3 client under test talks to the proxy (its ``endpoint_url``); every request is forwarded
to the server unchanged (the SigV4 signature covers the Host header, which is kept), unless a
fault is scheduled for it:

    proxy.fail("UploadPart", times=3, status=500, code="InternalError")  # S3 error answers
    proxy.stall()    # hold every request without an answer (a hung server) ... proxy.release()
    proxy.drop("PutObject", times=1)  # close the connection without an answer
    proxy.lose_answer("CreateMultipartUpload", times=1)  # the server acts, the client never hears
    proxy.before("UploadPart", 2, fn)  # call fn() as the 2nd UploadPart arrives, then go on

``proxy.log`` records each request as (operation, what the proxy did). Operations are named as
in the S3 API (`operation`).
"""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te", "upgrade"}


def operation(method: str, target: str) -> str:
    """The S3 operation of a path-style request (enough of them for tiered's traffic)."""
    url = urlsplit(target)
    query = parse_qs(url.query, keep_blank_values=True)
    has_key = url.path.strip("/").count("/") >= 1
    if method == "PUT":
        return "UploadPart" if "partNumber" in query else ("PutObject" if has_key else "CreateBucket")
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "DeleteObjects" if "delete" in query else "POST"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if not has_key:
            return "ListMultipartUploads" if "uploads" in query else "ListObjectsV2"
        return "ListParts" if "uploadId" in query else "GetObject"
    return method


@dataclass
class _Fault:
    op: str
    times: int
    kind: str  # "error" | "drop" | "lose"
    status: int = 0
    code: str = ""


class FaultProxy:
    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self.log: list[tuple[str, str]] = []
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._stalled = threading.Event()
        self._released = threading.Event()
        self._released.set()
        self.stalled_requests = 0
        self._seen: dict[str, int] = {}
        self._hooks: dict[tuple[str, int], object] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    # --- scheduling faults ---------------------------------------------------------------
    def fail(self, op: str, *, times: int, status: int, code: str) -> None:
        """Answer the next `times` requests of `op` ("*": any) with an S3 error, unforwarded."""
        with self._lock:
            self._faults.append(_Fault(op, times, "error", status, code))

    def drop(self, op: str, *, times: int) -> None:
        """Close the connection of the next `times` requests of `op` without an answer."""
        with self._lock:
            self._faults.append(_Fault(op, times, "drop"))

    def lose_answer(self, op: str, *, times: int) -> None:
        """Forward the next `times` requests of `op`, then close the connection instead of passing
        the answer on: the server has acted, and the client does not know it."""
        with self._lock:
            self._faults.append(_Fault(op, times, "lose"))

    def before(self, op: str, nth: int, fn) -> None:
        """Call `fn()` when the `nth` request of `op` (counted from now) arrives, before it is
        handled (e.g. to kill the server under it)."""
        with self._lock:
            self._hooks[(op, self._seen.get(op, 0) + nth)] = fn

    def clear(self) -> None:
        """Drop every scheduled fault that is left."""
        with self._lock:
            self._faults.clear()

    def stall(self) -> None:
        """From now on, hold every request without an answer, as a hung server does."""
        self._released.clear()
        self._stalled.set()

    def release(self) -> None:
        """End the stall: held connections are closed unanswered (their clients retry), new
        requests are forwarded again."""
        self._stalled.clear()
        self._released.set()

    def injected(self, what: str | None = None) -> list[tuple[str, str]]:
        """Logged requests the proxy did not forward (or only those whose action starts with `what`)."""
        with self._lock:
            return [(op, act) for op, act in self.log if act != "forwarded" and (what is None or act.startswith(what))]

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    # --- used by the handler -------------------------------------------------------------
    def _decide(self, op: str) -> _Fault | None:
        with self._lock:
            n = self._seen[op] = self._seen.get(op, 0) + 1
            hook = self._hooks.pop((op, n), None)
        if hook is not None:
            hook()
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.op in (op, "*"):
                    fault.times -= 1
                    return fault
        return None

    def _record(self, op: str, action: str) -> None:
        with self._lock:
            self.log.append((op, action))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._body()
        op = operation(self.command, self.path)
        if proxy._stalled.is_set():
            with proxy._lock:
                proxy.stalled_requests += 1
            proxy._record(op, "stalled")
            proxy._released.wait()
            self._hang_up()
            return
        fault = proxy._decide(op)
        if fault is not None and fault.kind == "drop":
            proxy._record(op, "dropped")
            self._hang_up()
            return
        if fault is not None and fault.kind == "error":
            proxy._record(op, f"error {fault.status} {fault.code}")
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                   f'<Message>injected by the test proxy</Message><RequestId>fault</RequestId></Error>').encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        try:
            status, reason, headers, payload = self._forward(body)
        except OSError:  # the server is gone (killed): so is the client's connection
            proxy._record(op, "upstream down")
            self._hang_up()
            return
        if fault is not None and fault.kind == "lose":
            proxy._record(op, f"answer {status} lost")
            self._hang_up()
            return
        proxy._record(op, "forwarded")
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP_BY_HOP and not (k.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=120)  # type: ignore[attr-defined]
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    conn.putheader(k, v)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            r = conn.getresponse()
            return r.status, r.reason, r.getheaders(), r.read()
        finally:
            conn.close()

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
