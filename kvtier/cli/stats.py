"""`kvtier stats`: a cache service's statistics as JSON; in the run directory of
`kvtier up --nodes N`, every node's and their totals."""

from __future__ import annotations

import json
import sys

from kvtier import auth

# GetStats fields that add up across nodes (counts of blocks, tokens, sequences, events).
SUMMED = (
    "num_blocks_total",
    "num_blocks_free",
    "num_blocks_used",
    "num_blocks_cached",
    "num_blocks_fenced",
    "num_host_blocks_total",
    "num_host_blocks_used",
    "num_sequences",
    "num_swapped_sequences",
    "num_tokens",
    "num_token_slots",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "num_evictions",
    "num_expired_leases",
    "num_swap_out_blocks",
    "num_swap_in_blocks",
    "num_window_released_blocks",
)


def caches_to_ask(cache: str | None) -> dict[str, str]:
    """{node name: cache address}: ``cache`` (--cache) alone if given, else every node of the
    stack recorded in the run directory, else the local stack's one cache service."""
    if cache:
        return {"cache": cache}
    from kvtier.cli.stack_file import recorded_stack

    info = recorded_stack(auth.run_dir())
    if info and info.get("nodes"):
        return {n["name"]: n["cache"] for n in info["nodes"]}
    return {"cache": auth.default_cache_address()}


def totals(stats: list) -> dict:
    """The SUMMED fields over ``stats`` (CacheSnapshots), with the pool usage and the
    prefix hit rate they imply."""
    out: dict = {name: sum(getattr(s, name) for s in stats) for name in SUMMED}
    out["usage_percent"] = 100.0 * out["num_blocks_used"] / max(1, out["num_blocks_total"])
    out["prefix_hit_rate"] = out["prefix_hit_tokens"] / max(1, out["prefix_query_tokens"])
    return out


def cmd_stats(args) -> int:
    from dataclasses import asdict

    from kvtier.cache_client import CacheClient
    from kvtier.cache_errors import CacheCallError

    caches = caches_to_ask(args.cache)
    answered: dict = {}
    failed: dict[str, str] = {}
    for name, address in caches.items():
        try:
            client = CacheClient.connect(address, timeout_s=5.0)
        except (RuntimeError, ValueError) as e:  # no token, or a blank one
            print(f"kvtier stats: {e}", file=sys.stderr)
            return 1
        try:
            answered[name] = client.get_stats()
        except CacheCallError as e:
            failed[name] = f"the cache service at {address} answered {e.code}: {e.details}"
        finally:
            client.close()
    if len(caches) == 1:
        if failed:
            print(
                f"kvtier stats: {next(iter(failed.values()))} (is a stack running? `kvtier up`)",
                file=sys.stderr,
            )
            return 1
        print(json.dumps(asdict(next(iter(answered.values()))), indent=2))
        return 0
    nodes = {name: asdict(s) for name, s in answered.items()}
    nodes |= {name: {"error": why} for name, why in failed.items()}
    print(json.dumps({"nodes": nodes, "totals": totals(list(answered.values()))}, indent=2))
    for name, why in failed.items():
        print(f"kvtier stats: node {name}: {why}", file=sys.stderr)
    return 1 if failed else 0
