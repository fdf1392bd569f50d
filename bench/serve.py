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
import contextlib
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import (  # noqa: E402
    ContinuousBatchingServer,
    MemorySample,
    PreallocatedServer,
    Reply,
)
from models import random_llama_dir  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "long-unique")
SYSTEMS = ("kvtier", "kvtier-prefix-off", "hf-static-prealloc", "hf-continuous-batching")
SAMPLE_PERIOD_S = 0.05
BLOCK_SIZE = 16

# The metrics every run and every system summary carries (the test checks them all).
RUN_METRICS = (
    "throughput_rps",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "prefix_hit_rate",
    "peak_kv_bytes",
    "kv_waste",
)
SUMMARY_METRICS = (*RUN_METRICS, "max_concurrent_seqs")


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """Requests sent one after another: turn k+1 once turn k completed, think_s later."""

    start_s: float  # offset from the run's start
    turns: list[RequestSpec]
    think_s: list[float]  # before each turn after the first


@dataclass(frozen=True)
class Workload:
    """One run's traffic. warmup: requests sent one at a time before the clock starts, not measured."""

    sessions: list[Session]
    warmup: list[RequestSpec] = field(default_factory=list)


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of the generated workloads, in tokens (max_tokens = output tokens per request)."""

    max_model_len: int
    max_tokens: int
    num_prefixes: int = 2
    chat_turns: int = 3
    think_mean_s: float = 0.1


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def poisson_starts(rng: random.Random, rate: float, n: int) -> list[float]:
    """n arrival offsets (s) of a Poisson process of `rate` per second; the first at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_workload(kind: str, shape: WorkloadShape, rate: float, num_requests: int, seed: int) -> Workload:
    """The traffic of one run. Each (kind, seed) draws fresh prompts: no run hits another's cache.

    shared-prefix warms up with one request per system prompt (every system gets them; only a
    prefix cache profits): a server in steady state has its system prompts cached, and a run of
    a few requests would otherwise measure mostly the cold misses.
    """
    rng = random.Random(f"{kind}-{seed}")
    max_len, out = shape.max_model_len, shape.max_tokens
    if kind == "shared-prefix":
        prefixes = [_tokens(rng, int(0.85 * max_len)) for _ in range(shape.num_prefixes)]
        specs = [
            RequestSpec(prefixes[rng.randrange(len(prefixes))] + _tokens(rng, rng.randint(8, 40)), out)
            for _ in range(num_requests)
        ]
        starts = poisson_starts(rng, rate, num_requests)
        return Workload(
            [Session(t, [s], []) for t, s in zip(starts, specs, strict=True)],
            warmup=[RequestSpec(p + _tokens(rng, 8), out) for p in prefixes],
        )
    if kind == "long-unique":
        specs = [
            RequestSpec(_tokens(rng, rng.randint(int(0.6 * max_len), int(0.85 * max_len))), out)
            for _ in range(num_requests)
        ]
        starts = poisson_starts(rng, rate, num_requests)
        return Workload([Session(t, [s], []) for t, s in zip(starts, specs, strict=True)])
    if kind == "multi-turn":
        turns = shape.chat_turns
        num_conversations = max(1, math.ceil(num_requests / turns))
        first_len = (max_len // 8, max_len // 4)
        follow_len = (max_len // 32, max_len // 12)
        sessions = []
        for start in poisson_starts(rng, rate, num_conversations):
            history = _tokens(rng, rng.randint(*first_len))
            specs = [RequestSpec(list(history), out)]
            for _ in range(turns - 1):
                # The assistant's reply in the history is synthetic (fixed per seed), so every
                # system sees the same prompts whatever it generated.
                history += _tokens(rng, out) + _tokens(rng, rng.randint(*follow_len))
                specs.append(RequestSpec(list(history), out))
            think = [rng.expovariate(1 / shape.think_mean_s) for _ in range(turns - 1)]
            sessions.append(Session(start, specs, think))
        return Workload(sessions)
    raise ValueError(f"unknown workload {kind!r}; one of {WORKLOADS}")


def make_burst(shape: WorkloadShape, num_requests: int, seed: int) -> list[RequestSpec]:
    """Chat-sized requests (prompts 10-30% of max_model_len, 32 output tokens) sent all at once."""
    rng = random.Random(f"burst-{seed}")
    lo, hi = shape.max_model_len // 10, (3 * shape.max_model_len) // 10
    return [RequestSpec(_tokens(rng, rng.randint(lo, hi)), 32) for _ in range(num_requests)]


# --------------------------------------------------------------------------- kvtier as a system


@dataclass
class RequestRecord:
    """One request as the client saw it (perf_counter seconds)."""

    prompt_len: int
    max_tokens: int
    sent_at: float
    token_times: list[float] = field(default_factory=list)  # one per output token
    cached_prompt_tokens: int = 0
    done_at: float | None = None
    error: str | None = None

    @property
    def decoding(self) -> bool:
        return bool(self.token_times) and self.done_at is None and self.error is None


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


# --------------------------------------------------------------------------- load generator


@dataclass
class RunResult:
    system: str
    workload: str
    rate: float
    records: list[RequestRecord]
    samples: list[MemorySample]
    t0: float
    t_end: float


async def _sample_until(
    system, records: list[RequestRecord], samples: list[MemorySample], done: asyncio.Event
):
    while not done.is_set():
        samples.append(await system.sample_memory(records))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_PERIOD_S)


async def _send(system, spec: RequestSpec, records: list[RequestRecord]) -> RequestRecord:
    rec = RequestRecord(len(spec.prompt), spec.max_tokens, time.perf_counter())
    records.append(rec)
    try:
        async for reply in system.stream(spec.prompt, spec.max_tokens):
            now = time.perf_counter()
            rec.token_times += [now] * len(reply.token_ids)
            if reply.cached_prompt_tokens is not None:
                rec.cached_prompt_tokens = reply.cached_prompt_tokens
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
    rec.done_at = time.perf_counter()
    return rec


async def run_workload(system, workload: str, rate: float, traffic: Workload) -> RunResult:
    """Send the warm-up, then play the sessions against `system` in real time, sampling its KV memory."""
    for spec in traffic.warmup:
        rec = await _send(system, spec, [])
        if rec.error:
            raise RuntimeError(f"{system.name}: warm-up request failed: {rec.error}")
    records: list[RequestRecord] = []
    samples: list[MemorySample] = []
    done = asyncio.Event()
    t0 = time.perf_counter()

    async def play(session: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + session.start_s - time.perf_counter()))
        for k, spec in enumerate(session.turns):
            if k:
                await asyncio.sleep(session.think_s[k - 1])
            rec = await _send(system, spec, records)
            if rec.error:
                return

    sampler = asyncio.create_task(_sample_until(system, records, samples, done))
    await asyncio.gather(*(play(s) for s in traffic.sessions))
    t_end = time.perf_counter()
    done.set()
    await sampler
    return RunResult(system.name, workload, rate, records, samples, t0, t_end)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_metrics(r: RunResult) -> dict:
    ok = [x for x in r.records if x.error is None and x.token_times]
    ttft = [x.token_times[0] - x.sent_at for x in ok]
    # Inter-token latency: gaps between consecutive tokens of a request (tokens that arrive in
    # one reply share its gap evenly).
    itl: list[float] = []
    for x in ok:
        times = x.token_times
        k = 1
        while k < len(times):
            j = k
            while j < len(times) and times[j] == times[k]:
                j += 1
            itl += [(times[k] - times[k - 1]) / (j - k)] * (j - k)
            k = j
    duration = max(1e-9, r.t_end - r.t0)
    prompt = sum(x.prompt_len for x in ok)
    measured = [s for s in r.samples if s.unused_slots is not None and s.slots > 0]
    slots = sum(s.slots for s in measured)
    return {
        "workload": r.workload,
        "rate": r.rate,
        "num_requests": len(r.records),
        "num_errors": sum(x.error is not None for x in r.records),
        "errors": sorted({x.error for x in r.records if x.error})[:3],
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(len(x.token_times) for x in ok) / duration,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(x.cached_prompt_tokens for x in ok),
        "prefix_hit_rate": sum(x.cached_prompt_tokens for x in ok) / prompt if prompt else 0.0,
        "peak_kv_bytes": max((s.used_bytes for s in r.samples), default=0),
        "waste_slots": sum(s.unused_slots for s in measured),
        "waste_total_slots": slots,
        "kv_waste": sum(s.unused_slots for s in measured) / slots if slots else float("nan"),
        "waste_samples": len(measured),
        "memory_samples": len(r.samples),
        "memory_timeline": [[round(s.t - r.t0, 4), s.used_bytes, s.num_seqs] for s in r.samples],
        "_ttft": ttft,
        "_itl": itl,
    }


def summarize(runs: list[dict], max_concurrent_seqs: float) -> dict:
    """One system over all its runs: rates pooled over busy time, percentiles over all requests."""
    busy = sum(r["duration_s"] for r in runs)
    done = sum(r["num_requests"] - r["num_errors"] for r in runs)
    ttft = [v for r in runs for v in r["_ttft"]]
    itl = [v for r in runs for v in r["_itl"]]
    prompt = sum(r["prompt_tokens"] for r in runs)
    slots = sum(r["waste_total_slots"] for r in runs)
    return {
        "throughput_rps": done / busy,
        "output_tokens_per_s": sum(r["output_tokens_per_s"] * r["duration_s"] for r in runs) / busy,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "prefix_hit_rate": sum(r["cached_prompt_tokens"] for r in runs) / prompt if prompt else 0.0,
        "peak_kv_bytes": max(r["peak_kv_bytes"] for r in runs),
        "kv_waste": sum(r["waste_slots"] for r in runs) / slots if slots else float("nan"),
        "max_concurrent_seqs": max_concurrent_seqs,
        "num_requests": sum(r["num_requests"] for r in runs),
        "num_errors": sum(r["num_errors"] for r in runs),
    }


# --------------------------------------------------------------------------- concurrency on M bytes


async def measure_concurrency(system, burst: list[RequestSpec]) -> dict:
    """Send the whole burst at once; the most sequences holding KV at one time, and any errors."""
    records: list[RequestRecord] = []
    samples: list[MemorySample] = []
    done = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample_until(system, records, samples, done))
    await asyncio.gather(*(_send(system, spec, records) for spec in burst))
    done.set()
    await sampler
    errors = [x.error for x in records if x.error]
    return {
        "method": "measured: peak of sequences holding KV during a burst",
        "max_concurrent_seqs": max((s.num_seqs for s in samples), default=0),
        "peak_kv_bytes": max((s.used_bytes for s in samples), default=0),
        "num_requests": len(burst),
        "num_errors": len(errors),
        "errors": sorted(set(errors))[:3],
        "duration_s": time.perf_counter() - t0,
        "timeline": [[round(s.t - t0, 4), s.num_seqs, s.used_bytes] for s in samples],
    }


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

    from computesvc.model import build_tiny_model

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
    from kvtier.compute_client import ComputeClient
    from kvtier_cli.stack import LocalStack

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
        await cache.attach_async("bench-serve")
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
        await asyncio.gather(*(_send(systems[1], RequestSpec([7] * 40, 2), []) for _ in range(cfg.replicas)))
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


# --------------------------------------------------------------------------- report


def _ms(v: float) -> str:
    return f"{1000 * v:.1f}" if math.isfinite(v) else "-"


def _pc(v: float) -> str:
    return f"{v:.1%}" if math.isfinite(v) else "-"


def json_safe(value):
    """NaN/inf (a metric with no sample, e.g. waste when no instant was measurable) -> null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def markdown(report: dict) -> str:
    lines = [
        f"KV budget M = {report['config']['kv_budget_bytes'] / 2**20:.2f} MiB for every system "
        f"({report['config']['budget_seqs']} x max_model_len {report['config']['max_model_len']} x "
        f"{report['config']['kv_bytes_per_token']} B/token); model: {report['config']['model']}",
        "",
        "| system | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | prefix hit "
        "| peak KV MiB | KV waste | max concurrent seqs on M |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in report["systems"].items():
        m = s["summary"]
        lines.append(
            f"| {name} | {m['throughput_rps']:.2f} | {m['output_tokens_per_s']:.1f} | {_ms(m['ttft_p50_s'])} | "
            f"{_ms(m['ttft_p99_s'])} | {_ms(m['itl_p50_s'])} | {_ms(m['itl_p99_s'])} | "
            f"{_pc(m['prefix_hit_rate'])} | {m['peak_kv_bytes'] / 2**20:.2f} | {_pc(m['kv_waste'])} | "
            f"{m['max_concurrent_seqs']} |"
        )
    lines += [
        "",
        "| system | workload | rate/s | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| prefix hit | peak KV MiB | KV waste | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in report["systems"].items():
        for r in s["runs"]:
            lines.append(
                f"| {name} | {r['workload']} | {r['rate']:g} | {r['throughput_rps']:.2f} | "
                f"{r['output_tokens_per_s']:.1f} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                f"{_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} | {_pc(r['prefix_hit_rate'])} | "
                f"{r['peak_kv_bytes'] / 2**20:.2f} | {_pc(r['kv_waste'])} | {r['num_errors']} |"
            )
    if report["skipped"]:
        lines += ["", *[f"- skipped {k}: {v}" for k, v in report["skipped"].items()]]
    return "\n".join(lines)


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(SYSTEMS, ("C0", "C1", "C2", "C3"), strict=True))
    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 8), squeeze=False)
    for col, workload in enumerate(WORKLOADS):
        for row, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("itl", "inter-token latency (ms)"))):
            ax = axes[row][col]
            for name, s in report["systems"].items():
                runs = [r for r in s["runs"] if r["workload"] == workload]
                rates = [r["rate"] for r in runs]
                for q, style in (("p50", "-o"), ("p99", "--x")):
                    ax.plot(
                        rates,
                        [1000 * r[f"{metric}_{q}_s"] for r in runs],
                        style,
                        color=colors.get(name),
                        label=f"{name} {q}",
                    )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("offered load (sessions/s)")
            ax.set_ylabel(label)
            ax.set_title(workload)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Latency vs load (same model, same KV budget)")
    fig.tight_layout()
    latency_png = out / "latency_vs_load.png"
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)

    budget_mib = report["config"]["kv_budget_bytes"] / 2**20
    fig, axes = plt.subplots(1, len(WORKLOADS) + 1, figsize=(5 * (len(WORKLOADS) + 1), 4), squeeze=False)
    for col, workload in enumerate(WORKLOADS):
        ax = axes[0][col]
        for name, s in report["systems"].items():
            runs = [r for r in s["runs"] if r["workload"] == workload]
            if runs:
                r = runs[-1]  # the highest rate
                tl = r["memory_timeline"]
                ax.plot([p[0] for p in tl], [p[1] / 2**20 for p in tl], color=colors.get(name), label=name)
        ax.axhline(budget_mib, color="k", linestyle=":", label="budget M")
        ax.set_title(f"{workload} @ {report['config']['rates'][-1]:g}/s")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV memory in use (MiB)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    for name, c in report["concurrency"].items():
        if "timeline" in c:
            tl = c["timeline"]
            ax.plot([p[0] for p in tl], [p[1] for p in tl], color=colors.get(name), label=name)
        else:
            ax.axhline(
                c["max_concurrent_seqs"], color=colors.get(name), linestyle="--", label=f"{name} (computed)"
            )
    ax.set_title(f"burst: sequences holding KV on M = {budget_mib:.1f} MiB")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    memory_png = out / "memory_over_time.png"
    fig.savefig(memory_png, dpi=110)
    plt.close(fig)
    return [latency_png, memory_png]


def headline(report: dict) -> dict:
    systems = report["systems"]
    kv = systems["kvtier"]["summary"]
    prealloc = systems["hf-static-prealloc"]["summary"]
    low = report["config"]["rates"][0]

    def ttft(name: str) -> float:
        return next(
            r["ttft_p50_s"]
            for r in systems[name]["runs"]
            if r["workload"] == "shared-prefix" and r["rate"] == low
        )

    return {
        "kvtier_kv_waste": kv["kv_waste"],
        "concurrency_ratio_vs_prealloc": kv["max_concurrent_seqs"] / prealloc["max_concurrent_seqs"],
        "kvtier_concurrent_seqs": kv["max_concurrent_seqs"],
        "prealloc_concurrent_seqs": prealloc["max_concurrent_seqs"],
        "shared_prefix_rate": low,
        "shared_prefix_ttft_p50_kvtier_s": ttft("kvtier"),
        "shared_prefix_ttft_p50_prefix_off_s": ttft("kvtier-prefix-off"),
        "shared_prefix_ttft_ratio": ttft("kvtier-prefix-off") / ttft("kvtier"),
    }


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
