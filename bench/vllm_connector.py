"""kvtier as vLLM's KV cache (issue 33): what the connector buys and what it costs, in one run.

Real processes: a cache service and three vLLM OpenAI servers (the CPU build) on the serving
benchmark's model (bench/serve.py: the seeded random byte Llama, hidden 256, 4 layers, 4 heads,
2 KV heads, float32), with 4,096 positions here (a 2,000-token prefix does not fit serve.py's
1,024). Engines A and B run ``KvtierConnector``; C is the same engine without it: every flag and
variable is the same for the three (``--engine-threads`` OpenMP threads each) except
``--kv-transfer-config``.

- TTFT: B serving a prompt whose 2,000-token prefix A computed (loaded from kvtier) against B
  recomputing a prefix of the same length nobody computed, the two taking turns (the headline is
  the median of the rounds' ratios, with their range), and B's own prefix cache holding the prefix
  (a second prompt on it: the floor any KV cache could reach); then where the
  loaded TTFT goes: the arriving prompt's cache call (Allocate: the hit pinned, room for the
  rest) timed from this process, the copy of the hit into vLLM's blocks (the connector's own copier, in this
  process), and one engine step computing the prompt's uncovered tail (B's TTFT of that many
  tokens alone). Target <= 0.3x.
- Throughput: a no-reuse workload (unique prompts, every block saved to kvtier) on B against C,
  in pairs of back-to-back runs (B C, C B, ...), each after the other engine's busy-poll has ended;
  the headline is the median of the pairs' ratios, with their range (on a shared machine the
  load moves more between pairs than within one). Target >= 0.95x. The pairs are also given by
  where B's saves stand in the cache after each (GetStats): the pool not yet evicting, the host
  tier filling (its fresh memory mapped as first used), every tier full (a long-running cache's
  state), each phase's median on a line of its own: one effect at a time.
- Copy rates, in this process: loads (pool -> vLLM blocks, one pass per run of consecutive ids)
  and saves (vLLM blocks -> pool, in vLLM's step) through the connector's copier, with vLLM's CPU
  layout learned from its own write as the connector learns it, against a plain copy of the same
  bytes (index_copy_ of the rows gathered beforehand: one pass): the floor. These repeat on the
  same blocks (in the CPU's caches); on CPU a second line has saves as the engine makes them, into
  pool blocks no copy has touched (a shared-memory pool of the cache service's size, its pages
  mapped first, as the worker maps the cache's), against a plain copy into such blocks.

    python bench/vllm_connector.py            # 5 TTFT rounds, 10 throughput pairs of 16 requests
    python bench/vllm_connector.py --quick    # 3 rounds, 4 pairs
    python bench/vllm_connector.py --pairs 40 # the throughput headline's 90% interval about +-1.5%
    python bench/vllm_connector.py --pairs 120   # the headline protocol: repeat it; runs differ more
                                                 # than one run's interval says (fresh engines each),
                                                 # so pool runs resampling runs first (bench/README)
    python bench/vllm_connector.py --hidden 1024 --layers 12 --heads 16 --kv-heads 4   # a larger Llama

Why ``--engine-threads 1`` by default: vLLM's CPU worker keeps one OpenMP thread per core; on a
shared machine whose other processes hold the cores, each parallel region then waits for a
descheduled thread and an engine's speed depends on how its threads happen to be scheduled
(one engine ran 10x slower than its twin here, whichever had the connector or not).

The last line is the headline.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from models import random_llama_dir
from vllm_connector_parts import BLOCK_SIZE, Server, copy_rates, thread_cpu, throughput, tokens, wait_saved

PREFIX_TOKENS = 2000
SUFFIX_TOKENS = 32
THROUGHPUT_REQUESTS = 16  # per run, 8 at a time: 2 rounds of prompts arriving together
SETTLE_S = 1.5  # vLLM's shm queue readers busy-poll 1 s after their last message (SpinCondition)


def cache_call_ms(address: str, token: str, prompt: list[int], repeats: int = 5) -> float:
    """Median ms of the call an engine that saves makes for an arriving prompt: Allocate of it
    (its hit pinned, fresh pool blocks for the rest; freed again)."""
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(address, token, timeout_s=10)
    client.attach("bench-lookup")
    allocates = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            seq = client.allocate([prompt])[0]
            allocates.append(time.perf_counter() - start)
            client.free([seq.sequence_id])
    finally:
        client.close()
    return statistics.median(allocates) * 1e3


def default_pool_blocks(kv_token_bytes: int) -> int:
    """The cache service's pool without --num-blocks: 512 MiB of blocks, 512 to 4,096 of them."""
    return max(512, min(4096, (512 << 20) // (kv_token_bytes * BLOCK_SIZE)))


def measure_ttft(a: Server, b: Server, stack, token: str, rounds: int) -> dict[str, float]:
    loaded, recomputed, local = [], [], []
    for rnd in range(rounds):
        prefix = tokens(10 + rnd, PREFIX_TOKENS)
        a.ttft(prefix + tokens(20 + rnd, SUFFIX_TOKENS))
        wait_saved(stack.cache_address, token, prefix)
        time.sleep(SETTLE_S)
        turns = [("loaded", prefix), ("recomputed", tokens(40 + rnd, PREFIX_TOKENS))]
        for name, head in turns if rnd % 2 == 0 else turns[::-1]:
            (loaded if name == "loaded" else recomputed).append(
                b.ttft(head + tokens(30 + rnd, SUFFIX_TOKENS))
            )
        local.append(b.ttft(prefix + tokens(50 + rnd, SUFFIX_TOKENS)))  # B's own prefix cache now holds it
        print(f"round {rnd}: TTFT loaded {loaded[-1] * 1e3:.0f} ms, recomputed {recomputed[-1] * 1e3:.0f} ms, "
              f"vLLM's own prefix cache {local[-1] * 1e3:.0f} ms (load average {os.getloadavg()[0]:.1f})",
              flush=True)  # fmt: skip
    held = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    tail = PREFIX_TOKENS + SUFFIX_TOKENS - held
    allocate_ms = cache_call_ms(
        stack.cache_address, token, tokens(10, PREFIX_TOKENS) + tokens(70, SUFFIX_TOKENS)
    )
    step_ms = statistics.median(b.ttft(tokens(60 + i, tail)) for i in range(rounds)) * 1e3
    return {
        "ratios": sorted(x / y for x, y in zip(loaded, recomputed, strict=True)),
        "local_ms": statistics.median(local) * 1e3,
        "loaded_ms": statistics.median(loaded) * 1e3,
        "recomputed_ms": statistics.median(recomputed) * 1e3,
        "allocate_ms": allocate_ms,
        "tail_step_ms": step_ms,
        "hit_blocks": held // BLOCK_SIZE,
        "tail_tokens": tail,
    }


PHASES = ("pool filling", "host tier filling", "every tier full")


def tier_phase(address: str, token: str) -> str:
    """Where B's saves stand in the cache service (GetStats): the pool not yet evicting, the host tier
    not yet evicting (filling fresh memory: its pages are mapped as first used), or every tier
    evicting (a cache without a host tier is full once its pool evicts)."""
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(address, token, timeout_s=10)
    try:
        stats = client.get_stats()
    finally:
        client.close()
    if stats.num_evictions == 0:
        return PHASES[0]
    hosts = [t for t in stats.tiers if t.medium == "host"]
    return PHASES[2] if not hosts or any(t.num_evictions for t in hosts) else PHASES[1]


def measure_throughput(b: Server, c: Server, pairs: int, requests: int, phase) -> list[tuple[float, str]]:
    """B's (the connector's) generated tok/s over C's (without it) in each of `pairs` back-to-back
    pairs of runs (B C, then C B, ...), each after the other engine's busy-poll has ended: the
    machine's load moves between pairs far more than within one. Each pair with the cache's
    ``phase()`` after it."""
    ratios = []
    for rnd in range(pairs):
        rate = {}
        for server in (b, c) if rnd % 2 == 0 else (c, b):
            time.sleep(SETTLE_S)
            rate[server.name] = throughput(server, 100 + rnd, requests)
        ratios.append((rate["B"] / rate["C"], phase()))
        print(f"throughput pair {rnd}, no reuse: with the connector {rate['B']:.0f} tok/s, without {rate['C']:.0f} "
              f"tok/s: {ratios[-1][0]:.3f} (load average {os.getloadavg()[0]:.1f}; {ratios[-1][1]})", flush=True)  # fmt: skip
    return ratios


ROLES = {
    "C": None,
    "N": "null",
    "B": "kv_both",
    "P": "kv_producer",
    "Q": "kv_consumer",
}
ROLE_NAMES = {"C": "without", "N": "a connector that does nothing", "B": "both", "P": "saves only",
              "Q": "lookups only"}  # fmt: skip


def measure_attribution(servers: dict[str, Server], cache_pid: int, rounds: int, requests: int) -> None:
    """Each part of the connector's cost alone: the no-reuse workload on C (no connector), N (a
    connector that does nothing: vLLM's hooks alone), B (both sides), P (kv_producer: saves, no
    loads) and Q (kv_consumer: lookups, no saves), in
    a rotated order each round; per engine its tok/s over C's in the same round and the CPU seconds
    per request of its processes' threads and of the cache service."""
    ratios: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, dict[str, float]] = {name: {} for name in servers}
    order = list(servers)
    for rnd in range(rounds):
        rate = {}
        for i in range(len(order)):
            name = order[(rnd + i) % len(order)]
            server = servers[name]
            time.sleep(SETTLE_S)
            before = thread_cpu([server.proc.pid]), thread_cpu([cache_pid])
            rate[name] = throughput(server, 1000 + 10 * rnd + i, requests)
            after = thread_cpu([server.proc.pid]), thread_cpu([cache_pid])
            for side, b, a in (("", before[0], after[0]), ("cache/", before[1], after[1])):
                for key, seconds in a.items():
                    cpu[name][side + key] = cpu[name].get(side + key, 0.0) + seconds - b.get(key, 0.0)
        for name in servers:
            ratios[name].append(rate[name] / rate["C"])
        print(f"round {rnd}: " + ", ".join(f"{n} {rate[n]:.0f} tok/s ({rate[n] / rate['C']:.3f})" for n in servers)
              + f" (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    runs = rounds * requests
    for name in servers:
        per_request = {k: v / runs * 1e3 for k, v in cpu[name].items()}
        total = sum(per_request.values())
        top = sorted(per_request.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{k} {v:.1f}" for k, v in top if v >= 0.05)
        print(
            f"{name} ({ROLE_NAMES[name]}): {spread(ratios[name])} of C; CPU ms per request {total:.1f}: {parts}"
        )


def spread(ratios: list[float]) -> str:
    """The median of per-round ratios, their range and, from 8 rounds up, a 90% bootstrap interval of
    the median (the rounds resampled 2,000 times): whether a target is shown, not only reached."""
    text = f"{statistics.median(ratios):.3f}x [{min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds"
    if len(ratios) >= 8:
        rng = random.Random(0)
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        text += f"; median's 90% interval {medians[100]:.3f}-{medians[1899]:.3f}"
    return text + "]"


def cold_text(rates: dict[str, float]) -> str:
    """The headline's words for the saves into untouched pool blocks (CPU only)."""
    if "cold_save_gbs" not in rates:
        return ""
    return (
        f" (into untouched pool blocks {rates['cold_save_gbs']:.2f} vs {rates['cold_memcpy_gbs']:.2f} GB/s)"
    )


def report(args, ttft: dict[str, float], pairs: list[tuple[float, str]], rates: dict[str, float]) -> None:
    """Where the loaded TTFT goes, the throughput pairs by the cache's phase, then the headline."""
    ttft_ratios = ttft["ratios"]
    ratios = [ratio for ratio, _ in pairs]
    for name in PHASES:
        part = [ratio for ratio, phase in pairs if phase == name]
        if part:
            print(f"no-reuse throughput with/without the connector, {name}: {spread(part)}")
    other = ttft["loaded_ms"] - ttft["allocate_ms"] - rates["load_ms"] - ttft["tail_step_ms"]
    print(f"loaded TTFT {ttft['loaded_ms']:.0f} ms = Allocate (the hit pinned, room for the rest) "
          f"{ttft['allocate_ms']:.1f} ms + copy of {ttft['hit_blocks']} blocks {rates['load_ms']:.1f} ms + one step "
          f"computing the {ttft['tail_tokens']}-token tail {ttft['tail_step_ms']:.0f} ms + the rest (scheduling, "
          f"HTTP of a 2,000-token prompt) {other:.0f} ms; recompute {ttft['recomputed_ms']:.0f} ms; vLLM's own "
          f"prefix cache holding the prefix (the floor for any KV cache) {ttft['local_ms']:.0f} ms")  # fmt: skip
    model_name = f"hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, float32"
    print(
        f"vLLM + kvtier ({model_name}, {args.engine_threads} thread(s) per engine): TTFT with A's 2,000-token "
        f"prefix loaded {spread(ttft_ratios)} recompute (<= 0.3); no-reuse throughput with/without the connector "
        f"{spread(ratios) if ratios else 'not measured'} (>= 0.95); loads {rates['load_gbs']:.2f} GB/s, saves "
        f"{rates['save_gbs']:.2f} GB/s vs a plain copy {rates['memcpy_gbs']:.2f} GB/s{cold_text(rates)}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 TTFT rounds, 4 throughput pairs")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--engine-threads", type=int, default=1, help="OpenMP threads of each vLLM engine")
    ap.add_argument("--skip-throughput", action="store_true", help="TTFT and copies only")
    ap.add_argument("--pairs", type=int, help="throughput pairs (default 10, 4 with --quick; the headline's "
                    "interval narrows with more: a pair's ratio varies by about 6%% on a shared 2-core machine)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=THROUGHPUT_REQUESTS,
                    help="no-reuse requests per throughput run (more: longer runs, less noise; the pool fills sooner)")  # fmt: skip
    ap.add_argument("--copies-only", action="store_true",
                    help="the copy rates only (no engine: runs without vLLM, as on a GPU machine without its build)")  # fmt: skip
    ap.add_argument("--attribute", action="store_true",
                    help="no TTFT: the no-reuse throughput of C, B, and the connector's saves or lookups alone")  # fmt: skip
    ap.add_argument("--num-blocks", type=int, help="the cache service's pool blocks (default: 512 MiB of them, "
                    "4,096 for the default model: the pool fills at about pair 12)")  # fmt: skip
    ap.add_argument("--host-cache-gib", type=float, help="the cache service's host tier (default: its own, auto-sized; "
                    "smaller: every tier is full, and evicting, in fewer pairs)")  # fmt: skip
    ap.add_argument("--log-dir", type=Path, help="keep the engines' and the cache service's logs here")
    return ap.parse_args()


def main() -> int:
    args = arguments()
    rounds, pairs = (3, args.pairs or 4) if args.quick else (5, args.pairs or 10)
    import torch

    from kvtier.cli.stack import LocalStack

    gpu = torch.cuda.is_available()
    torch.set_num_threads(args.engine_threads)  # the copies run on the threads the engines' copies get
    head_dim = args.hidden // args.heads
    kv_token_bytes = args.layers * 2 * args.kv_heads * head_dim * 4
    hit_blocks = PREFIX_TOKENS // BLOCK_SIZE
    pool_blocks = args.num_blocks or default_pool_blocks(kv_token_bytes)
    rates = copy_rates(args.layers, args.kv_heads, head_dim, "cuda" if gpu else "cpu", blocks=hit_blocks,
                       pool_blocks=pool_blocks)  # fmt: skip
    print(f"copies of {hit_blocks} blocks (float32 on {'cuda' if gpu else 'cpu'}, vLLM's layout {rates['layout']}): "
          f"load {rates['load_gbs']:.2f} GB/s ({rates['load_ms']:.1f} ms), save {rates['save_gbs']:.2f} GB/s "
          f"({rates['save_ms']:.1f} ms, in vLLM's step), "
          f"plain copy {rates['memcpy_gbs']:.2f} GB/s (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    if "cold_save_gbs" in rates:
        print(f"saves as the engine makes them, into pool blocks no copy has touched ({pool_blocks} blocks of shared "
              f"memory): {rates['cold_save_gbs']:.2f} GB/s, a plain copy into such blocks {rates['cold_memcpy_gbs']:.2f} "
              f"GB/s", flush=True)  # fmt: skip
    if args.copies_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        run_dir = Path(tmp)
        os.chmod(run_dir, 0o700)
        model = random_llama_dir(run_dir / "model", hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=args.heads, num_kv_heads=args.kv_heads, max_positions=4096)  # fmt: skip
        token = "bench-token-0123456789"
        env = {**os.environ, "KVTIER_RUN_DIR": str(run_dir), "KVTIER_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.engine_threads),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        num_blocks = pool_blocks
        cache_args = ["--model", str(model), "--block-size", str(BLOCK_SIZE), "--kv-cache-dtype", "float32",
                      "--num-blocks", str(num_blocks), "--compute-replicas", "0"]  # fmt: skip
        if args.host_cache_gib is not None:
            cache_args += ["--host-cache-gib", str(args.host_cache_gib)]
        stack = LocalStack(run_dir, cache_args=cache_args, num_replicas=0, env=env)
        stack.start_cache()
        names = ROLES if args.attribute else {"A": "kv_both", "B": "kv_both", "C": None}
        servers = {n: Server(n, model, run_dir, env, role=role, gpu=gpu) for n, role in names.items()}
        try:
            for server in servers.values():
                server.wait()
            for (
                server
            ) in servers.values():  # first requests pay one-time setup (oneDNN primitives): not measured
                server.ttft(tokens(5, PREFIX_TOKENS + SUFFIX_TOKENS))
                throughput(server, 3, 8)
            if args.attribute:
                measure_attribution(servers, stack.cache.proc.pid, 2 * pairs, args.requests)
                return 0
            b, c = servers["B"], servers["C"]
            ttft = measure_ttft(servers["A"], b, stack, token, rounds)
            phase = functools.partial(tier_phase, stack.cache_address, token)
            measured = [] if args.skip_throughput else measure_throughput(b, c, pairs, args.requests, phase)
        finally:
            for server in servers.values():
                server.stop()
                if args.attribute:  # the connector's own counts, logged as it shut down
                    for line in server.log.read_text(errors="replace").splitlines():
                        if "kvtier scheduler:" in line or "kvtier worker:" in line:
                            print(f"{server.name}: {line.split('] ', 1)[-1]}")
            stack.down()
            if args.log_dir is not None:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                for log in run_dir.glob("*.log"):
                    shutil.copy(log, args.log_dir)
    report(args, ttft, measured, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
