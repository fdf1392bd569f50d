"""The cache service's configuration: one dataclass, filled from flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

from kvtier import __version__
from kvtier.auth import default_cache_address
from kvtier.cachesvc import lower_tiers, shared_tier
from kvtier.kv_dtypes import KV_CACHE_DTYPE_CHOICES

GIB = 1 << 30


@dataclass
class CacheConfig:
    listen: str
    token_file: str | None
    tls_cert: str | None
    tls_key: str | None
    backend: str
    device: int
    model: str | None
    model_fingerprint: str | None
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    max_model_len: int | None
    dtype: str
    block_size: int
    num_blocks: int | None
    memory_fraction: float
    compute_replicas: int
    activation_reserve_gib: float | None
    kv_cache_space: float
    swap_space: float
    lease_ttl: float
    fence_hold_s: float
    max_batch: int
    max_blocks_per_tenant: int
    max_blocks_per_lease: int
    tenant_quotas: str | None
    fair_share: bool
    fair_share_reserve: float
    metrics_port: int | None
    metrics_host: str | None
    vllm_metrics: bool
    metrics_model_name: str | None
    log_level: str
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_topic: str
    kv_events_format: str
    max_request_bytes: int | None
    max_watch_streams: int
    event_log_events: int
    host_cache_gib: float
    host_cache_default: bool  # host_cache_gib is the service's default (auto), not a given flag
    disk_path: str
    disk_gib: float
    disk_write_policy: str
    disk_write_queue: int
    offload_min_hits: int
    shared_tier: str  # mooncake://MASTER:PORT, or "" (off): cachesvc/shared_tier.py
    shared_tier_metadata: str
    shared_tier_segment_gib: float
    shared_tier_timeout_s: float
    shared_tier_policy: str

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def build_parser(prog: str = "python -m kvtier.cachesvc") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "kvtier cache service: owns one accelerator's paged KV block pool and serves it over gRPC "
            "(allocate/extend/commit/free, prefix caching, swap, leases). Compute replicas on the same "
            "node map the pool zero-copy."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvtier cache service {__version__}")
    net = p.add_argument_group("network and auth")
    net.add_argument(
        "--listen",
        default=default_cache_address(),
        help="address to serve on: unix:///path/to.sock (owner-only socket) or tcp://host:port",
    )
    net.add_argument(
        "--token-file",
        default=os.environ.get("KVTIER_TOKEN_FILE"),
        help="file holding the shared token clients must present; $KVTIER_TOKEN wins if set. With neither, "
        "a fresh token is written to the run directory's `token` file (mode 0600)",
    )
    net.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key, serve TCP over TLS")
    net.add_argument("--tls-key", help="PEM private key for --tls-cert")

    shape = p.add_argument_group(
        "model shape (from --model, explicit flags, or the built-in tiny test model)"
    )
    shape.add_argument(
        "--model", help="local Hugging Face model directory; its config.json sets the pool shape"
    )
    shape.add_argument(
        "--model-fingerprint",
        help="override the model fingerprint (default: derived from config and weights)",
    )
    shape.add_argument("--num-layers", type=int, help="decoder layers (overrides --model)")
    shape.add_argument("--num-kv-heads", type=int, help="KV heads per layer (overrides --model)")
    shape.add_argument("--head-dim", type=int, help="head dimension (overrides --model)")
    shape.add_argument("--vocab-size", type=int, help="token ids must be below this (overrides --model)")
    shape.add_argument("--max-model-len", type=int, help="longest sequence in tokens (overrides --model)")

    pool = p.add_argument_group("pool")
    pool.add_argument(
        "--backend",
        choices=["auto", "cpu-shm", "cuda"],
        default="auto",
        help="pool memory: cuda (raw device allocation shared by CUDA IPC) or cpu-shm (POSIX shared memory); "
        "auto picks cuda when a GPU is usable",
    )
    pool.add_argument("--device", type=int, default=0, help="CUDA device index for the cuda backend")
    pool.add_argument(
        "--kv-cache-dtype",
        "--dtype",
        dest="dtype",
        choices=KV_CACHE_DTYPE_CHOICES,
        default="auto",
        help="KV element type (vLLM's names); auto = the model's dtype on cuda, float32 on cpu-shm; "
        "fp8 (= fp8_e4m3), fp8_e5m2 and int8 store one byte per element plus a float32 scale per "
        "token and KV head inside each block (about half of bf16's bytes); compute runs the weights "
        "in the model's dtype then",
    )
    pool.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64], help="tokens per block")
    pool.add_argument("--num-blocks", type=int, help="blocks in the pool (overrides the memory-based sizing)")
    pool.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="cuda: fraction of the device's TOTAL memory for everything kvtier runs on it (vLLM's "
        "--gpu-memory-utilization); the pool gets that budget minus what others hold at startup minus "
        "--compute-replicas x (the model's weights + activation reserve); the arithmetic is logged",
    )
    pool.add_argument(
        "--compute-replicas",
        type=int,
        default=2,
        help="cuda: compute replicas that will load the model on this device after the pool is made "
        "(their weights and activation reserve are kept out of the pool; 0 when they run elsewhere or "
        "are already loaded)",
    )
    pool.add_argument(
        "--activation-reserve-gib",
        type=float,
        help="cuda: GiB each compute replica needs beyond its weights (activations of its largest "
        "forward, CUDA context); default: estimated from the model shape and the compute defaults "
        "(2048 batched tokens, 64 sequences)",
    )
    pool.add_argument(
        "--kv-cache-space", type=float, default=1.0, help="cpu-shm: GiB of shared memory given to the pool"
    )
    pool.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        help="GiB of host memory for swapped-out blocks (0 = no swap); unused while the host cache "
        "is on (--host-cache-gib, on by default): swap then takes the host cache's slots",
    )

    lower_tiers.add_arguments(
        p.add_argument_group(
            "lower tiers", "the prefix cache below the pool: host memory, then disk (issue 22)"
        )
    )
    shared_tier.add_arguments(
        p.add_argument_group(
            "shared tier", "published blocks in Mooncake Store, shared by every node (issue 34)"
        )
    )
    # A service keeps a share of host memory for the prefixes its pool evicts (issue 22): auto,
    # resolved at parse time (parse_config), and cheap until used (the host cache's slots are
    # one lazily mapped allocation on the cpu; pinned on cuda, as --swap-space's area was).
    p.set_defaults(host_cache_gib="auto")
    svc = p.add_argument_group("service")
    svc.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="seconds a client lease lives without a heartbeat; then its sequences are released",
    )
    svc.add_argument(
        "--fence-hold-s",
        type=float,
        default=120.0,
        help="seconds the blocks an expired lease may still be writing (those with uncommitted "
        "slots) stay out of reuse after its sequences are released (one --lease-ttl after expiry), "
        "so a replica frozen inside a KV write cannot finish it into another lease's block unless "
        "it stays frozen longer than --lease-ttl + this; committed blocks return at once",
    )
    svc.add_argument("--max-batch", type=int, default=1024, help="most sequences one call may carry")
    svc.add_argument(
        "--max-blocks-per-tenant",
        type=int,
        default=0,
        help="most blocks one tenant's live sequences may hold (0 = no limit); a tenant's own "
        "max_blocks in --tenant-quotas wins",
    )
    svc.add_argument(
        "--max-blocks-per-lease",
        type=int,
        default=0,
        help="most blocks one lease (one compute replica) may hold (0 = no limit)",
    )
    svc.add_argument(
        "--tenant-quotas",
        metavar="FILE",
        help="the api-keys JSON file of the compute replicas (kvtier/api_keys.py): each tenant's "
        "max_blocks becomes its quota here (its keys are checked, never accepted by this service)",
    )
    svc.add_argument(
        "--fair-share",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="under pressure, refuse more blocks to a tenant holding its fair share of the pool or "
        "more (an even split among the tenants holding or waiting for blocks, quotas as caps), so "
        "its replicas wait or preempt and other tenants get in; nothing changes with one tenant",
    )
    svc.add_argument(
        "--fair-share-reserve",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="the pool is under pressure when a call would leave fewer than this fraction of its "
        "blocks free (or a tenant holding none is waiting for blocks)",
    )
    svc.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0 = any free port)"
    )
    svc.add_argument(
        "--metrics-host",
        help="address the metrics server binds (default: the host of --listen; 127.0.0.1 for a Unix socket)",
    )
    svc.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="also export the series vLLM dashboards and autoscalers read under vLLM's vllm: names, with a "
        "model_name label (README, Metrics)",
    )
    svc.add_argument(
        "--metrics-model-name",
        help="model_name label of the vllm: series (default: the --model directory's name, kvtier-tiny for "
        "the built-in model; give the gateway's --served-model-name if it differs)",
    )
    svc.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (stderr)",
    )
    svc.add_argument(
        "--max-request-bytes",
        type=int,
        help="largest Allocate / Commit / LookupPrefix request in bytes (default: what max-batch items "
        "of max-model-len tokens take); larger ones are RESOURCE_EXHAUSTED before they are parsed",
    )
    svc.add_argument(
        "--max-watch-streams",
        type=int,
        default=64,
        help="most WatchEvents streams open at once; one more is RESOURCE_EXHAUSTED",
    )
    svc.add_argument(
        "--event-log-events",
        type=int,
        default=65536,
        help="newest block events kept for event streams (about 100 bytes each); a reader further "
        "behind is ended OUT_OF_RANGE, and a follower that joins later starts with the blocks held "
        "(WatchEventBatches' start_with_held), as vLLM engines' block indexes and the router do",
    )
    events = p.add_argument_group(
        "KV events over ZMQ (vLLM's KV-event wire format, beside the gRPC WatchEvents stream)"
    )
    events.add_argument(
        "--kv-events-endpoint",
        help="bind a ZMQ PUB socket here (e.g. tcp://127.0.0.1:5557) and publish BlockStored / "
        "BlockRemoved batches as vLLM's publisher does; off when not given",
    )
    events.add_argument(
        "--kv-events-replay-endpoint",
        help="bind a ZMQ ROUTER socket here (e.g. tcp://127.0.0.1:5558) that replays kept batches "
        "from a sequence number; needs --kv-events-endpoint",
    )
    events.add_argument("--kv-events-topic", default="kv-events", help="topic frame of every published batch")
    events.add_argument(
        "--kv-events-format",
        choices=("map", "array"),
        default="map",
        help="each event as a map tagged by its type, as vLLM sends it today and llm-d, Dynamo and "
        "SGLang read it (map), or as the positional array of older vLLM releases (array)",
    )
    return p


def parse_config(argv: list[str] | None = None, prog: str = "python -m kvtier.cachesvc") -> CacheConfig:
    parser = build_parser(prog)
    # None survives parsing only when --host-cache-gib is not given: then the default, auto.
    args = parser.parse_args(argv, argparse.Namespace(host_cache_gib=None))
    args.host_cache_default = args.host_cache_gib is None
    if args.host_cache_default:
        args.host_cache_gib = lower_tiers.auto_host_cache_gib()
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        parser.error("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be > 0, got {args.max_request_bytes}")
    if args.fence_hold_s < 0:
        parser.error(f"--fence-hold-s must be >= 0 seconds, got {args.fence_hold_s}")
    if not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    if args.compute_replicas < 0:
        parser.error(f"--compute-replicas must be >= 0, got {args.compute_replicas}")
    if args.activation_reserve_gib is not None and args.activation_reserve_gib < 0:
        parser.error(f"--activation-reserve-gib must be >= 0, got {args.activation_reserve_gib}")
    if not 0 <= args.fair_share_reserve <= 1:
        parser.error(f"--fair-share-reserve must be in [0, 1], got {args.fair_share_reserve}")
    if args.max_watch_streams < 0:
        parser.error(f"--max-watch-streams must be >= 0, got {args.max_watch_streams}")
    if args.event_log_events < 1:
        parser.error(f"--event-log-events must be >= 1, got {args.event_log_events}")
    for flag in ("max_blocks_per_tenant", "max_blocks_per_lease"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0 (0 = no limit), got {getattr(args, flag)}")
    return CacheConfig(**vars(args))
