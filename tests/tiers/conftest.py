"""Redis servers for the tier tests: the shared one at 127.0.0.1:6379, private servers and clusters.

Everything listens on loopback only and is torn down after use. Without a Redis at 127.0.0.1:6379
(or without the ``redis-server``/``redis-cli`` binaries for private servers) the Redis tests skip,
saying how to get one, unless ``CI`` is set: then they fail, so CI never passes by skipping them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REDIS_HOST = "127.0.0.1"
REDIS_PORT = 6379
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"
HOW_TO_START = ("start one with `redis-server --port 6379 --save '' --appendonly no --daemonize yes` "
                "(Debian/Ubuntu: `apt-get install redis-server`; or `docker run -d -p 6379:6379 redis:7`); "
                "the cluster and restart tests also need the `redis-server` and `redis-cli` binaries on PATH")


def unavailable(reason: str) -> None:
    """Fail under CI, skip elsewhere, always saying how to provide what is missing."""
    message = f"{reason}; {HOW_TO_START}"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {message}")
    pytest.skip(message)


def _ping(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((REDIS_HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port that is free, and whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The shared Redis at 127.0.0.1:6379 (skip or, under CI, fail when it is not there)."""
    if not _ping(REDIS_HOST, REDIS_PORT):
        unavailable(f"no Redis answers at {REDIS_HOST}:{REDIS_PORT}")
    return REDIS_URL


@pytest.fixture()
def namespace(redis_url: str) -> Iterator[str]:
    """A namespace of the test's own; its keys are deleted from the shared Redis afterwards."""
    import redis

    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"kvtier:{name}:*", count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


def _binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        unavailable("the `redis-server` and `redis-cli` binaries are not on PATH")
    assert server and cli
    return server, cli


@dataclass
class RedisProcess:
    """One private redis-server on a loopback port; ``kill``/``start`` simulate a crash and a restart."""

    port: int
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{REDIS_HOST}:{self.port}/0"

    def start(self, wait: bool = True) -> None:
        server, _ = _binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [server, "--port", str(self.port), "--bind", REDIS_HOST, "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / f"redis-{self.port}.log"),
             *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not _ping(REDIS_HOST, self.port):
            if self.process is not None and self.process.poll() is not None:
                log = self.workdir / f"redis-{self.port}.log"
                raise RuntimeError(f"redis-server on port {self.port} exited: "
                                   f"{log.read_text()[-2000:] if log.exists() else 'no log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout} s")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save, connections reset — a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


@pytest.fixture()
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start private standalone servers (``factory(port=None, start=True, extra_args=())``).

    All are killed after the test.
    """
    started: list[RedisProcess] = []

    def factory(port: int | None = None, start: bool = True,
                extra_args: tuple[str, ...] = ()) -> RedisProcess:
        _binaries()
        server = RedisProcess(port or free_port(), tmp_path / f"redis-{len(started)}", list(extra_args))
        started.append(server)
        if start:
            server.start()
        return server

    yield factory
    for server in started:
        server.kill()


@dataclass
class RedisClusterHandle:
    """A running 3-master cluster: its nodes (in port order) and startup node strings."""

    nodes: list[RedisProcess]

    @property
    def startup_nodes(self) -> list[str]:
        return [f"{REDIS_HOST}:{node.port}" for node in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def _cluster_state(port: int) -> str:
    import redis

    client = redis.Redis(host=REDIS_HOST, port=port, socket_timeout=2)
    try:
        info = client.execute_command("CLUSTER INFO")
    except redis.RedisError:
        return "unreachable"
    finally:
        client.close()
    if isinstance(info, dict):  # redis-py parses CLUSTER INFO into a dict
        state = info.get("cluster_state", info.get(b"cluster_state", "unknown"))
        return state.decode() if isinstance(state, bytes) else str(state)
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def start_cluster(workdir: Path, masters: int = 3) -> RedisClusterHandle:
    """``redis-server --cluster-enabled yes`` × masters, ``redis-cli --cluster create``, wait for state ok.

    ``cluster-require-full-coverage no``: surviving masters keep serving their slots when one dies,
    which is what a cache wants (docs/redis.md says so too).
    """
    _, cli = _binaries()
    nodes: list[RedisProcess] = []
    try:
        for i in range(masters):
            port = free_port()
            node = RedisProcess(port, workdir / f"node-{i}", [
                "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"])
            nodes.append(node)
            node.start(wait=False)
        for node in nodes:
            node.wait_ready()
        create = subprocess.run(
            [cli, "--cluster", "create", *[f"{REDIS_HOST}:{n.port}" for n in nodes],
             "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {create.stdout[-2000:]} {create.stderr[-2000:]}")
        deadline = time.monotonic() + 20
        while any(_cluster_state(n.port) != "ok" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok within 20 s")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return RedisClusterHandle(nodes)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHandle]:
    """A 3-master Redis Cluster on free loopback ports, shared by the session's tests; torn down after."""
    _binaries()
    handle = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield handle
    handle.stop()


@pytest.fixture()
def private_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterHandle]:
    """A 3-master cluster for one test that may kill its nodes."""
    _binaries()
    handle = start_cluster(tmp_path / "cluster")
    yield handle
    with contextlib.suppress(Exception):
        handle.stop()


def make_test_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1: ``(ca, cert, key)``; skips without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make test certificates")
    ca_key, ca, key, csr, cert, ext = (directory / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr",
                                                               "srv.crt", "ext.cnf"))
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for args in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
                  "-days", "1", "-subj", "/CN=kvtier-test-ca"],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
                  "-subj", "/CN=127.0.0.1"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                  "-days", "1", "-extfile", ext]):
        subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
    return ca, cert, key
