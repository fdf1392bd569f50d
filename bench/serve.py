"""Serving benchmark: kvtier against baselines on three workloads, Poisson arrivals, same model, same KV budget.

Systems (all in one run, on the same model and the same KV memory budget M):
  kvtier                  the local stack: one cache service + 2 compute replicas (real processes),
                          pool of M / block_bytes blocks, prefix caching on, replicas with
                          --lookahead-blocks 1 (their default, 4, reserves 64 slots per sequence)
  kvtier-prefix-off       the same stack, every request with its own cache_salt (no block is shared)
  hf-static-prealloc      transformers `generate` in this process: static batches, a StaticCache row
                          of max_model_len tokens per request (B = M / row bytes requests at once)
  hf-continuous-batching  transformers' own continuous batching (paged cache, prefix sharing) in
                          this process, M bytes of blocks of the same size as kvtier's

Workloads, generated in code from a seed (token ids are bytes), each at several arrival rates:
  shared-prefix  few long system prompts (85% of max_model_len), many short questions (8-40 tokens);
                 each system prompt is sent once before the measured stream (steady state)
  multi-turn     conversations: each turn's prompt extends the previous turn's (history + reply +
                 new message); conversations start as a Poisson process, a turn follows the
                 previous one's completion after an exponential think time
  long-unique    long prompts (60-85% of max_model_len) that share nothing
Rates are in sessions/s (a session is one request, or one conversation in multi-turn). Every
request is greedy and makes exactly max_tokens tokens (EOS ignored) on every system.

Metrics per system and run: throughput (requests/s, output tokens/s), TTFT and inter-token
latency p50/p99 (client side), prefix hit rate (cached prompt tokens / prompt tokens), peak KV
memory and KV waste (both sampled every ~50 ms: kvtier from the cache service's GetStats,
the baselines from what they allocate), and the most sequences held at once on M bytes (kvtier
and transformers CB: measured with a burst of requests; preallocated: M / (max_model_len x bytes
per token)). See `KvtierSystem.sample_memory` for how kvtier's waste is measured.

    python bench/serve.py --quick                 # built-in tiny model, 2 rates, ~1-2 min on 2 cores
    python bench/serve.py                         # a 4-layer hidden-256 random Llama, 4 rates (~10 min)
    python bench/serve.py --model DIR             # any local Llama-family checkpoint

Writes serve.json, serve.md, latency_vs_load.png and memory_over_time.png to --out (default
bench/out/serve/). Targets (issue): kvtier KV waste <= 4%; >= 2.5x the concurrent sequences of
the preallocated baseline; >= 5x lower TTFT than prefix-off on shared-prefix. The last line is
the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import ContinuousBatchingServer, MemorySample, PreallocatedServer, Reply  # noqa: E402
from models import random_llama_dir  # noqa: E402
from serve_load import RequestRecord, RunResult, measure_concurrency, run_workload, send  # noqa: E402
from serve_report import headline, json_safe, markdown, plot, run_metrics, summarize  # noqa: E402
from serve_workloads import WORKLOADS, RequestSpec, WorkloadShape, make_burst, make_workload  # noqa: E402

BLOCK_SIZE = 16


# --------------------------------------------------------------------------- kvtier as a system


class KvtierSystem:
    """The local stack behind `ComputeClient`, its KV read from the cache service's GetStats."""

    def __init__(self, name: str, compute, cache, block_size: int, block_bytes: int, unique_salts: bool):
        self.name = name
        self.compute = compute
        self.cache = cache
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.unique_salts = unique_salts
        self._salt_ids = itertools.count()

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[Reply]:
        salt = f"{self.name}-{next(self._salt_ids)}" if self.unique_salts else ""
        request = self.compute.request(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=salt
        )
        async for reply in self.compute.stream(request):
            yield Reply(
                list(reply.token_ids),
                reply.usage.cached_prompt_tokens if reply.finish_reason else None,
            )

    async def sample_memory(self, records: list[RequestRecord]) -> MemorySample:
        """Used KV = num_blocks_used x block_bytes. Waste = slots of the sequences' blocks holding no token.

        GetStats gives, per lease, the blocks in its sequences' block tables (a shared block counts
        once per sequence). Shared blocks are full (only full blocks are published), so summed over
        sequences, block-table slots minus tokens held = the empty slots (partial last blocks +
        reserved lookahead). Tokens held come from the client: a decoding request holds prompt +
        received - 1 tokens (the newest token's KV is written by the next step). The sample counts
        only when the cache's live sequences are exactly the client's decoding requests; otherwise
        some sequence is mid-prefill or mid-free and unused_slots is None.
        """
        stats = await self.cache.get_stats()
        decoding = [r for r in records if r.decoding]
        live = stats.num_sequences - stats.num_swapped_sequences
        slots = stats.num_blocks_used * self.block_size
        unused = None
        if stats.num_swapped_sequences == 0 and live == len(decoding):
            table_slots = sum(lease.num_blocks for lease in stats.leases) * self.block_size
            held = sum(r.prompt_len + len(r.token_times) - 1 for r in decoding)
            unused = max(0, table_slots - held)
        return MemorySample(
            time.perf_counter(), stats.num_blocks_used * self.block_bytes, slots, unused, live
        )


# --------------------------------------------------------------------------- the benchmark


@dataclass
class BenchConfig:
    out: Path
    quick: bool
    model_dir: str | None  # None: the compute service's built-in tiny model
    rates: list[float]
    num_requests: int
    max_tokens: int
    budget_seqs: int  # M = budget_seqs x max_model_len x KV bytes per token
    burst_factor: int  # burst = burst_factor x the preallocated baseline's sequences
    lookahead_blocks: int
    replicas: int
    baseline_threads: int
    seed: int


def make_model_dir(path: Path, seed: int = 0) -> Path:
    """A random byte-vocabulary Llama (hidden 256, 4 layers, 1024 positions) saved like any HF checkpoint."""
    return random_llama_dir(
        path, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=1024, seed=seed
    )


def load_baseline_model(model_dir: str | None):
    """The same weights the compute replicas run, with transformers' default (sdpa) attention."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtier.computesvc.model import build_tiny_model

    if model_dir is None:
        model = build_tiny_model(seed=0)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.set_attn_implementation("sdpa")
    return model.eval().requires_grad_(False)


async def run_kvtier(
    cfg: BenchConfig, shape: WorkloadShape, num_blocks: int, burst: list[RequestSpec]
) -> dict:
    from kvtier.cache_client import CacheClient
    from kvtier.cli.stack import LocalStack
    from kvtier.compute_client import ComputeClient

    token = "bench-serve-token"
    run_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    model_args = ["--model", cfg.model_dir] if cfg.model_dir else []
    stack = LocalStack(
        run_dir,
        # cpu-shm pool and CPU compute even where a GPU exists: the baselines run on the CPU too.
        [
            *model_args,
            *("--backend", "cpu-shm", "--dtype", "float32"),
            *("--num-blocks", str(num_blocks), "--swap-space", "0", "--log-level", "WARNING"),
            # The same KV budget as the baselines: the pool alone, no host cache (on by default).
            *("--host-cache-gib", "0"),
        ],
        [
            *model_args,
            *("--device", "cpu"),
            "--threads",
            "1",
            "--max-num-seqs",
            "256",
            "--lookahead-blocks",
            str(cfg.lookahead_blocks),
            "--log-level",
            "WARNING",
        ],
        num_replicas=cfg.replicas,
        env=dict(os.environ, KVTIER_TOKEN=token),
    )
    out: dict = {"runs": {}, "concurrency": None}
    t = time.perf_counter()
    await asyncio.to_thread(stack.up)
    print(f"  kvtier stack up in {time.perf_counter() - t:.1f}s", flush=True)
    cache = CacheClient.connect(stack.cache_address, token, aio=True)
    compute = ComputeClient(stack.compute_addresses, token)
    beat = None
    try:
        await cache.attach("bench-serve")
        beat = asyncio.create_task(cache.heartbeat_forever())
        pool = cache.pool
        out["pool"] = {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "block_bytes": pool.block_bytes,
            "max_model_len": pool.max_model_len,
        }
        systems = [
            KvtierSystem("kvtier", compute, cache, pool.block_size, pool.block_bytes, unique_salts=False),
            KvtierSystem(
                "kvtier-prefix-off", compute, cache, pool.block_size, pool.block_bytes, unique_salts=True
            ),
        ]
        # Warm both replicas (first forward pays one-off costs), on prompts no workload uses.
        await asyncio.gather(*(send(systems[1], RequestSpec([7] * 40, 2), []) for _ in range(cfg.replicas)))
        for system in systems:
            out["runs"][system.name] = await run_all_workloads(system, cfg, shape)
        # Unique salts: no shared prefix inflates the count.
        out["concurrency"] = await measure_concurrency(systems[1], burst)
    finally:
        if beat is not None:
            beat.cancel()
        await compute.close()
        await cache.close()
        await asyncio.to_thread(stack.down)
    return out


async def run_all_workloads(system, cfg: BenchConfig, shape: WorkloadShape) -> list[RunResult]:
    results = []
    for w, workload in enumerate(WORKLOADS):
        for k, rate in enumerate(cfg.rates):
            traffic = make_workload(
                workload, shape, rate, cfg.num_requests, seed=cfg.seed * 1000 + 10 * w + k
            )
            t = time.perf_counter()
            result = await run_workload(system, workload, rate, traffic)
            m = run_metrics(result)
            print(
                f"  {system.name:>22} {workload:>13} @ {rate:5.1f}/s: {m['num_requests']:3d} req in "
                f"{time.perf_counter() - t:5.1f}s, TTFT p50 {1000 * m['ttft_p50_s']:7.1f} ms, "
                f"hit {m['prefix_hit_rate']:.2f}, errors {m['num_errors']}",
                flush=True,
            )
            results.append(result)
    return results


async def run_baselines(cfg: BenchConfig, shape: WorkloadShape, budget_bytes: int, burst) -> dict:
    import torch
    from baselines import kv_bytes_per_token

    torch.set_num_threads(cfg.baseline_threads)
    out: dict = {"runs": {}, "concurrency": {}, "skipped": {}}
    model = load_baseline_model(cfg.model_dir)
    per_token = kv_bytes_per_token(model.config, model.dtype)
    row_bytes = shape.max_model_len * per_token
    static = PreallocatedServer(model, shape.max_model_len, max_batch_size=budget_bytes // row_bytes)
    await asyncio.to_thread(static.start)
    try:
        out["runs"][static.name] = await run_all_workloads(static, cfg, shape)
    finally:
        await asyncio.to_thread(static.stop)
    out["concurrency"][static.name] = {
        "method": "computed: M / (max_model_len x KV bytes per token); each request owns a full row",
        "max_concurrent_seqs": budget_bytes // row_bytes,
        "num_errors": 0,
        "static_cache_bytes_checked": static.checked_cache_bytes,
    }
    cb_model = load_baseline_model(cfg.model_dir)
    cb = ContinuousBatchingServer(
        cb_model, num_blocks=budget_bytes // (BLOCK_SIZE * per_token), block_size=BLOCK_SIZE
    )
    try:
        await asyncio.to_thread(cb.start)
    except Exception as e:  # noqa: BLE001 - an optional baseline: say why, go on
        out["skipped"][cb.name] = (
            f"transformers continuous batching did not start here: {type(e).__name__}: {e}"
        )
        print(f"  skipped {cb.name}: {out['skipped'][cb.name]}", flush=True)
        return out
    try:
        out["runs"][cb.name] = await run_all_workloads(cb, cfg, shape)
        out["concurrency"][cb.name] = await measure_concurrency(cb, burst)
        out["concurrency"][cb.name]["pool_bytes"] = cb.pool_bytes
    finally:
        await asyncio.to_thread(cb.stop)
    return out


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "serve")
    ap.add_argument(
        "--quick", action="store_true", help="built-in tiny model, 2 rates, few requests (~1-2 min)"
    )
    ap.add_argument(
        "--model", help="local HF Llama-family dir (default: tiny with --quick, else a random 4-layer)"
    )
    ap.add_argument("--rates", type=float, nargs="+", help="arrival rates, sessions/s")
    ap.add_argument("--requests", type=int, help="requests per run")
    ap.add_argument("--max-tokens", type=int, help="output tokens per request")
    ap.add_argument("--budget-seqs", type=int, default=8, help="KV budget M in full-length sequences")
    ap.add_argument("--burst-factor", type=int, default=6, help="burst size / preallocated concurrency")
    ap.add_argument("--lookahead-blocks", type=int, default=1, help="compute replicas' --lookahead-blocks")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--baseline-threads", type=int, default=2, help="torch threads of the in-process baselines"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    return BenchConfig(
        out=a.out,
        quick=a.quick,
        model_dir=a.model,
        rates=a.rates or ([4.0, 16.0] if a.quick else [1.0, 2.0, 4.0, 8.0]),
        num_requests=a.requests or (8 if a.quick else 16),
        max_tokens=a.max_tokens or (16 if a.quick else 32),
        budget_seqs=a.budget_seqs,
        burst_factor=a.burst_factor,
        lookahead_blocks=a.lookahead_blocks,
        replicas=a.replicas,
        baseline_threads=a.baseline_threads,
        seed=a.seed,
    )


async def bench(cfg: BenchConfig) -> dict:
    from kvtier.model_spec import ModelShape

    t_start = time.perf_counter()
    if cfg.model_dir is None and not cfg.quick:
        cfg.model_dir = str(
            make_model_dir(Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-model-")) / "model")
        )
    model_shape = ModelShape.from_model_dir(cfg.model_dir) if cfg.model_dir else ModelShape.tiny(0)
    max_len = model_shape.max_model_len
    block_bytes = model_shape.block_bytes(BLOCK_SIZE, "float32")
    per_token = block_bytes // BLOCK_SIZE
    budget_bytes = cfg.budget_seqs * max_len * per_token
    num_blocks = budget_bytes // block_bytes
    shape = WorkloadShape(max_model_len=max_len, max_tokens=cfg.max_tokens)
    burst = make_burst(shape, cfg.burst_factor * cfg.budget_seqs, cfg.seed)
    print(
        f"model {cfg.model_dir or 'built-in tiny'}: max_model_len {max_len}, {per_token} KV bytes/token; "
        f"KV budget M = {budget_bytes / 2**20:.2f} MiB = {num_blocks} blocks of {BLOCK_SIZE} = "
        f"{cfg.budget_seqs} preallocated sequences; rates {cfg.rates}/s, {cfg.num_requests} requests per run",
        flush=True,
    )
    kv = await run_kvtier(cfg, shape, num_blocks, burst)
    if kv["pool"]["block_bytes"] != block_bytes or kv["pool"]["max_model_len"] != max_len:
        raise RuntimeError(f"cache service pool {kv['pool']} differs from the model shape {model_shape}")
    base = await run_baselines(cfg, shape, budget_bytes, burst)

    concurrency = {"kvtier": kv["concurrency"], **base["concurrency"]}
    concurrency["kvtier-prefix-off"] = kv["concurrency"]  # the burst uses unique salts: it is prefix-off
    systems = {}
    for name, results in {**kv["runs"], **base["runs"]}.items():
        runs = [run_metrics(r) for r in results]
        summary = summarize(runs, concurrency[name]["max_concurrent_seqs"])
        for r in runs:
            del r["_ttft"], r["_itl"]
        systems[name] = {"summary": summary, "runs": runs}
    report = {
        "config": {
            "model": cfg.model_dir or "built-in tiny llama (kvtier.model_spec.TINY_LLAMA_CONFIG, seed 0)",
            "max_model_len": max_len,
            "block_size": BLOCK_SIZE,
            "block_bytes": block_bytes,
            "kv_bytes_per_token": per_token,
            "budget_seqs": cfg.budget_seqs,
            "kv_budget_bytes": budget_bytes,
            "kvtier_num_blocks": num_blocks,
            "rates": cfg.rates,
            "requests_per_run": cfg.num_requests,
            "max_tokens": cfg.max_tokens,
            "lookahead_blocks": cfg.lookahead_blocks,
            "replicas": cfg.replicas,
            "baseline_threads": cfg.baseline_threads,
            "quick": cfg.quick,
            "workloads": list(WORKLOADS),
            "shared_prefix_warmup": "one unmeasured request per system prompt before each shared-prefix run",
        },
        "systems": systems,
        "concurrency": {k: v for k, v in concurrency.items() if k != "kvtier-prefix-off"},
        "skipped": base["skipped"],
    }
    report["headline"] = headline(report)
    report["wall_time_s"] = time.perf_counter() - t_start
    return report


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(bench(cfg))
    pngs = plot(report, cfg.out)
    (cfg.out / "serve.json").write_text(json.dumps(json_safe(report), indent=1, allow_nan=False))
    table = markdown(report)
    (cfg.out / "serve.md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nwrote {cfg.out / 'serve.json'}, {cfg.out / 'serve.md'}, {', '.join(str(p) for p in pngs)}")
    print(f"wall time {report['wall_time_s']:.1f}s")
    h = report["headline"]
    print(
        f"headline: kvtier KV waste {h['kvtier_kv_waste']:.1%} (target <= 4%); "
        f"{h['kvtier_concurrent_seqs']} concurrent sequences on M vs {h['prealloc_concurrent_seqs']} preallocated "
        f"= {h['concurrency_ratio_vs_prealloc']:.1f}x (target >= 2.5x); shared-prefix TTFT p50 @ "
        f"{h['shared_prefix_rate']:g}/s {1000 * h['shared_prefix_ttft_p50_kvtier_s']:.1f} ms vs "
        f"{1000 * h['shared_prefix_ttft_p50_prefix_off_s']:.1f} ms prefix-off = "
        f"{h['shared_prefix_ttft_ratio']:.1f}x lower (target >= 5x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
