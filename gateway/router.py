"""KV-aware routing across nodes: which node's replicas serve a request.

A *node* is one cache service (one pool, one accelerator) and the compute replicas attached to
it (``gateway/discovery.py`` finds them). The router follows each node's cached blocks and live
figures (``gateway/index_follower.py``) and names a request's blocks with the function the cache
itself uses (``kvtier.block_hash``: model fingerprint, tenant salt, token ids). A request's
*predicted hit* on a node is the length of the leading run of its block hashes that node holds,
in tokens, capped as the cache caps a hit.

Policies (``--routing``):

- ``kv-aware``: nodes ranked by ``gateway/scoring.py``: the prefill a node's cached prefix saves
  against the work queued there (``gateway/node_load.py``), both in seconds;
- ``round-robin`` and ``random``, for comparison.

A node that does not answer is routed around and retried after ``DOWN_S``. The router reads
only infrastructure RPCs (WatchEventBatches, GetStats, LookupPrefix), so it holds the node credential;
end users never see it.

Salts: a request carries the client's ``cache_salt``; bound to the request's tenant
(``kvtier.api_keys.tenant_salt``) it is the ``tenant_salt`` its blocks are hashed with, as the
cache hashes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass

from kvtier.api_keys import tenant_salt
from kvtier.block_hash import BlockHash, extra_key, hash_full_blocks
from kvtier.cache_client import CacheClient
from kvtier.gateway import index_follower
from kvtier.gateway.discovery import (
    Node,
    NodeFileError,
    NoNode,
    load_node_file,
    parse_dns_flag,
    parse_node_flag,
    rediscover_forever,
)
from kvtier.gateway.index_follower import DOWN_S, STATS_TIMEOUT_S, NodeState
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.scoring import NodeFigures, rank

__all__ = [
    "DOWN_S",
    "POLICIES",
    "Node",
    "NodeFileError",
    "NoNode",
    "NodeState",
    "Route",
    "Router",
    "load_node_file",
    "parse_dns_flag",
    "parse_node_flag",
]

log = logging.getLogger("kvtier.gateway.router")

POLICIES = ("kv-aware", "round-robin", "random")


@dataclass
class Route:
    """The router's answer for one request: nodes to try in order, and why the first was chosen."""

    nodes: list[NodeState]
    predicted_tokens: list[int]  # per node in `nodes`: the predicted cached prompt tokens
    reason: str  # prefix | load_spill | tie | round_robin | random | only_node


class OnNode:
    """One request open on one node (``Router.opened``): its work waits in the node's load until
    ``started`` (its first token) or ``closed`` is called; ``closed`` is called once."""

    def __init__(self, router: Router, state: NodeState, predicted: int, work_tokens: int) -> None:
        self._router, self.state, self.predicted, self.work_tokens = router, state, predicted, work_tokens
        self._started = False
        state.load.opened(work_tokens)
        router.metrics.node_requests.labels(node=state.name).inc()

    def started(self) -> None:
        """The request's first token arrived: its prefill no longer waits on the node."""
        if not self._started:
            self._started = True
            self.state.load.started(self.work_tokens)

    def closed(self, cached: int | None) -> None:
        """The request ended: with its actual cached prompt tokens (``usage``), or None if it
        did not finish (failed, cancelled, abandoned)."""
        self.state.load.closed(self.work_tokens, finished=cached is not None, started=self._started)
        if cached is not None:
            self._router.record(self.state, self.predicted, cached)


class Router:
    """Ranks nodes for a request; see the module docstring."""

    def __init__(
        self,
        nodes: list[Node],
        token: str | None,
        model_fingerprint: str,
        policy: str = "kv-aware",
        load_weight: float = 1.0,
        metrics: GatewayMetrics | None = None,
        seed: int | None = None,
        dns: tuple[str, str] | None = None,
        tls_ca: str | None = None,
    ) -> None:
        """``token``: the node credential (None: read where a local stack keeps it). ``dns``: the
        (cache, compute) headless Services of --nodes-dns; nodes are then found, and kept
        current, by resolving them (``nodes`` may start empty). ``tls_ca``: PEM CA bundle for
        cache services that serve TLS."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if not nodes and dns is None:
            raise ValueError("the router needs at least one node")
        self.dns = dns
        self.policy = policy
        self.load_weight = load_weight
        self.fingerprint = model_fingerprint
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self._token = token
        self._tls_ca = tls_ca
        self._rr = itertools.count()
        self._random = random.Random(seed)
        self.states: list[NodeState] = []  # every state's `peers` (a shared tier's hits are any node's)
        self.states += [self._state_of(node) for node in nodes]
        self._started = False
        self._dns_task: asyncio.Task | None = None

    def _state_of(self, node: Node) -> NodeState:
        client = CacheClient.connect(
            node.cache, self._token, aio=True, tls_ca=self._tls_ca, timeout_s=STATS_TIMEOUT_S
        )
        state = NodeState(node, client, peers=self.states)
        self.metrics.watch_node(state.name, lambda: state.up(time.monotonic()), lambda: state.inflight)
        return state

    # ------------------------------------------------------------ life

    async def start(self) -> None:
        """Start following every node (on the running loop); returns at once."""
        self._started = True
        for state in self.states:
            index_follower.follow(state, self._count)
        if self.dns is not None:
            self._dns_task = asyncio.create_task(
                rediscover_forever(self.dns, self.set_dns_nodes), name="router-dns"
            )

    async def set_dns_nodes(self, caches: list[str], replicas: list[str]) -> None:
        """Make the nodes those of ``caches`` (cache pod addresses), each with ``replicas`` as
        candidates; the replicas a node already knows it owns (from its leases) stay its own."""
        known = {s.node.cache: s for s in self.states}
        for state in [s for s in self.states if s.node.cache not in caches]:
            log.info("router: node %s is gone from DNS", state.name)
            self.states.remove(state)
            await index_follower.stop(state)
            self.metrics.forget_node(state.name)
        for address in caches:
            state = known.get(address)
            if state is None:
                state = self._state_of(
                    Node(f"cache-{address}", address, list(replicas), candidates=list(replicas))
                )
                log.info("router: node %s found in DNS", state.name)
                self.states.append(state)
                if self._started:
                    index_follower.follow(state, self._count)
            else:
                state.node.candidates = list(replicas)
                if not set(state.node.compute) <= set(replicas):
                    state.node.compute = list(replicas)  # a replica it had is gone: ask the leases again

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        for state in self.states:
            await index_follower.stop(state)

    async def wait_synced(self, timeout_s: float) -> None:
        """Until every node's index follows its events and its block size is known (tests, startup)."""
        deadline = time.monotonic() + timeout_s
        while not (self.states and all(s.synced and s.block_size for s in self.states)):
            if time.monotonic() > deadline:
                late = [s.name for s in self.states if not (s.synced and s.block_size)]
                raise TimeoutError(f"router: nodes {late} not synced within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------ routing

    def block_hashes(
        self, prompt_ids: list[int], cache_salt: str, tenant: str, block_size: int
    ) -> list[BlockHash]:
        """The request's full blocks as the cache names them (the client's ``cache_salt`` bound
        to ``tenant`` first)."""
        return self._hashes(prompt_ids, tenant_salt(tenant, cache_salt), block_size)

    def _hashes(self, prompt_ids: list[int], salt: str, block_size: int) -> list[BlockHash]:
        """``salt``: a tenant salt (already bound)."""
        return hash_full_blocks(prompt_ids, block_size, extra_key(self.fingerprint, salt))

    @staticmethod
    def predicted_tokens(state: NodeState, hashes: list[BlockHash], prompt_len: int) -> int:
        """Leading prompt tokens ``state`` holds on any tier, capped as the cache caps a hit."""
        return index_follower.predicted_hit(state, hashes, prompt_len).total

    async def route(
        self, prompt_ids: list[int], cache_salt: str = "", tenant: str = "", request_id: str = ""
    ) -> Route:
        """Nodes to try for a request, best first (down nodes last). ``cache_salt``: the client's
        salt, as the request carries it; ``tenant``: whose request it is ("" = the default);
        ``request_id``: named in the DEBUG line that explains the decision."""
        if not self.states:
            raise NoNode("no node is known yet (--nodes-dns found no cache pod so far); retry")
        now = time.monotonic()
        up = [s for s in self.states if s.up(now)]
        down = [s for s in self.states if not s.up(now)]
        candidates = up or down  # every node down: try them anyway
        after = down if up else []
        for _ in after:  # routed around: last in the order
            self._count("node_down")
        if len(self.states) == 1:
            return self._decided(Route(list(self.states), [0], "only_node"))
        if self.policy == "round-robin":
            k = next(self._rr) % len(candidates)
            order = candidates[k:] + candidates[:k]
            return self._decided(Route(order + after, [0] * len(self.states), "round_robin"))
        if self.policy == "random":
            order = list(candidates)
            self._random.shuffle(order)
            return self._decided(Route(order + after, [0] * len(self.states), "random"))
        predicted = await self._predictions(candidates, prompt_ids, tenant_salt(tenant, cache_salt))
        figures = [
            NodeFigures(
                p.device,
                round(s.load.waiting_tokens()),
                s.load.tokens_per_s(),
                s.inflight,
                p.below,
                s.load.waiting_requests,
            )
            for p, s in zip(predicted, candidates, strict=True)
        ]
        ranking = rank(figures, len(prompt_ids), self.load_weight, next(self._rr))
        order = [candidates[k] for k in ranking.order]
        tokens = [predicted[k].total for k in ranking.order] + [0] * len(after)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s: %d prompt tokens -> %s (%s); %s",
                request_id,
                len(prompt_ids),
                order[0].name,
                ranking.reason,
                "; ".join(
                    f"{s.name}: cached {f.predicted_tokens}"
                    f"{''.join(f' +{n} {m}' for m, n in f.below_tokens.items())}, {f.inflight} in flight "
                    f"({f.waiting_requests} waiting), "
                    f"queued {f.outstanding_tokens} tokens at "
                    f"{f.tokens_per_s:.0f}/s, score {ranking.scores[k] * 1000:.1f} ms"
                    for k, (s, f) in enumerate(zip(candidates, figures, strict=True))
                ),
            )
        return self._decided(Route(order + after, tokens, ranking.reason))

    async def _predictions(
        self, states: list[NodeState], prompt_ids: list[int], salt: str
    ) -> list[index_follower.PredictedHit]:
        """Each node's predicted hit per tier for the prompt hashed with the tenant salt ``salt``:
        from its indexes, asked with LookupPrefix while it is not synced, none while its block
        size is unknown."""
        hashes_by_bs: dict[int, list[BlockHash]] = {}
        predicted = []
        for state in states:
            bs = state.block_size
            if not bs:
                predicted.append(index_follower.PredictedHit())
            elif not state.synced:
                predicted.append(await index_follower.looked_up(state, prompt_ids, salt))
            else:
                if bs not in hashes_by_bs:
                    hashes_by_bs[bs] = self._hashes(prompt_ids, salt, bs)
                predicted.append(index_follower.predicted_hit(state, hashes_by_bs[bs], len(prompt_ids)))
        return predicted

    def _decided(self, route: Route) -> Route:
        self._count(route.reason)
        return route

    def _count(self, reason: str) -> None:
        self.metrics.route_decisions.labels(reason=reason).inc()

    def mark_down(self, state: NodeState) -> None:
        state.down_until = time.monotonic() + DOWN_S
        self._count("node_down")

    def opened(self, state: NodeState, predicted: int, request_tokens: int) -> OnNode:
        """A request is being sent to ``state``'s node: from now its work counts in the node's load
        (requests routed meanwhile see it). ``predicted``: its cached prompt tokens predicted
        there; ``request_tokens``: the prompt tokens it has prefilled, over all its samples.
        Call ``started`` on the result at its first token and ``closed`` when it ends."""
        return OnNode(self, state, predicted, max(0, request_tokens - predicted))

    def record(self, state: NodeState, predicted: int, actual: int) -> None:
        """A finished request's predicted and actual cached prompt tokens on ``state``."""
        m = self.metrics
        m.route_predicted_tokens.inc(predicted)
        m.route_actual_tokens.inc(actual)
        m.route_error_tokens.observe(abs(predicted - actual))
        m.node_predicted_tokens.labels(node=state.name).inc(predicted)
        m.node_actual_tokens.labels(node=state.name).inc(actual)
