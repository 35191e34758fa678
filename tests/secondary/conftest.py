"""Real Redis servers for the secondary-tier tests, started on free loopback ports.

Every server is this session's own: bound to 127.0.0.1, never on 6379, no
persistence (``--save '' --appendonly no``), its files in a temporary
directory, stopped by its pid at the end. Standalone servers, one with ACL
users, one that also speaks TLS (a certificate made by ``openssl``), and a
three-master Redis Cluster made with ``redis-cli --cluster create``. Without
``redis-server`` (or redis-py, or ``openssl``) the tests that need them skip,
except where ``TIERING_REQUIRE_SERVERS`` is set (CI): there they fail.

Test modules reach all of it through the fixtures, never by importing this file.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.secondary import RemoteNamespace

from ..conftest import require_binary as _require_binary

ACL_USER = "engine"
ACL_PASSWORD = "s3cret-Pa55"
DEFAULT_PASSWORD = "default-Pa55"


def require_binary(name: str) -> str:
    """The path of a Redis binary; skips without it, fails in CI (TIERING_REQUIRE_SERVERS)."""
    return _require_binary(name, "redis-server")


def require_redis_py() -> None:
    """redis-py (the ``redis`` extra); skips without it, fails in CI (TIERING_REQUIRE_SERVERS)."""
    try:
        import redis  # noqa: F401
    except ImportError:
        message = "redis-py is not installed (pip install -e '.[redis]')"
        if os.environ.get("TIERING_REQUIRE_SERVERS"):
            pytest.fail(f"{message}, and TIERING_REQUIRE_SERVERS is set")
        pytest.skip(message)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000), never 6379."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 30000)
        if port != 6379 and _bindable(port) and (not bus or _bindable(port + 10000)):
            return port
    raise RuntimeError("no free loopback port in 20000-29999")


def _answers(port: int) -> bool:
    """Whether a server on ``port`` answers PING (NOAUTH counts: it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            reply = conn.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


class RedisServer:
    """One redis-server process of this test session, stopped by its pid."""

    def __init__(self, directory: Path, *args: str, cluster: bool = False) -> None:
        self.binary = require_binary("redis-server")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port(bus=cluster)
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or start again, on the same port) and wait until it answers."""
        assert self.proc is None or self.proc.poll() is not None
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        self.proc = subprocess.Popen([*command, *self.args], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 15
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port stays this server's to `start` again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server cannot take SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def client(self, **options: Any) -> Any:
        """A plain redis-py client to this server (the test's own, for raw access)."""
        require_redis_py()
        import redis

        return redis.Redis(port=self.port, socket_timeout=10, **options)


class RedisClusterRig:
    """Three masters, all 16384 slots assigned by ``redis-cli --cluster create``.

    ``replicas`` per master (each in sync before the rig is handed out),
    ``node_timeout_ms`` (how soon a node is taken as failed), and ``*args``
    for every node (``--cluster-require-full-coverage no``).
    """

    def __init__(
        self, directory: Path, *args: str, replicas: int = 0, node_timeout_ms: int = 5000
    ) -> None:
        cli = require_binary("redis-cli")
        self.nodes: list[RedisServer] = []
        try:
            for i in range(3 * (1 + replicas)):
                self.nodes.append(
                    RedisServer(
                        directory / f"node{i}",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        *args,
                        cluster=True,
                    )
                )
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok(self.nodes)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, nodes: list[RedisServer], timeout_s: float = 30.0) -> None:
        """Poll until every one of ``nodes`` says cluster_state:ok and each replica is in sync."""
        deadline = time.monotonic() + timeout_s
        while not self.ok(nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def ok(self, nodes: list[RedisServer]) -> bool:
        """Whether every one of ``nodes`` says cluster_state:ok, each replica in sync."""
        return all(self._ok(node) for node in nodes)

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        client = node.client()
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_state:ok" not in text:
            return False
        replication = client.info("replication")
        return replication.get("role") != "slave" or replication.get("master_link_status") == "up"

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def ports(self) -> set[int]:
        return {node.port for node in self.nodes}

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


# -- servers -------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone server shared by the session (tests use their own namespaces)."""
    require_redis_py()
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server whose default user needs a password and with an ACL user for the tier."""
    require_redis_py()
    server = RedisServer(
        tmp_path_factory.mktemp("redis-acl"),
        "--requirepass",
        DEFAULT_PASSWORD,
        "--user",
        ACL_USER,
        "on",
        f">{ACL_PASSWORD}",
        "~tkv:*",
        "+@all",
    )
    yield server
    server.stop()


class TlsRedisServer(RedisServer):
    """A server that also speaks TLS, on `tls_port`, with a self-signed certificate.

    The certificate (for 127.0.0.1) is made by ``openssl`` and is its own CA:
    ``ca`` is the file a client trusts. Clients need no certificate of their own.
    """

    def __init__(self, directory: Path) -> None:
        openssl = _require_binary("openssl", "openssl")
        directory.mkdir(parents=True, exist_ok=True)
        self.ca = directory / "cert.pem"
        key = directory / "key.pem"
        request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        files = ["-keyout", str(key), "-out", str(self.ca)]
        subprocess.run([openssl, *request, *files, *subject], check=True, capture_output=True)
        self.tls_port = free_port()
        super().__init__(
            directory,
            "--tls-port",
            str(self.tls_port),
            "--tls-cert-file",
            str(self.ca),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(self.ca),
            "--tls-auth-clients",
            "no",
        )

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.ca}"


@pytest.fixture(scope="session")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    require_redis_py()
    server = TlsRedisServer(tmp_path_factory.mktemp("redis-tls"))
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test alone, to kill, freeze and restart."""
    require_redis_py()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterRig]:
    require_redis_py()
    rig = RedisClusterRig(tmp_path_factory.mktemp("redis-cluster"))
    yield rig
    rig.stop()


@pytest.fixture(scope="module")
def redis_partial_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterRig]:
    """Three masters that serve their slots while another is lost (a module's own: to kill)."""
    require_redis_py()
    rig = RedisClusterRig(
        tmp_path_factory.mktemp("redis-cluster-partial"),
        "--cluster-require-full-coverage",
        "no",
        node_timeout_ms=1000,
    )
    yield rig
    rig.stop()


@pytest.fixture(scope="module")
def redis_replicated_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterRig]:
    """Three masters with a replica each, failing over in about two seconds (to kill)."""
    require_redis_py()
    rig = RedisClusterRig(
        tmp_path_factory.mktemp("redis-cluster-replicas"), replicas=1, node_timeout_ms=1000
    )
    yield rig
    rig.stop()


@pytest.fixture
def acl() -> dict[str, str]:
    """The credentials of `redis_acl_server`: an ACL user's, and the default user's password."""
    return {"user": ACL_USER, "password": ACL_PASSWORD, "default": DEFAULT_PASSWORD}


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on."""
    return free_port()


# -- chunks --------------------------------------------------------------------

ROW_BYTES = 64 << 10


@pytest.fixture
def namespace() -> RemoteNamespace:
    """A namespace of this test alone, so tests sharing a server never see each other."""
    return RemoteNamespace(
        model="test-model",
        dtype="bfloat16",
        row_bytes=ROW_BYTES,
        blocks_per_chunk=4,
        page_bytes=(8192, 8192),
        namespace=f"test-{uuid.uuid4().hex}",
    )


class Chunks:
    """Keys and random rows of one row size; ``buffers(n)`` are zeroed row buffers."""

    def __init__(self, row_bytes: int, seed: int = 0) -> None:
        self.row_bytes = row_bytes
        self._rng = np.random.default_rng(seed)

    def keys(self, n: int) -> list[OffloadKey]:
        return [make_offload_key(self._rng.bytes(16), group) for group in range(n)]

    def rows(self, n: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
        return [self._rng.integers(0, 256, self.row_bytes, dtype=np.uint8) for _ in range(n)]

    def buffers(self, n: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
        return [np.zeros(self.row_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture
def chunks(namespace: RemoteNamespace) -> Chunks:
    return Chunks(namespace.row_bytes)


@pytest.fixture
def make_chunks() -> Callable[[int], Chunks]:
    return Chunks
