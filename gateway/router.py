"""KV-aware routing across nodes: which node's replicas serve a request.

A *node* is one cache service (one pool, one accelerator) and the compute replicas attached to
it. The router keeps, per node, the set of block hashes its cache holds, fed by the cache's
``WatchEvents`` stream (BlockStored adds, BlockRemoved drops), and names a request's blocks with
the function the cache itself uses (``kvtier.block_hash``: model fingerprint, tenant salt, token
ids). A request's *predicted hit* on a node is the length of the leading run of its block hashes
that node holds, in tokens, capped as the cache caps a hit (the last prompt token is always
computed).

Policies (``--routing``):

- ``kv-aware``: the node with the best ``hit fraction - load_weight * load share`` where the load
  share is the node's requests in flight through this gateway over all of them, so a node that
  holds a popular prefix does not take every request for it; ties (no hit anywhere) go to the
  least loaded node, then round-robin;
- ``round-robin`` and ``random``, for comparison.

Fallbacks: a node whose event stream failed (or whose cache restarted: its event ids start over)
is resynchronized by watching again from 0 (every event the cache still keeps) with an empty
index; until it is synced again its hit is asked with ``LookupPrefix`` (one RPC, bounded by
``LOOKUP_TIMEOUT_S``). A node that does not answer is routed around and retried after
``DOWN_S``. The router reads only infrastructure RPCs (WatchEvents, GetStats, LookupPrefix), so it
holds the node credential; end users never see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtier import auth
from kvtier.api import cache_pb2, cache_pb2_grpc
from kvtier.api_keys import tenant_salt
from kvtier.block_hash import BlockHash, extra_key, hash_full_blocks

log = logging.getLogger("kvtier.gateway.router")

POLICIES = ("kv-aware", "round-robin", "random")
DOWN_S = 5.0  # a node that failed is passed over this long
STATS_PERIOD_S = 1.0  # how often each node's GetStats is read (load, block size, replicas)
LOOKUP_TIMEOUT_S = 0.5
RESYNC_BACKOFF_S = (0.1, 2.0)  # first and largest wait between attempts to reopen an event stream
DNS_PERIOD_S = 10.0  # how often --nodes-dns Services are resolved again


class NoNode(Exception):
    """No node to route to (DNS discovery found none yet)."""


class NodeFileError(ValueError):
    """A node file or --node flag that cannot be used; the message says what to fix."""


@dataclass
class Node:
    """One cache service and the compute replicas attached to it."""

    name: str
    cache: str  # the cache service's address (unix:///path or host:port)
    compute: list[str]  # its replicas' addresses
    # DNS discovery: every replica found; the node's own are those its cache lists as leases.
    candidates: list[str] | None = None


def parse_node_flag(spec: str, index: int) -> Node:
    """``CACHE=COMPUTE[,COMPUTE...]`` (``--node``), optionally prefixed ``NAME@``."""
    name, _, rest = spec.rpartition("@") if "@" in spec.split("=", 1)[0] else ("", "", spec)
    cache, sep, compute = rest.partition("=")
    replicas = [c for c in compute.split(",") if c]
    if not sep or not cache or not replicas:
        raise NodeFileError(
            f"--node {spec!r}: expected [NAME@]CACHE_ADDRESS=COMPUTE_ADDRESS[,COMPUTE_ADDRESS...], e.g. "
            "unix:///run/kvtier-0/cache.sock=unix:///run/kvtier-0/compute-0.sock"
        )
    return Node(name or f"node-{index}", cache, replicas)


def load_node_file(path: str | Path) -> list[Node]:
    """Nodes from a JSON file: ``{"nodes": [{"name": "gpu0", "cache": ADDR, "compute": [ADDR, ...]}]}``."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise NodeFileError(f"node file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise NodeFileError(f"node file {path}: not JSON ({e})") from None
    entries = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise NodeFileError(
            f'node file {path}: expected {{"nodes": [{{"cache": ..., "compute": [...]}}, ...]}}'
        )
    nodes: list[Node] = []
    for k, entry in enumerate(entries):
        where = f"node file {path}: nodes[{k}]"
        if not isinstance(entry, dict):
            raise NodeFileError(f"{where} is not an object")
        cache, compute = entry.get("cache"), entry.get("compute")
        if not isinstance(cache, str) or not cache:
            raise NodeFileError(f'{where} needs "cache": the cache service address')
        if not isinstance(compute, list) or not compute or not all(isinstance(c, str) and c for c in compute):
            raise NodeFileError(f'{where} needs "compute": a non-empty list of replica addresses')
        name = entry.get("name", f"node-{k}")
        if not isinstance(name, str) or not name:
            raise NodeFileError(f'{where}: "name" must be a non-empty string')
        nodes.append(Node(name, cache, list(compute)))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise NodeFileError(f"node file {path}: node names repeat: {names}")
    return nodes


def dns_addresses(service: str) -> list[str]:
    """``HOST:PORT`` of every address ``HOST`` resolves to (a headless Service: one per ready pod)."""
    host, _, port = service.rpartition(":")
    if not host or not port.isdigit():
        raise NodeFileError(f"{service!r}: expected HOST:PORT of a headless Service")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NodeFileError(f"cannot resolve {host}: {e.strerror}") from None
    return sorted({f"{info[4][0]}:{port}" for info in infos})


def parse_dns_flag(value: str) -> tuple[str, str]:
    """``--nodes-dns CACHE_HOST:PORT,COMPUTE_HOST:PORT`` -> the two services (not resolved yet)."""
    cache_service, _, compute_service = value.partition(",")
    for service in (cache_service, compute_service):
        host, _, port = service.rpartition(":")
        if not host or not port.isdigit():
            raise NodeFileError(f"--nodes-dns {value!r}: expected CACHE_HOST:PORT,COMPUTE_HOST:PORT")
    return cache_service, compute_service


@dataclass
class NodeState:
    """What the router knows about one node."""

    node: Node
    stub: cache_pb2_grpc.CacheServiceStub
    channel: grpc.aio.Channel
    hashes: set[BlockHash] = field(default_factory=set)
    synced: bool = False  # the index follows the node's event stream
    last_event_id: int = 0
    block_size: int = 0  # from GetStats; 0 until the first answer
    usage: float = 0.0  # pool usage, 0..1
    num_sequences: int = 0
    inflight: int = 0  # requests this gateway has open on the node
    down_until: float = 0.0
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.node.name

    def up(self, now: float) -> bool:
        return self.down_until <= now


@dataclass
class Route:
    """The router's answer for one request: nodes to try in order, and why the first was chosen."""

    nodes: list[NodeState]
    predicted_tokens: list[int]  # per node in `nodes`: the predicted cached prompt tokens
    reason: str  # prefix | load | round_robin | random | only_node


class Router:
    """Ranks nodes for a request; see the module docstring."""

    def __init__(
        self,
        nodes: list[Node],
        token: str | None,
        model_fingerprint: str,
        policy: str = "kv-aware",
        load_weight: float = 1.0,
        metrics=None,
        seed: int | None = None,
        dns: tuple[str, str] | None = None,
    ) -> None:
        """``dns``: the (cache, compute) headless Services of --nodes-dns; nodes are then found,
        and kept current, by resolving them (``nodes`` may start empty)."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if not nodes and dns is None:
            raise ValueError("the router needs at least one node")
        self.dns = dns
        self.policy = policy
        self.load_weight = load_weight
        self.fingerprint = model_fingerprint
        self.metrics = metrics
        self._metadata = auth.bearer(token) if token else ()
        self._rr = itertools.count()
        self._random = random.Random(seed)
        self.states: list[NodeState] = [self._state_of(node) for node in nodes]
        self._started = False
        self._dns_task: asyncio.Task | None = None

    @staticmethod
    def _state_of(node: Node) -> NodeState:
        channel = grpc.aio.insecure_channel(auth.grpc_target(node.cache))
        return NodeState(node, cache_pb2_grpc.CacheServiceStub(channel), channel)

    # ------------------------------------------------------------ life

    async def start(self) -> None:
        """Start following every node (on the running loop); returns at once."""
        self._started = True
        for state in self.states:
            self._follow(state)
        if self.dns is not None:
            self._dns_task = asyncio.create_task(self._rediscover_forever(), name="router-dns")

    def _follow(self, state: NodeState) -> None:
        state.tasks = [
            asyncio.create_task(self._follow_events(state), name=f"router-events-{state.name}"),
            asyncio.create_task(self._poll_stats(state), name=f"router-stats-{state.name}"),
        ]

    async def _rediscover_forever(self) -> None:
        """--nodes-dns: resolve the Services again and again; new cache pods become nodes, gone
        ones are dropped, and every node's candidate replicas are the compute pods resolved now.
        A failed lookup (no ready pod yet, DNS down) is logged and retried, never fatal."""
        assert self.dns is not None
        cache_service, compute_service = self.dns
        failing = False
        while True:
            try:
                caches = await asyncio.to_thread(dns_addresses, cache_service)
                replicas = await asyncio.to_thread(dns_addresses, compute_service)
            except NodeFileError as e:
                if not failing:
                    log.warning("router: %s; retrying every %.0fs", e, DNS_PERIOD_S)
                failing = True
            else:
                failing = False
                await self.set_dns_nodes(caches, replicas)
            await asyncio.sleep(DNS_PERIOD_S)

    async def set_dns_nodes(self, caches: list[str], replicas: list[str]) -> None:
        """Make the nodes those of ``caches`` (cache pod addresses), each with ``replicas`` as
        candidates; the replicas a node already knows it owns (from its leases) stay its own."""
        known = {s.node.cache: s for s in self.states}
        for state in [s for s in self.states if s.node.cache not in caches]:
            log.info("router: node %s is gone from DNS", state.name)
            self.states.remove(state)
            await self._stop(state)
        for address in caches:
            state = known.get(address)
            if state is None:
                state = self._state_of(
                    Node(f"cache-{address}", address, list(replicas), candidates=list(replicas))
                )
                log.info("router: node %s found in DNS", state.name)
                self.states.append(state)
                if self._started:
                    self._follow(state)
            else:
                state.node.candidates = list(replicas)
                if not set(state.node.compute) <= set(replicas):
                    state.node.compute = list(replicas)  # a replica it had is gone: ask the leases again

    async def _stop(self, state: NodeState) -> None:
        for task in state.tasks:
            task.cancel()
        for task in state.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await state.channel.close()

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        for state in self.states:
            await self._stop(state)

    async def wait_synced(self, timeout_s: float) -> None:
        """Until every node's index follows its events and its block size is known (tests, startup)."""
        deadline = time.monotonic() + timeout_s
        while not (self.states and all(s.synced and s.block_size for s in self.states)):
            if time.monotonic() > deadline:
                late = [s.name for s in self.states if not (s.synced and s.block_size)]
                raise TimeoutError(f"router: nodes {late} not synced within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def _follow_events(self, state: NodeState) -> None:
        """Keep ``state.hashes`` equal to the node's cached blocks, from its WatchEvents stream."""
        backoff = RESYNC_BACKOFF_S[0]
        while True:
            # (Re)start from 0 with an empty index: after a gap, a broken stream or a restarted
            # cache, the kept events are the only truth we can replay.
            state.hashes.clear()
            state.last_event_id = 0
            state.synced = False
            try:
                call = state.stub.WatchEvents(
                    cache_pb2.WatchEventsRequest(since_event_id=0), metadata=self._metadata
                )
                state.synced = True
                async for event in call:
                    backoff = RESYNC_BACKOFF_S[0]
                    if event.event_id <= state.last_event_id:
                        break  # ids went back: the cache restarted; resync
                    state.last_event_id = event.event_id
                    kind = event.WhichOneof("event")
                    if kind == "block_stored":
                        state.hashes.add(event.block_stored.block_hash)
                    elif kind == "block_removed":
                        state.hashes.discard(event.block_removed.block_hash)
                log.warning("router: node %s ended its event stream; resyncing", state.name)
            except grpc.aio.AioRpcError as e:
                state.synced = False
                if e.code() == grpc.StatusCode.OUT_OF_RANGE:
                    log.warning(
                        "router: node %s: events were dropped (%s); resyncing", state.name, e.details()
                    )
                else:
                    log.warning(
                        "router: node %s: event stream failed (%s: %s); retrying in %.1fs",
                        state.name,
                        e.code().name,
                        e.details(),
                        backoff,
                    )
                    self._count("resync")
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RESYNC_BACKOFF_S[1])
            state.synced = False

    async def _poll_stats(self, state: NodeState) -> None:
        """Load and block size of a node, every STATS_PERIOD_S; a node that fails is marked down."""
        was_down = False
        while True:
            try:
                stats = await state.stub.GetStats(
                    cache_pb2.GetStatsRequest(), metadata=self._metadata, timeout=STATS_PERIOD_S * 2
                )
                state.block_size = stats.block_size
                state.usage = stats.usage_percent / 100.0
                state.num_sequences = stats.num_sequences
                if state.node.candidates is not None:
                    self._assign_replicas(state, [lease.client_name for lease in stats.leases])
                if was_down:
                    log.info("router: node %s answers again", state.name)
                    state.down_until = 0.0
                was_down = False
            except grpc.aio.AioRpcError as e:
                if not was_down:
                    log.warning(
                        "router: node %s does not answer (%s); routing around it", state.name, e.code().name
                    )
                was_down = True
                state.down_until = time.monotonic() + DOWN_S
            await asyncio.sleep(STATS_PERIOD_S)

    @staticmethod
    def _assign_replicas(state: NodeState, lease_names: list[str]) -> None:
        """DNS discovery: the node's replicas are the candidates its cache holds a lease for."""
        own = [c for c in state.node.candidates or () if c in lease_names]
        if own and own != state.node.compute:
            log.info("router: node %s serves through %s", state.name, " ".join(own))
            state.node.compute = own

    # ------------------------------------------------------------ routing

    def block_hashes(
        self, prompt_ids: list[int], cache_salt: str, tenant: str, block_size: int
    ) -> list[BlockHash]:
        extra = extra_key(self.fingerprint, tenant_salt(tenant, cache_salt))
        return hash_full_blocks(prompt_ids, block_size, extra)

    def predicted_tokens(self, state: NodeState, hashes: list[BlockHash], prompt_len: int) -> int:
        """Leading prompt tokens ``state`` holds, capped as the cache caps a hit."""
        held = state.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        bs = state.block_size
        return min(n * bs, (prompt_len - 1) // bs * bs) if bs else 0

    async def _looked_up(self, state: NodeState, prompt_ids: list[int], cache_salt: str, tenant: str) -> int:
        """A node's hit asked directly (its index is not synced)."""
        try:
            reply = await state.stub.LookupPrefix(
                cache_pb2.LookupPrefixRequest(
                    items=[
                        cache_pb2.LookupPrefixItem(
                            token_ids=prompt_ids, cache_salt=tenant_salt(tenant, cache_salt)
                        )
                    ]
                ),
                metadata=self._metadata,
                timeout=LOOKUP_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError:
            return 0
        bs = state.block_size or 1
        return min(reply.num_cached_tokens[0], (len(prompt_ids) - 1) // bs * bs)

    async def route(self, prompt_ids: list[int], cache_salt: str = "", tenant: str = "") -> Route:
        """Nodes to try for a request, best first (down nodes last)."""
        if not self.states:
            raise NoNode("no node is known yet (--nodes-dns found no cache pod so far); retry")
        now = time.monotonic()
        up = [s for s in self.states if s.up(now)]
        down = [s for s in self.states if not s.up(now)]
        candidates = up or down  # every node down: try them anyway
        if len(self.states) == 1:
            return self._decided(Route(list(self.states), [0], "only_node"))
        if self.policy == "round-robin":
            k = next(self._rr) % len(candidates)
            order = candidates[k:] + candidates[:k]
            return self._decided(Route(order + (down if up else []), [0] * len(self.states), "round_robin"))
        if self.policy == "random":
            order = list(candidates)
            self._random.shuffle(order)
            return self._decided(Route(order + (down if up else []), [0] * len(self.states), "random"))
        predicted: dict[int, int] = {}
        hashes_by_bs: dict[int, list[BlockHash]] = {}
        for state in candidates:
            bs = state.block_size
            if not bs:
                predicted[id(state)] = 0
                continue
            if not state.synced:
                predicted[id(state)] = await self._looked_up(state, prompt_ids, cache_salt, tenant)
                continue
            if bs not in hashes_by_bs:
                hashes_by_bs[bs] = self.block_hashes(prompt_ids, cache_salt, tenant, bs)
            predicted[id(state)] = self.predicted_tokens(state, hashes_by_bs[bs], len(prompt_ids))
        total_inflight = sum(s.inflight for s in candidates)
        tie = next(self._rr)

        def score(item: tuple[int, NodeState]) -> tuple[float, float, int]:
            k, state = item
            share = state.inflight / (total_inflight + 1)
            hit = predicted[id(state)] / max(1, len(prompt_ids))
            return (hit - self.load_weight * share, -share, -((k - tie) % len(candidates)))

        ranked = [s for _, s in sorted(enumerate(candidates), key=score, reverse=True)]
        best = ranked[0]
        best_hit = predicted[id(best)]
        reason = "prefix" if best_hit > 0 and best_hit >= max(predicted.values()) else "load"
        order = ranked + (down if up else [])
        return self._decided(Route(order, [predicted.get(id(s), 0) for s in order], reason))

    def _decided(self, route: Route) -> Route:
        self._count(route.reason)
        return route

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.route_decisions.labels(reason=reason).inc()

    def mark_down(self, state: NodeState) -> None:
        state.down_until = time.monotonic() + DOWN_S
        self._count("node_down")

    def record(self, state: NodeState, predicted: int, actual: int) -> None:
        """A finished request's predicted and actual cached prompt tokens on ``state``."""
        if self.metrics is not None:
            self.metrics.route_predicted_tokens.inc(predicted)
            self.metrics.route_actual_tokens.inc(actual)
            self.metrics.route_error_tokens.observe(abs(predicted - actual))
