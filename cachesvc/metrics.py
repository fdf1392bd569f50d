"""Prometheus metrics of the cache service: block pool, prefix cache, swap and leases."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from kvtier.metrics import CACHE_RPC_BUCKETS, RpcLatency, VllmAliases

if TYPE_CHECKING:
    from kvtier.cachesvc.node import CacheSnapshot


# The unary RPCs (proto/kvtier/v1/cache.proto), labelled (method, OK) from the start.
CACHE_RPCS = (
    "Attach", "Heartbeat", "Allocate", "Extend", "Commit", "Free", "LookupPrefix", "SwapOut", "SwapIn", "GetStats",
)  # fmt: skip


class CacheMetrics(RpcLatency):
    """Block pool, prefix cache, swap and lease metrics of one cache service.

    Gauges and counters are filled from a ``CacheSnapshot`` by ``update`` (call it after a batch
    of RPCs or on a timer, from the event loop); RPC latency by ``observe_rpc`` (called by
    ``kvtier.call_guard.CallGuard``).
    """

    # CacheSnapshot attribute -> counter attribute, label values. The snapshot's values are
    # cumulative since the service started.
    _COUNTERS = (
        ("prefix_query_tokens", "prefix_query_tokens", ()),
        ("prefix_hit_tokens", "prefix_hit_tokens", ()),
        ("num_evictions", "evictions", ()),
        ("num_swap_out_blocks", "swapped_blocks", ("out",)),
        ("num_swap_in_blocks", "swapped_blocks", ("in",)),
        ("num_swap_out_bytes", "swapped_bytes", ("out",)),
        ("num_swap_in_bytes", "swapped_bytes", ("in",)),
        ("num_expired_leases", "expired_leases", ()),
        ("num_window_released_blocks", "window_released_blocks", ()),
    )
    # CacheSnapshot attribute -> gauge attribute.
    _GAUGES = (
        ("num_blocks_total", "capacity_blocks"),
        ("num_blocks_free", "free_blocks"),
        ("num_blocks_used", "used_blocks"),
        ("num_blocks_cached", "cached_blocks"),
        ("usage_percent", "block_usage_percent"),
        ("num_host_blocks_total", "host_capacity_blocks"),
        ("num_host_blocks_used", "host_used_blocks"),
        ("num_sequences", "sequences"),
        ("num_swapped_sequences", "swapped_sequences"),
        ("num_leases", "active_leases"),
        ("num_tokens", "resident_tokens"),
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry, "kvtier_cache", "Server-side time of one RPC.", CACHE_RPC_BUCKETS)
        r, p = self.registry, "kvtier_cache"
        self.block_usage_percent = Gauge(
            f"{p}_block_usage_percent", "Used blocks / total blocks, 0..100.", registry=r
        )
        self.kv_usage_ratio = Gauge(
            f"{p}_kv_usage_ratio",
            "Used blocks / total blocks, 0..1 (vLLM's kv_cache_usage_perc).",
            registry=r,
        )
        self.config = Info(
            f"{p}_config",
            "The pool: block_size (tokens), num_gpu_blocks, num_cpu_blocks (host tier), cache_dtype, "
            "swap_space_bytes, backend.",
            registry=r,
        )
        self.capacity_blocks = Gauge(f"{p}_capacity_blocks", "Blocks in the device pool.", registry=r)
        self.free_blocks = Gauge(
            f"{p}_free_blocks", "Blocks no sequence references (cached or empty).", registry=r
        )
        self.used_blocks = Gauge(
            f"{p}_used_blocks", "Blocks referenced by at least one sequence.", registry=r
        )
        self.cached_blocks = Gauge(
            f"{p}_cached_blocks", "Blocks holding a hash in the prefix index.", registry=r
        )
        self.host_capacity_blocks = Gauge(
            f"{p}_host_capacity_blocks", "Blocks in the host area (swap and host cache).", registry=r
        )
        self.host_used_blocks = Gauge(
            f"{p}_host_used_blocks", "Host-tier blocks holding swapped KV.", registry=r
        )
        self.sequences = Gauge(f"{p}_sequences", "Sequences the cache service holds.", registry=r)
        self.swapped_sequences = Gauge(
            f"{p}_swapped_sequences", "Sequences living in the host tier.", registry=r
        )
        self._flow_metrics(r, p)
        self._lease_metrics(r, p)
        self._tier_metrics(r, p)
        # Label values known up front: the series exist at 0 before the first swap or call.
        for direction in ("out", "in"):
            self.swapped_blocks.labels(direction)
            self.swapped_bytes.labels(direction)
        for method in CACHE_RPCS:
            self.rpc_duration.labels(method, "OK")
        # (counter attribute, label values) -> last cumulative value seen in a snapshot
        self._last_cumulative: dict[tuple[str, tuple[str, ...]], float] = {}

    def _flow_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Prefix-cache and swap counters (cumulative since start)."""
        self.prefix_query_tokens = Counter(f"{p}_prefix_query_tokens", "Prompt tokens looked up.", registry=r)
        self.prefix_hit_tokens = Counter(f"{p}_prefix_hit_tokens", "Prompt tokens found cached.", registry=r)
        self.prefix_hit_ratio = Gauge(
            f"{p}_prefix_hit_ratio", "Hit tokens / query tokens since start, 0..1.", registry=r
        )
        self.evictions = Counter(f"{p}_evictions", "Cached blocks evicted from the prefix index.", registry=r)
        self.window_released_blocks = Counter(
            f"{p}_window_released_blocks",
            "Blocks a sliding window left behind, given back early.",
            registry=r,
        )
        self.swapped_blocks = Counter(
            f"{p}_swapped_blocks",
            "Blocks moved to (out) or from (in) the host tier.",
            ["direction"],
            registry=r,
        )
        self.swapped_bytes = Counter(
            f"{p}_swapped_bytes",
            "Bytes moved to (out) or from (in) the host tier.",
            ["direction"],
            registry=r,
        )

    # TierSnapshot attribute -> (metric suffix, help) per tier; gauges first, then counters.
    _TIER_GAUGES = (
        ("num_blocks", "tier_blocks", "Published blocks a tier of the prefix cache holds."),
        ("num_bytes", "tier_bytes", "Bytes of the published blocks a tier holds."),
        ("write_queue_depth", "tier_write_queue_depth", "Blocks taken, not yet stored."),
    )
    _TIER_COUNTERS = (
        ("num_hit_blocks", "tier_hit_blocks", "Allocate's prefix-hit blocks served by a tier."),
        (
            "num_promotions",
            "tier_promoted_blocks",
            "Blocks promoted into (device) or out of (host, disk) a tier.",
        ),
        ("num_evictions", "tier_evicted_blocks", "Published blocks a tier evicted."),
        ("num_stored_blocks", "tier_stored_blocks", "Blocks written into a lower tier."),
        ("num_skipped_blocks", "tier_skipped_blocks", "Blocks offered to a lower tier that it did not take."),
    )

    def _tier_metrics(self, r: CollectorRegistry, p: str) -> None:
        """The prefix cache per tier, labelled medium = a medium's name (kvtier.media)."""
        for _, name, doc in self._TIER_GAUGES:
            setattr(self, name, Gauge(f"{p}_{name}", doc, ["medium"], registry=r))
        for _, name, doc in self._TIER_COUNTERS:
            setattr(self, name, Counter(f"{p}_{name}", doc, ["medium"], registry=r))

    def _update_tiers(self, snapshot: CacheSnapshot) -> None:
        for tier in snapshot.tiers:
            for field, name, _ in self._TIER_GAUGES:
                getattr(self, name).labels(tier.medium).set(getattr(tier, field))
            for field, name, _ in self._TIER_COUNTERS:
                self._advance(name, (tier.medium,), float(getattr(tier, field)))

    def _advance(self, attr: str, labels: tuple[str, ...], value: float) -> None:
        """Advance counter ``attr`` to a cumulative ``value`` (a lower one: the source restarted)."""
        last = self._last_cumulative.get((attr, labels), 0.0)
        delta = value - last if value >= last else value
        self._last_cumulative[attr, labels] = value
        counter = getattr(self, attr)
        if delta:
            (counter.labels(*labels) if labels else counter).inc(delta)

    def _lease_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Leases, resident tokens, slot waste and per-tenant blocks."""
        self.active_leases = Gauge(f"{p}_active_leases", "Compute leases alive.", registry=r)
        self.resident_tokens = Gauge(
            f"{p}_resident_tokens", "Tokens of the sequences held on the device.", registry=r
        )
        self.slot_waste_ratio = Gauge(
            f"{p}_slot_waste_ratio",
            "Token slots of live block tables holding no token yet (partly filled last blocks, "
            "lookahead), 0..1.",
            registry=r,
        )
        self.expired_leases = Counter(
            f"{p}_expired_leases", "Leases that missed their heartbeats.", registry=r
        )
        self.tenant_blocks = Gauge(
            f"{p}_tenant_blocks",
            "Blocks a tenant's live sequences hold (device and host tier; a shared prefix block "
            'counts once per holder). Tenant "" = callers without a client API key.',
            ["tenant"],
            registry=r,
        )
        self.tenant_quota_blocks = Gauge(
            f"{p}_tenant_quota_blocks",
            "Most blocks a tenant may hold (0 = no limit).",
            ["tenant"],
            registry=r,
        )

    def update(self, snapshot: CacheSnapshot) -> None:
        """Set gauges and advance counters from a snapshot of the cache.

        Counters advance by the difference to the previous cumulative value; a value lower than
        the last one (the source restarted) counts from zero again.
        """
        for name, attr in self._GAUGES:
            getattr(self, attr).set(getattr(snapshot, name))
        self.kv_usage_ratio.set(snapshot.usage_percent / 100.0)
        for name, attr, labels in self._COUNTERS:
            self._advance(attr, labels, float(getattr(snapshot, name)))
        self._update_tiers(snapshot)
        self.tenant_blocks.clear()
        self.tenant_quota_blocks.clear()
        for t in snapshot.tenants:
            self.tenant_blocks.labels(t.tenant).set(t.num_blocks)
            self.tenant_quota_blocks.labels(t.tenant).set(t.max_blocks)
        if snapshot.num_token_slots:
            self.slot_waste_ratio.set(1.0 - snapshot.num_tokens / snapshot.num_token_slots)
        queries = self._last_cumulative.get(("prefix_query_tokens", ()), 0.0)
        if queries:
            self.prefix_hit_ratio.set(self._last_cumulative.get(("prefix_hit_tokens", ()), 0.0) / queries)

    def describe_pool(
        self,
        block_size: int,
        num_blocks: int,
        num_host_blocks: int,
        dtype: str,
        swap_bytes: int,
        backend: str,
    ) -> None:
        """Set the config info (once, at start): what vLLM's cache_config_info says of its cache."""
        self.capacity_blocks.set(num_blocks)
        self.config.info(
            {
                "block_size": str(block_size),
                "num_gpu_blocks": str(num_blocks),
                "num_cpu_blocks": str(num_host_blocks),
                "cache_dtype": dtype,
                "swap_space_bytes": str(swap_bytes),
                "enable_prefix_caching": "True",
                "backend": backend,
            }
        )

    def vllm_aliases(self, model_name: str) -> VllmAliases:
        """KV cache usage and the cache config under vLLM's names (register on ``self.registry``).
        The pool is the node's, shared by its replicas: it is exported here, once per node; the
        prefix-cache queries and hits under vLLM's names come from each replica's own admissions
        (computesvc/metrics.py), so a sum over pods counts each lookup once."""
        return VllmAliases(
            model_name,
            [(self.kv_usage_ratio, ("vllm:kv_cache_usage_perc",)), (self.config, ("vllm:cache_config",))],
        )
