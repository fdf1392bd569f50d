"""`python -m kvtier.cachesvc`: flags -> pool, block manager, sequences, leases -> gRPC server."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import shutil
import sys
from dataclasses import dataclass, replace

from kvtier import auth, kv_dtypes, telemetry
from kvtier.api import cache_pb2_grpc
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.config import GIB, CacheConfig, parse_config
from kvtier.cachesvc.leases import LeaseTable
from kvtier.cachesvc.node import CacheNode
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.cachesvc.servicer import CacheServicer
from kvtier.cachesvc.wire_limits import request_limits, request_scans
from kvtier.cuda_pool import require_cuda
from kvtier.grpc_server import (
    AddressInUse,
    return_large_buffers_to_the_os,
    start_server,
    wait_for_termination,
)
from kvtier.memory_plan import DevicePoolPlan, model_needs, plan_device_pool
from kvtier.model_spec import ModelShape
from kvtier.pool import PoolUnavailable, create_pool, default_backend, pool_shape

log = logging.getLogger("kvtier.cache")


def model_shape(cfg: CacheConfig) -> ModelShape:
    """The model's KV geometry: --model DIR, else the built-in tiny model, then explicit flags on top."""
    shape = ModelShape.from_model_dir(cfg.model) if cfg.model else ModelShape.tiny()
    overrides = {
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_model_len": cfg.max_model_len,
        "fingerprint": cfg.model_fingerprint,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for key, value in overrides.items():
        if key != "fingerprint" and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be > 0, got {value}")
    return replace(shape, **overrides) if overrides else shape


@dataclass
class PoolPlan:
    """The pool to create: backend, element dtype (kvtier.kv_dtypes), blocks and bytes per block."""

    backend: str
    dtype: str
    num_blocks: int
    block_bytes: int


def plan_pool(cfg: CacheConfig, shape: ModelShape) -> PoolPlan:
    backend = default_backend() if cfg.backend == "auto" else cfg.backend
    dtype = kv_dtypes.pool_dtype(cfg.dtype, backend, shape.dtype)
    reason = kv_dtypes.unsupported_reason(dtype, f"cuda:{cfg.device}" if backend == "cuda" else "cpu")
    if reason:
        raise ValueError(f"--kv-cache-dtype {cfg.dtype}: {reason}")
    block_bytes = shape.block_bytes(cfg.block_size, dtype)
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    elif backend == "cuda":
        import torch

        require_cuda()
        free, total = torch.cuda.mem_get_info(cfg.device)
        device = f"cuda:{cfg.device} ({torch.cuda.get_device_name(cfg.device)})"
        weights = kv_dtypes.weights_dtype(dtype, backend, shape.dtype)
        num_blocks = device_pool_plan(cfg, weights, block_bytes, device, total, free).num_blocks
    else:
        budget = int(cfg.kv_cache_space * GIB)
        shm_free = shutil.disk_usage("/dev/shm").free
        if budget > shm_free:
            raise ValueError(
                f"--kv-cache-space {cfg.kv_cache_space} GiB exceeds the free space of /dev/shm "
                f"({shm_free / GIB:.2f} GiB); lower it or enlarge /dev/shm (docker: shm_size)"
            )
        num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"the pool would hold {num_blocks} blocks of {block_bytes} bytes: give it more memory"
        )
    return PoolPlan(backend, dtype, num_blocks, block_bytes)


def device_pool_plan(
    cfg: CacheConfig, weights_dtype: str, block_bytes: int, device: str, total: int, free: int
) -> DevicePoolPlan:
    """The cuda pool's share of a device of ``total`` bytes, ``free`` free now (kvtier/memory_plan.py),
    with each replica's weights at ``weights_dtype`` (kvtier.kv_dtypes.weights_dtype: the dtype
    compute runs them in, not necessarily the pool's), logged as one block; MemoryPlanError (a
    ValueError) when it leaves less than one block."""
    reserve = None if cfg.activation_reserve_gib is None else int(cfg.activation_reserve_gib * GIB)
    weights, reserve_of = model_needs(cfg.model, weights_dtype, reserve)
    plan = plan_device_pool(
        device=device,
        total_bytes=total,
        free_bytes=free,
        memory_fraction=cfg.memory_fraction,
        block_bytes=block_bytes,
        num_replicas=cfg.compute_replicas,
        weights=weights,
        reserve=reserve_of,
    )
    log.info("%s", plan.describe())
    return plan


async def serve(cfg: CacheConfig) -> None:
    telemetry.setup_tracing("kvtier-cache")
    shape = model_shape(cfg)
    plan = plan_pool(cfg, shape)
    token = auth.load_token(cfg.token_file)
    if token is None:
        token_path = auth.default_token_file()
        token = auth.create_token_file(token_path)
        log.info("no token given: wrote a new one to %s (clients read it from there)", token_path)

    spec_fields = {
        "model_fingerprint": shape.fingerprint,
        "vocab_size": shape.vocab_size,
        "max_model_len": shape.max_model_len,
    }
    if plan.backend == "cuda":
        spec_fields["device"] = cfg.device
    shape6 = pool_shape(plan.num_blocks, shape.num_layers, cfg.block_size, shape.num_kv_heads, shape.head_dim)
    pool = create_pool(plan.backend, shape6, plan.dtype, **spec_fields)
    try:
        await _serve_pool(cfg, shape, plan, pool, token)
    finally:
        pool.close()
        telemetry.shutdown_tracing()
        log.info("cache service stopped; pool released")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


async def _serve_pool(cfg: CacheConfig, shape: ModelShape, plan: PoolPlan, pool, token: str) -> None:
    # Whole blocks as bytes ([num_blocks, block_bytes] uint8): a quantized block's scales travel
    # with its codes, and every dtype swaps as one memcpy per block. Swap and cached blocks share
    # the host cache's area, swap first (--swap-space is swap's own area only without it).
    lower, host_area = build_lower_tiers(cfg, pool)
    num_host = host_area.num_blocks if host_area else 0
    log.info(
        "KV pool: %s %s, %d blocks x %d tokens = %d tokens of capacity, %s (%d bytes per block); "
        "host area (swap): %d blocks (%s); model %s… (%d layers, %d KV heads, head dim %d)",
        plan.backend,
        plan.dtype,
        plan.num_blocks,
        cfg.block_size,
        plan.num_blocks * cfg.block_size,
        human_bytes(plan.num_blocks * plan.block_bytes),
        plan.block_bytes,
        num_host,
        human_bytes(num_host * plan.block_bytes),
        shape.fingerprint[:12],
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
    )
    sequences = SequenceTable(
        BlockManager(plan.num_blocks, cfg.block_size),
        host_area,
        model_fingerprint=shape.fingerprint,
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_model_len,
        max_batch=cfg.max_batch,
        max_blocks_per_tenant=cfg.max_blocks_per_tenant,
        tenant_quotas=tenant_quotas(cfg, token),
        max_blocks_per_lease=cfg.max_blocks_per_lease,
        fair_share=cfg.fair_share,
        fair_share_reserve=math.ceil(cfg.fair_share_reserve * plan.num_blocks),
        lower_tiers=lower,
    )
    metrics = None
    if cfg.metrics_port is not None:
        from kvtier.cachesvc.metrics import CacheMetrics
        from kvtier.metrics import serve_metrics

        metrics = CacheMetrics()
        swap_bytes = num_host * plan.block_bytes
        metrics.describe_pool(cfg.block_size, plan.num_blocks, num_host, plan.dtype, swap_bytes, plan.backend)
        serve_metrics(metrics, cfg, log)
    node = CacheNode(sequences, LeaseTable(cfg.lease_ttl), cfg.fence_hold_s, cfg.event_log_events)
    kv_events = start_kv_events(cfg, node, plan.backend)
    try:
        await _run_server(cfg, node, pool, token, metrics)
    finally:
        if kv_events is not None:
            kv_events.close()
        if lower is not None:
            lower.close()  # what the disk's write queue holds reaches the disk


async def _run_server(cfg: CacheConfig, node: CacheNode, pool, token: str, metrics) -> None:
    servicer = CacheServicer(node, pool.spec, max_watch_streams=cfg.max_watch_streams)
    seqs = node.sequences
    server, health, address = await start_server(
        "kvtier.v1.CacheService",
        lambda s: cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, s),
        cfg.listen,
        token,
        cfg.tls_cert,
        cfg.tls_key,
        metrics,
        max_request_bytes=request_limits(
            seqs.max_batch, seqs.max_model_len, seqs.vocab_size, cfg.max_request_bytes
        ),
        raw_checks=request_scans(seqs.max_batch, seqs.max_model_len),
    )
    log.info("cache service listening on %s (lease ttl %.1fs)", address, cfg.lease_ttl)
    # NOTE: the Block objects (one per pool block), the tables and the gRPC machinery live as long
    # as the process. Freezing them takes them out of the garbage collector's full passes, which
    # would otherwise walk every block on the RPC path, a pause that grows with the pool.
    gc.collect()
    gc.freeze()
    reaper = asyncio.ensure_future(node.reap_leases_forever())
    if metrics is not None:
        refresher = asyncio.ensure_future(refresh_metrics(node, metrics))
    try:
        await wait_for_termination(server, health)
    finally:
        reaper.cancel()
        if metrics is not None:
            refresher.cancel()


def build_lower_tiers(cfg: CacheConfig, pool):
    """The tiers below the pool from the flags (cachesvc/lower_tiers.py: a TierStack or None) and
    swap's host area (or None); a disk record must match this pool's model, block size, dtype
    and block shape to be served. ValueError (a bad flag, an unusable --disk-path) stops the service."""
    from kvtier.cachesvc import lower_tiers
    from kvtier.cachesvc.disk_records import RecordLayout

    spec = pool.spec
    layout = RecordLayout(
        spec.model_fingerprint, spec.block_size, spec.dtype, tuple(spec.shape[1:]), spec.block_bytes
    )
    log.info("host cache: %s", host_cache_choice(cfg))
    tiers, area = lower_tiers.build(cfg, pool.rows, layout)
    if tiers is not None:
        log.info("lower tiers: %s", tiers.stats())
    return tiers, area


def host_cache_choice(cfg: CacheConfig) -> str:
    """The host cache's size and why, for the startup log: the flag as given, or the default
    (auto: min(AUTO_MAX_GIB, AUTO_SHARE x the memory available), with which bound chose it)."""
    from kvtier.cachesvc.lower_tiers import AUTO_MAX_GIB, AUTO_SHARE

    size = human_bytes(int(cfg.host_cache_gib * GIB))
    if not cfg.host_cache_default:
        return f"{size} (--host-cache-gib as given)" if cfg.host_cache_gib else "off (--host-cache-gib 0)"
    if cfg.host_cache_gib >= AUTO_MAX_GIB:
        why = f"the {AUTO_MAX_GIB:g} GiB cap ({AUTO_SHARE:.0%} of the memory available is more)"
    else:
        available = human_bytes(int(cfg.host_cache_gib / AUTO_SHARE * GIB))
        why = f"{AUTO_SHARE:.0%} of the {available} available to this process (MemAvailable, or a cgroup limit's headroom)"
    return f"{size}, the default (--host-cache-gib auto: {why}; --host-cache-gib 0 turns it off)"


def tenant_quotas(cfg: CacheConfig, token: str) -> dict[str, int]:
    """Per-tenant quotas from --tenant-quotas (the api-keys file; a client key equal to the node
    token is refused, as the compute service refuses it)."""
    if not cfg.tenant_quotas:
        return {}
    from kvtier.api_keys import ApiKeys

    quotas = ApiKeys.load(cfg.tenant_quotas, node_token=token).quotas()
    log.info("tenant quotas: %s", ", ".join(f"{t}={q}" for t, q in sorted(quotas.items())) or "none")
    return quotas


def start_kv_events(cfg: CacheConfig, node: CacheNode, backend: str):
    """The ZMQ KV-event publisher of --kv-events-endpoint, subscribed to the node's log; None if off."""
    if not cfg.kv_events_endpoint:
        return None
    import zmq

    from kvtier.cachesvc.kv_events_zmq import KvEventsPublisher

    try:
        publisher = KvEventsPublisher(
            cfg.kv_events_endpoint,
            node.events.block_size,
            replay_endpoint=cfg.kv_events_replay_endpoint,
            topic=cfg.kv_events_topic,
            medium="GPU" if backend == "cuda" else "CPU",
            event_format=cfg.kv_events_format,
            salt_of=node.sequences.extra_keys.salt_of,
        )
    except zmq.ZMQError as e:  # address in use, malformed endpoint
        raise ValueError(f"--kv-events-endpoint / --kv-events-replay-endpoint: {e}") from e
    node.events.sinks.append(publisher)
    log.info(
        "KV events (vLLM wire format, events as %ss) on %s, topic %r%s",
        cfg.kv_events_format,
        publisher.endpoint,
        cfg.kv_events_topic,
        f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "",
    )
    return publisher


async def refresh_metrics(node: CacheNode, metrics, period_s: float = 1.0) -> None:
    """Feed ``metrics`` (a CacheMetrics) a snapshot of ``node`` every ``period_s`` seconds."""
    while True:
        metrics.update(node.snapshot())
        await asyncio.sleep(period_s)


def main(argv: list[str] | None = None, prog: str = "python -m kvtier.cachesvc") -> int:
    cfg = parse_config(argv, prog)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.info("config: %s", cfg.describe())
    return_large_buffers_to_the_os()
    try:
        asyncio.run(serve(cfg))
    except (ValueError, PoolUnavailable, FileNotFoundError, AddressInUse) as e:
        log.error("cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
