"""kvtier's stack against vLLM's CPU engine on the same machine, model and token ids (issue 35).

The model is the serving benchmark's 27M seeded-random Llama (hidden 512, 8 layers, 8 heads, 2 KV
heads, intermediate 1408, vocabulary 4096, float32; bench/http_api.py's), written once to a
temporary directory that both systems load. Both run greedy with EOS ignored, prefix caching on,
block size 32, every request of a pass sent at once:

  shared-prefix  64 requests: 8 shared 512-token system prompts + a 32-token question, 64 new tokens
  unique         64 unique 512-token prompts, 64 new tokens
  decode         16 prompts of 64 tokens, 256 new tokens (decode-heavy)

Systems: kvtier = the local stack as `kvtier up` lays it out by default (kvtier.cpu_plan: replicas,
threads, allocator preload; cache service and replicas are real processes) driven over gRPC
(ComputeClient); vLLM = its offline `LLM.generate` in a child process, in its best configuration
here (every CPU in one engine, tcmalloc + Intel OpenMP preloaded: bench/vllm_engine.py).
`LLM.generate` returns whole completions (vLLM's RequestOutputKind.FINAL_ONLY), so kvtier is asked
for them the same way: `final_only` requests, one reply each when it finishes, what a user who
wants whole completions asks for (OpenAI's `stream: false`); `--streamed` asks for a message per
token instead. Each pass has its own cache_salt on both (a cold prefix cache, shared within the
pass). Warm-up passes are not measured. Rounds run ABBA (kvtier, vLLM, vLLM, kvtier, ...), each
pass once the other system is quiet (`settle`: vLLM's worker spins for a second after its last
step); each system's figure is the median of its passes. Greedy parity: the first --check requests of every measured pass must
equal vLLM's tokens of the same workload. Per pass: output tok/s, output tokens per CPU-second of
the system's processes (kvtier: cache service, replicas and this client; vLLM: its process tree;
over HTTP both count this client), the 1-minute load average (the machine may be shared), the
CPU the other system used while it waited, and the CPU of every other process on the machine.

Then the HTTP front doors on shared-prefix: kvtier's gateway against vLLM's OpenAI server
(`python -m vllm.entrypoints.openai.api_server`), streamed /v1/completions with token-id prompts
on both sides.

    python bench/serve_vs_vllm.py              # 2 rounds ABBA + HTTP (~10 min on 2 cores)
    python bench/serve_vs_vllm.py --quick      # smaller workloads, 1 round, no HTTP
    python bench/serve_vs_vllm.py --replicas 2 --threads 1   # another kvtier layout
    python bench/serve_vs_vllm.py --workloads decode         # one workload alone, to iterate
    python bench/serve_vs_vllm.py --streamed                 # kvtier streams every token over gRPC

Targets (issue 35): shared-prefix >= 1.0x, unique >= 0.8x, decode >= 1.0x. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

TOKEN = "bench-vs-vllm-token"
TARGETS = {"shared-prefix": 1.0, "unique": 0.8, "decode": 1.0}


@dataclass(frozen=True)
class Workload:
    num_requests: int
    num_systems: int  # shared system prompts; 0: every prompt unique
    prompt_tokens: int  # the system prompt's length, or the whole prompt's when unique
    question_tokens: int
    max_tokens: int

    def prompts(self, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(256) for _ in range(n)]

        if not self.num_systems:
            return [tokens(self.prompt_tokens) for _ in range(self.num_requests)]
        systems = [tokens(self.prompt_tokens) for _ in range(self.num_systems)]
        return [
            systems[i % self.num_systems] + tokens(self.question_tokens) for i in range(self.num_requests)
        ]


FULL = {
    "shared-prefix": Workload(64, 8, 512, 32, 64),
    "unique": Workload(64, 0, 512, 0, 64),
    "decode": Workload(16, 0, 64, 0, 256),
}
QUICK = {
    "shared-prefix": Workload(16, 4, 256, 16, 16),
    "unique": Workload(16, 0, 256, 0, 16),
    "decode": Workload(8, 0, 32, 0, 64),
}


def tree_cpu_seconds(pids: list[int], client: bool = False) -> float:
    """CPU seconds used so far by these processes and all their descendants, plus this process's
    own (not its children's: the stack and vLLM are those) when `client`."""
    own = psutil.Process().cpu_times()
    total = own.user + own.system if client else 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


class KvtierGrpc:
    """kvtier's replicas behind ComputeClient: all of a pass's requests at once, each answered
    whole (`final_only`) or streamed a message per token."""

    name = "kvtier"
    client = True  # this process receives the replies: its CPU counts

    def __init__(self, stack, final_only: bool = True):
        from kvtier.compute_client import ComputeClient

        self.stack, self.final_only = stack, final_only
        self.compute = ComputeClient(stack.compute_addresses, TOKEN)

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in [self.stack.cache, *self.stack.replicas]]

    async def one(self, prompt: list[int], max_tokens: int, salt: str) -> list[int]:
        request = self.compute.request(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            cache_salt=salt,
            final_only=self.final_only,
        )
        tokens: list[int] = []
        async for reply in self.compute.stream(request):
            tokens += reply.token_ids
        return tokens

    async def generate(self, prompts, max_tokens: int, salt: str) -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.one(p, max_tokens, salt) for p in prompts))
        return list(outs), time.perf_counter() - t0


class OfflineSystem:
    """vLLM's offline engine (bench/vllm_engine.py), awaited from a thread."""

    name = "vllm"
    client = False  # `generate` runs in vLLM's own process

    def __init__(self, engine):
        self.engine = engine

    @property
    def pids(self) -> list[int]:
        return [self.engine.pid]

    async def generate(self, prompts, max_tokens: int, salt: str) -> tuple[list[list[int]], float]:
        return await asyncio.to_thread(self.engine.generate, prompts, max_tokens, salt)


class HttpSystem:
    """An OpenAI /v1/completions server (kvtier's gateway or vLLM's), streamed with aiohttp."""

    client = True

    def __init__(self, name: str, url: str, pids: list[int], model: str | None = None):
        self.name, self.url, self.pids, self.model = name, url, pids, model
        self.http = None

    async def one(self, prompt: list[int], max_tokens: int, salt: str) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body.update(cache_salt=salt, stream=True, stream_options={"include_usage": True})
        if self.model:
            body["model"] = self.model
        count = 0
        async with self.http.post(f"{self.url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {reply.status}: {(await reply.read())[:300]!r}")
            async for line in reply.content:  # parse only the usage chunk: the client shares the CPUs
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    count = json.loads(line[6:])["usage"]["completion_tokens"]
        return [0] * count  # token ids are not compared over HTTP (the gRPC passes check parity)

    async def generate(self, prompts, max_tokens: int, salt: str) -> tuple[list[list[int]], float]:
        import aiohttp

        if self.http is None:
            self.http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=len(prompts) + 8),
                timeout=aiohttp.ClientTimeout(total=900),
            )
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.one(p, max_tokens, salt) for p in prompts))
        return list(outs), time.perf_counter() - t0

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()


def busy_cpu_seconds() -> float:
    """CPU seconds the machine's processes have used (user, nice, system, interrupts)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


async def settle(system, timeout_s: float = 10.0, window_s: float = 0.25, quiet: float = 0.05) -> float:
    """Wait until `system`'s processes use under `quiet` of a CPU (over `window_s`), at most
    `timeout_s`; the seconds waited. NOTE: vLLM's worker busy-polls its shared-memory queue for
    a second after its last step (vllm's SpinCondition, busy_loop_s = 1); without the wait that
    second lands in the other system's next pass (~1 CPU-s of a kvtier decode pass, ~10% of it),
    which no user running one system sees. kvtier's processes are quiet between passes anyway."""
    t0 = time.perf_counter()
    cpu = tree_cpu_seconds(system.pids)
    while time.perf_counter() - t0 < timeout_s:
        await asyncio.sleep(window_s)
        cpu, last = tree_cpu_seconds(system.pids), cpu
        if cpu - last < quiet * window_s:
            break
    return time.perf_counter() - t0


async def measure_pass(system, work: Workload, prompts, salt: str, idle) -> dict:
    """One measured pass of `system`; `idle`, the other system (waiting), whose CPU use is recorded."""
    load0, cpu0 = os.getloadavg()[0], tree_cpu_seconds(system.pids, system.client)
    idle0, box0 = tree_cpu_seconds(idle.pids), busy_cpu_seconds()
    outs, seconds = await system.generate(prompts, work.max_tokens, salt)
    cpu = tree_cpu_seconds(system.pids, system.client) - cpu0
    idle_cpu = tree_cpu_seconds(idle.pids) - idle0
    tokens = sum(len(o) for o in outs)
    return {
        "tok_s": tokens / seconds,
        "tok_per_cpu_s": tokens / cpu if cpu > 0 else float("nan"),
        "seconds": seconds,
        "tokens": tokens,
        "load": (load0 + os.getloadavg()[0]) / 2,
        "idle_cpu_s": idle_cpu,
        "others_cpu_s": max(0.0, busy_cpu_seconds() - box0 - cpu - idle_cpu),
        "outs": outs,
    }


async def compare(systems: list, workloads: dict[str, Workload], rounds: int, check: int) -> dict:
    """ABBA passes of `systems` (two) on each workload; median figures and greedy parity."""
    results: dict = {}
    for name, work in workloads.items():
        prompts = work.prompts(seed=list(FULL).index(name))  # the same whichever are run
        for s in systems:  # warm-up, not measured: a few of the workload's own shapes
            await s.generate(prompts[:4], 4, f"warm-{s.name}-{name}")
        passes: dict[str, list[dict]] = {s.name: [] for s in systems}
        for r in range(rounds):
            for s in systems if r % 2 == 0 else systems[::-1]:
                other = systems[1] if s is systems[0] else systems[0]
                waited = await settle(other)
                p = await measure_pass(s, work, prompts, f"{s.name}-{name}-{r}", other)
                passes[s.name].append(p)
                print(
                    f"  {name:>13} round {r} {s.name:>9}: {p['tokens']} tok in {p['seconds']:6.2f} s = "
                    f"{p['tok_s']:7.1f} tok/s, {p['tok_per_cpu_s']:6.1f} tok/CPU-s, load {p['load']:.1f} "
                    f"(idle {other.name}: {p['idle_cpu_s']:.2f} CPU-s, settled in {waited:.1f} s; "
                    f"other processes: {p['others_cpu_s']:.2f} CPU-s)",
                    flush=True,
                )
        a, b = (passes[s.name] for s in systems)
        mismatches = sum(
            pa["outs"][i] != pb["outs"][i]
            for pa in a
            for pb in b[:1]
            for i in range(min(check, len(prompts)))
        )
        results[name] = {
            s.name: {
                key: statistics.median(p[key] for p in passes[s.name])
                for key in ("tok_s", "tok_per_cpu_s", "load")
            }
            for s in systems
        }
        results[name]["ratio"] = (
            results[name][systems[0].name]["tok_s"] / results[name][systems[1].name]["tok_s"]
        )
        results[name]["ratio_per_cpu"] = (
            results[name][systems[0].name]["tok_per_cpu_s"] / results[name][systems[1].name]["tok_per_cpu_s"]
        )
        results[name]["checked"] = min(check, len(prompts)) * len(a)
        results[name]["mismatches"] = mismatches
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtier_stack(run_dir: Path, model: Path, args, gateway: bool):
    """The stack as `kvtier up` lays it out (kvtier.cpu_plan), on a pool the workloads fit."""
    from kvtier.cli.stack import LocalStack
    from kvtier.cpu_plan import plan_cpu

    plan = plan_cpu(args.replicas, args.threads)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(KVTIER_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    stack = LocalStack(
        run_dir,
        [
            *("--model", str(model), "--block-size", "32", "--num-blocks", "4096"),
            *("--swap-space", "0", "--host-cache-gib", "0", "--log-level", "WARNING"),
        ],
        ["--model", str(model), "--threads", str(plan.threads), "--log-level", "WARNING"],
        num_replicas=plan.replicas,
        env=env,
        gateway_args=["--model", str(model), "--log-level", "WARNING"] if gateway else None,
        gateway_port=0,
    )
    return stack, plan


def report(results: dict, http: dict | None) -> int:
    print("\n| workload | kvtier tok/s | vLLM tok/s | ratio | per CPU-s ratio | load | parity |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        k, v = r["kvtier"], r["vllm"]
        print(
            f"| {name} | {k['tok_s']:.0f} | {v['tok_s']:.0f} | {r['ratio']:.2f}x | {r['ratio_per_cpu']:.2f}x | "
            f"{(k['load'] + v['load']) / 2:.1f} | {r['checked'] - r['mismatches']}/{r['checked']} equal |"
        )
    if http:
        r = http["shared-prefix"]
        print(
            f"\nHTTP, shared-prefix: kvtier gateway {r['kvtier-http']['tok_s']:.0f} tok/s, vLLM server "
            f"{r['vllm-http']['tok_s']:.0f} tok/s = {r['ratio']:.2f}x (per CPU-s {r['ratio_per_cpu']:.2f}x)"
        )
    met = [results[n]["ratio"] >= t for n, t in TARGETS.items() if n in results]
    parity = all(r["mismatches"] == 0 for r in results.values())
    parts = ", ".join(f"{n} {r['ratio']:.2f}x (target {TARGETS[n]:.1f})" for n, r in results.items())
    print(
        f"\nHEADLINE: kvtier / vLLM CPU engine tok/s: {parts}; greedy parity "
        f"{'held' if parity else 'FAILED'}; {sum(met)}/{len(met)} targets met"
    )
    return 0 if parity and all(met) else 1


async def run(args, model: Path, tmp: Path) -> tuple[dict, dict | None]:
    from vllm_engine import OfflineVllm, VllmHttpServer

    workloads = {n: w for n, w in (QUICK if args.quick else FULL).items() if n in args.workloads}
    over_http = "http" in args.workloads and not args.quick
    stack, plan = kvtier_stack(tmp / "run", model, args, gateway=over_http)
    print(f"kvtier layout: {plan.describe()}", flush=True)
    engine = OfflineVllm(model, threads=args.vllm_threads)
    await asyncio.to_thread(engine.start)
    await asyncio.to_thread(stack.up)
    kv = KvtierGrpc(stack, final_only=not args.streamed)
    try:
        results = await compare([kv, OfflineSystem(engine)], workloads, args.rounds, args.check)
    finally:
        await asyncio.to_thread(engine.stop)
    http = None
    try:
        if over_http:
            server = VllmHttpServer(model, args.vllm_threads, free_port(), tmp / "vllm-http.log")
            await asyncio.to_thread(server.start)
            gw = HttpSystem("kvtier-http", stack.gateway.address, [stack.gateway.proc.pid, *kv.pids])
            vs = HttpSystem("vllm-http", server.url, [server.pid], model=str(model))
            vs.client = True
            try:
                http = await compare([gw, vs], {"shared-prefix": FULL["shared-prefix"]}, args.rounds, 0)
            finally:
                await gw.close()
                await vs.close()
                await asyncio.to_thread(server.stop)
    finally:
        await kv.compute.close()
        await asyncio.to_thread(stack.down)
    return results, http


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller workloads, no HTTP comparison")
    ap.add_argument("--rounds", type=int, default=2, help="passes of each system per workload (ABBA order)")
    ap.add_argument("--check", type=int, default=8, help="requests per pass whose tokens must equal vLLM's")
    ap.add_argument("--replicas", type=int, help="kvtier replicas (default: kvtier up's choice)")
    ap.add_argument("--threads", type=int, help="torch threads per kvtier replica (default: kvtier up's)")
    ap.add_argument("--vllm-threads", type=int, default=os.cpu_count() or 1, help="vLLM's OpenMP threads")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--streamed",
        action="store_true",
        help="kvtier's gRPC passes stream a message per token (default: whole completions)",
    )
    ap.add_argument(
        "--workloads",
        type=lambda text: text.split(","),
        default=[*FULL, "http"],
        help=f"which to run, comma-separated (default: all: {','.join([*FULL, 'http'])}; http = shared-prefix over HTTP)",
    )
    args = ap.parse_args()
    if unknown := set(args.workloads) - {*FULL, "http"}:
        ap.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    from http_api import make_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vs-vllm-"))
    try:  # the model directory (~100 MB), the stack's run directory and vLLM's server log
        model, params = make_model_dir(tmp / "model")
        print(
            f"model: random Llama, {params / 1e6:.1f}M params, fp32; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        results, http = asyncio.run(run(args, model, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    strip = {n: {k: v for k, v in r.items() if k != "outs"} for n, r in results.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"results": strip, "http": http}, indent=2))
    return report(results, http)


if __name__ == "__main__":
    sys.exit(main())
