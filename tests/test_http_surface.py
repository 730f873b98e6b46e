"""The HTTP surface's safety nets: request-size limits hold on every path, with or without a Content-Length (a
300 MB chunked upload gets a 413 after the limit and the real ``mepo serve`` process's memory stays bounded), and
the docs pages need nothing from the internet."""

from __future__ import annotations

import re
import select
import socket
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from mepo_stream.images import ImageLimits
from server.app import create_app
from server.config import ServeConfig
from tests.helpers import http_client, serve_process, settings, wait_for

TOTAL = 300 * 1024 * 1024
BLOCK = b"\xff" * (1 << 20)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def chunked_upload(port: int, path: str, content_type: str | None, first: bytes = b"") -> tuple[int, int]:
    """POST ``first`` then up to 300 MB of 0xff, chunked (no Content-Length), until the server answers; returns the
    HTTP status and the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
    sock.sendall((head + (f"Content-Type: {content_type}\r\n" if content_type else "") + "\r\n").encode())
    sent = 0
    try:
        for chunk in [first] * bool(first) + [BLOCK] * (TOTAL // len(BLOCK)):
            if select.select([sock], [], [], 0)[0]:  # the server answered: stop sending
                break
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
        else:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    status = int(sock.makefile("rb").readline().split()[1])
    sock.close()
    return status, sent


def answers(cfg) -> bool:
    try:
        with http_client(cfg) as http:
            return http.get("/livez").status_code == 200
    except httpx.TransportError:
        return False


class PeakRss(threading.Thread):
    """Samples a process's resident memory until stopped; ``growth`` is the peak over the first sample."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.base, self.peak, self.done = pid, rss_bytes(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self.done.wait(0.02)

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


MULTIPART = (b'--b\r\nContent-Disposition: form-data; name="files"; filename="big.jpg"\r\n'
             b"Content-Type: image/jpeg\r\n\r\n")
CASES = {  # path, content type, what precedes the endless bytes
    "raw image": ("/v1/predict", "image/jpeg", b""),
    "multipart": ("/v1/predict", "multipart/form-data; boundary=b", MULTIPART),
    "v2 json": ("/v2/models/mepo/infer", "application/json", b'{"inputs": [{"name": "image", "data": ["'),
    "v2 json, no content type": ("/v2/models/mepo/infer", None, b'{"inputs": [{"name": "image", "data": ["'),
}


@pytest.mark.reliability
def test_chunked_uploads_of_300_mb_get_413_with_bounded_memory(broker, tmp_path):
    cfg = settings(broker, tmp_path, limits=ImageLimits(size=32, max_bytes=200_000), max_files=4)
    server = serve_process(cfg, tmp_path / "serve.log")
    try:
        wait_for(lambda: server.running() and answers(cfg), what="the server")
        for name, (path, content_type, first) in CASES.items():
            with PeakRss(server.pid) as rss:
                status, sent = chunked_upload(cfg.port, path, content_type, first)
            assert status == 413, name
            assert sent < 64 * 1024 * 1024, (name, sent)  # it stopped reading long before 300 MB
            assert rss.growth < 64 * 1024 * 1024, (name, rss.growth)
        assert answers(cfg)  # and it is still serving
    finally:
        server.terminate()
        server.wait(60)


def test_the_docs_pages_load_every_asset_from_the_server_itself():
    """/docs and /redoc work without internet access: each script, stylesheet and icon comes from this server."""
    client = TestClient(create_app(ServeConfig()))  # no lifespan: no model, no broker needed for the docs
    for page in ("/docs", "/redoc"):
        html = client.get(page).text
        assets = re.findall(r'(?:src|href)=["\']([^"\']+)["\']', html) + re.findall(r"url: ['\"]([^'\"]+)['\"]", html)
        assert assets and all(a.startswith("/") for a in assets), (page, assets)
        assert all(client.get(a).status_code == 200 for a in assets), page
