"""The compute service's configuration: one dataclass, filled from flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

from kvtier import __version__
from kvtier.auth import default_cache_address, run_dir


@dataclass
class ComputeConfig:
    cache: str
    listen: str
    token_file: str | None
    tls_ca: str | None
    model: str | None
    seed: int
    device: str
    threads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    lookahead_blocks: int
    admit_timeout_s: float
    preemption_policy: str
    max_prompt_bytes: int | None
    max_request_bytes: int | None
    activation_reserve_gib: float | None
    connect_timeout: float
    metrics_port: int | None
    metrics_host: str | None
    vllm_metrics: bool
    metrics_model_name: str | None
    name: str
    log_level: str
    api_keys: str | None
    allow_node_token: bool

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())

    def activation_reserve_bytes(self) -> int | None:
        """--activation-reserve-gib in bytes, for the pre-load memory check (None: estimate it)."""
        return None if self.activation_reserve_gib is None else int(self.activation_reserve_gib * (1 << 30))


def build_parser(prog: str = "python -m kvtier.computesvc") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "kvtier compute replica: owns no KV memory. Attaches to the cache service, maps its pool "
            "zero-copy, runs the model with paged attention over pool blocks and streams completions "
            "(Generate). Start as many as you like; any replica can serve any request."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvtier compute replica {__version__}")
    p.add_argument(
        "--cache", default=default_cache_address(), help="cache service address (unix:///path or host:port)"
    )
    p.add_argument(
        "--listen",
        default=f"unix://{run_dir() / 'compute-0.sock'}",
        help="address to serve Generate on: unix:///path or tcp://host:port (port 0 = any free port)",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("KVTIER_TOKEN_FILE"),
        help="file with the shared token (for the cache service and for our own callers); $KVTIER_TOKEN wins",
    )
    p.add_argument("--tls-ca", help="PEM CA bundle: reach the cache service over TLS")
    p.add_argument(
        "--model",
        help="local Hugging Face Llama/Qwen2/Mistral directory (offline); default: the built-in tiny test model",
    )
    p.add_argument("--seed", type=int, default=0, help="weights seed of the built-in tiny model")
    p.add_argument("--device", default="auto", help="torch device for the model: auto, cpu or cuda[:N]")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads of this replica (replicas share the node's cores: give each its share; "
        "`kvtier up` chooses for the machine (a replica of one thread per CPU on a 2-CPU box, else one replica on every usable CPU); the startup line says what runs, threads "
        "and allocator)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together in one batch")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="prompt tokens prefilled per step (longer prompts are chunked)",
    )
    p.add_argument(
        "--lookahead-blocks",
        type=int,
        default=1,
        help="blocks reserved ahead of each decoding sequence, so most steps make no cache call",
    )
    p.add_argument(
        "--admit-timeout-s",
        type=float,
        default=60.0,
        help="seconds a request may wait for KV blocks (the pool held by others) before it fails with "
        "RESOURCE_EXHAUSTED; a request that can never fit (over its tenant's quota or the pool) fails at once",
    )
    p.add_argument(
        "--preemption-policy",
        default="cost",
        choices=["cost", "newest", "newest-recompute"],
        help="which running sequence gives way when the pool has no room: cost = the cheapest to bring "
        "back, swapped or recomputed, the refused tenant's own first, guarded against thrash "
        "(computesvc/preemption.py); newest = the newest, swapped out (the old rule); newest-recompute "
        "= the newest, freed to recompute (vLLM's rule); the last two are for comparison",
    )
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        help="longest text prompt, in UTF-8 bytes, a request may send (refused with INVALID_ARGUMENT "
        "before it is tokenized); default: 16 bytes per token of the model's context",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="largest Generate request in bytes, refused with RESOURCE_EXHAUSTED before it is parsed; "
        "default: the largest legitimate one (--max-prompt-bytes + 10 bytes per token of context + "
        "64 KiB for sampling fields and strings)",
    )
    p.add_argument(
        "--activation-reserve-gib",
        type=float,
        help="cuda: GiB this replica needs beyond its weights (activations of its largest forward, "
        "CUDA context), checked against free device memory before the weights load; default: "
        "estimated from the model shape (kvtier/memory_plan.py)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="seconds to keep retrying (with backoff) to reach the cache service before giving up",
    )
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0 = any free port)"
    )
    p.add_argument(
        "--metrics-host",
        help="address the metrics server binds (default: the host of --listen; 127.0.0.1 for a Unix socket)",
    )
    p.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="also export the series vLLM dashboards and autoscalers read under vLLM's vllm: names, with a "
        "model_name label (README, Metrics)",
    )
    p.add_argument(
        "--metrics-model-name",
        help="model_name label of the vllm: series (default: the --model directory's name, kvtier-tiny for "
        "the built-in model; give the gateway's --served-model-name if it differs)",
    )
    p.add_argument(
        "--name", default=f"compute-{os.getpid()}", help="replica name shown in the cache service's stats"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (stderr)",
    )
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        help="JSON file of client API keys per tenant (format: kvtier/api_keys.py). With it, Generate "
        "takes a client key (and charges its tenant), not the node token; without it, the node token "
        "works for Generate, as one tenant",
    )
    p.add_argument(
        "--allow-node-token",
        action="store_true",
        help="with --api-keys: also accept the node token for Generate (as the default tenant)",
    )
    return p


def parse_config(argv: list[str] | None = None, prog: str = "python -m kvtier.computesvc") -> ComputeConfig:
    cfg = ComputeConfig(**vars(build_parser(prog).parse_args(argv)))
    for flag in ("max_num_seqs", "max_num_batched_tokens", "lookahead_blocks", "threads"):
        if getattr(cfg, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(cfg, flag)}")
    if cfg.max_prompt_bytes is not None and cfg.max_prompt_bytes < 1:
        raise SystemExit(f"--max-prompt-bytes must be >= 1, got {cfg.max_prompt_bytes}")
    if cfg.max_request_bytes is not None and cfg.max_request_bytes < 1:
        raise SystemExit(f"--max-request-bytes must be >= 1, got {cfg.max_request_bytes}")
    if cfg.activation_reserve_gib is not None and not cfg.activation_reserve_gib >= 0:
        raise SystemExit(f"--activation-reserve-gib must be >= 0, got {cfg.activation_reserve_gib}")
    if not cfg.admit_timeout_s > 0:
        raise SystemExit(f"--admit-timeout-s must be > 0, got {cfg.admit_timeout_s}")
    if cfg.allow_node_token and not cfg.api_keys:
        raise SystemExit("--allow-node-token needs --api-keys (without keys the node token works anyway)")
    return cfg
