"""The cache service's CPU per saved request, for the vLLM connector's call pattern (issue 33).

A real cache service (cpu-shm pool, the connector bench's geometry: bench/models.py's random
Llama with hidden 256, 4 layers, 4 heads, 2 KV heads; float32, block size 32, 4,096 blocks of
128 KiB; a 1 GiB host cache) and this process as its one client, calling as the connector does
per engine: an Allocate of 8 unique 512-token prompts (no hit: 16 new blocks each, a request id
each), then one Free of those 8 carrying their commits (CommitItem(seq, [], 512): 16 blocks
published each). Round after round, back to back; heartbeats from a thread.

The service's CPU (utime + stime of all its threads from /proc/<pid>/stat, and the nanosecond
run times of /proc/<pid>/task/*/schedstat: all live threads, and its main thread, the event loop)
per saved request, in three phases; the headline takes stat (a thread that ended, such as the one
mapping the host tier's pages ahead, kvtier-map, is in stat only) and the main thread:
  not full   the pool's first pass (the rounds that find free blocks: 30 of 32)
  full       every Allocate evicts 128 published blocks to the host tier, whose memory is
             still being reached for the first time (as in bench/vllm_connector.py's runs)
  host full  the same once the host tier has wrapped too (a long-running service)
Baseline in the same run: the service's CPU per gRPC health Check on the same socket (the
transport's floor: a unary call through the same guard that runs none of the service's code),
so the figures say what the service adds above it. The client's own CPU per saved request (this
process: what the connector pays in vLLM's) is printed beside them. Each phase ends once the
service is idle again (what its calls left to do is theirs). Each run starts a fresh service;
--runs N takes medians. --follower adds a process reading WatchEventBatches from the first event
without token ids, as a vLLM engine's block_index does (its CPU per saved request printed too):
the service then streams every block event, the ones ready a message, as runs of hashes
(hashes_only); --stream events reads them as CacheEvent messages instead (WatchEventBatches
without hashes_only, as the block index did before 2026-12-05), --stream per-event reads
WatchEvents (one gRPC message an event).

    python bench/cache_cpu.py                 # 3 runs (~1 min)
    python bench/cache_cpu.py --quick         # 1 run
    python bench/cache_cpu.py --follower      # with a block-index follower
    python bench/cache_cpu.py --follower --stream events     # the same on CacheEvent batches
    python bench/cache_cpu.py --profile DIR   # also py-spy the service in each phase (speedscope)

The last line is the headline.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from models import random_llama_dir

BLOCK_SIZE = 32
PROMPT_TOKENS = 512  # 16 blocks
BATCH = 8  # prompts per Allocate, sequences per Free
PER_ROUND = BATCH * PROMPT_TOKENS // BLOCK_SIZE  # blocks per round
BLOCK_BYTES = 4 * 2 * 2 * 64 * 4 * BLOCK_SIZE  # layers x (K, V) x KV heads x head dim x float32 x tokens
HOST_CACHE_GIB = 1  # 8,192 blocks: wraps after 64 rounds with the pool full
HEALTH_CALLS = 2000
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PHASES = ("not full", "full", "host full")


def cpu(pid: int) -> np.ndarray:
    """[utime + stime from /proc/<pid>/stat, the sum of its live threads' schedstat run times, its
    main thread's] in seconds, and its minor page faults."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    ns = main_ns = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                run_ns = int(f.read().split()[0])
        except OSError:
            continue  # a thread that ended
        ns += run_ns
        main_ns += run_ns if task == str(pid) else 0
    return np.array([ticks * TICK_S, ns / 1e9, main_ns / 1e9, int(fields[7])])  # minflt (field 10)


class Meter:
    """The service's and this process's CPU over a span of `calls` calls (or saved requests)."""

    def __init__(self, pid: int, calls: int, follower: int | None = None):
        self.pid, self.calls, self.follower = pid, calls, follower

    def __enter__(self) -> Meter:
        self.service0, self.client0 = cpu(self.pid), time.process_time()
        self.follower0 = cpu(self.follower)[1] if self.follower else 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.service = cpu(self.pid) - self.service0
        self.client_s = time.process_time() - self.client0
        self.follower_s = cpu(self.follower)[1] - self.follower0 if self.follower else 0.0

    def per_call_ms(self) -> dict[str, float]:
        """CPU ms per call: stat, schedstat, main (thread), client, follower; faults per call."""
        stat, sched, main, faults = self.service / self.calls
        return {"stat": stat * 1e3, "sched": sched * 1e3, "main": main * 1e3, "client": self.client_s * 1e3 / self.calls,
                "follower": self.follower_s * 1e3 / self.calls, "faults": faults}  # fmt: skip


def health_floor(address: str, pid: int, calls: int) -> Meter:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier.auth import grpc_target

    channel = grpc.insecure_channel(grpc_target(address))
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    for _ in range(100):  # the channel's first calls set it up
        stub.Check(request)
    with Meter(pid, calls) as m:
        for _ in range(calls):
            stub.Check(request)
    channel.close()
    return m


def prompts(rng: np.random.Generator, rounds: int) -> list:
    """The AllocateItems of `rounds` rounds: 8 unique prompts each, a request id each."""
    from kvtier.sequence_types import AllocateItem

    out = []
    for _ in range(rounds):
        batch = rng.integers(0, 250, size=(BATCH, PROMPT_TOKENS)).tolist()
        out.append([AllocateItem(p, request_id=f"req-{rng.integers(1 << 62)}") for p in batch])
    return out


def save_rounds(client, batches: list) -> None:
    """The connector's pattern per batch of AllocateItems: Allocate them, Free them with their commits."""
    from kvtier.sequence_types import CommitItem

    for items in batches:
        ids = [s.sequence_id for s in client.allocate(items)]
        client.free(ids, [CommitItem(sid, [], PROMPT_TOKENS) for sid in ids])


def follow(address: str, token: str, ready, kind: str = "runs") -> None:
    """A block-index follower (kvtier/vllm/block_index.py's loop, ``apply_held``, ``apply_runs``):
    the blocks held when it opens, then every event after, a batch of hash runs per message
    (``kind`` "events": CacheEvent batches without token ids, ``apply_events``; "per-event":
    WatchEvents from the first kept event, a message per event); a stream that ends (the follower
    fell behind the log) is opened again."""
    from kvtier.cache_client import CacheClient
    from kvtier.cache_errors import CacheCallError
    from kvtier.sequence_types import HeldBatch, RunBatch
    from kvtier.vllm.block_index import apply_events, apply_held, apply_runs

    client = CacheClient.connect(address, token)
    while True:
        if kind == "per-event":
            stream = (([event], False) for event in client.watch_events(since_event_id=0))
        else:
            stream = client.watch_event_batches(
                omit_token_ids=True, start_with_held=True, hashes_only=kind == "runs"
            )
        ready.set()
        held: dict[str, set[bytes]] = {}
        try:
            for batch in stream:
                if isinstance(batch, HeldBatch):  # the blocks held when it opened
                    apply_held(held, batch)
                elif isinstance(batch, RunBatch):
                    apply_runs(held, batch.runs)
                else:
                    apply_events(held, batch[0])
        except CacheCallError as e:
            print(f"follower: the stream ended ({e.code}); reopening", file=sys.stderr)


def follower_note(args) -> str:
    if not args.follower:
        return ""
    return f" (a follower on: {STREAMS[args.stream]})"


STREAMS = {
    "runs": "WatchEventBatches, hashes_only",
    "events": "WatchEventBatches of CacheEvents",
    "per-event": "WatchEvents, a message an event",
}


def start_follower(address: str, token: str, kind: str) -> mp.Process:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=follow, args=(address, token, ready, kind), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise TimeoutError("the event follower did not start")
    return proc


def py_spy(pid: int, out: Path) -> subprocess.Popen:
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen(
        [str(spy), "record", "--pid", str(pid), "--rate", "250", "--format", "speedscope", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def settle(pid: int, idle_s: float = 0.002, period_s: float = 0.05, deadline_s: float = 30.0) -> None:
    """Wait until the service is idle (under `idle_s` of CPU in `period_s`): what a phase's calls
    left it to do (streaming their events to a follower) is counted in that phase."""
    deadline = time.monotonic() + deadline_s
    before = cpu(pid)[1]
    while time.monotonic() < deadline:
        time.sleep(period_s)
        now = cpu(pid)[1]
        if now - before < idle_s:
            return
        before = now


def measured(client, pid: int, batches: list, profile: Path | None, follower: int | None) -> Meter:
    """`save_rounds` of `batches` (made beforehand: not the client's cost), metered and profiled."""
    spy = py_spy(pid, profile) if profile else None
    settle(pid)
    with Meter(pid, len(batches) * BATCH, follower) as m:
        save_rounds(client, batches)
        settle(pid)
    if spy is not None:
        spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
        spy.wait(timeout=60)
    return m


def one_run(model: Path, run_dir: Path, args: argparse.Namespace, seed: int) -> dict:
    from kvtier.cache_client import CacheClient
    from kvtier.cli.stack import LocalStack

    token = "bench-token-0123456789"
    env = {**os.environ, "KVTIER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    cache_args = ["--model", str(model), "--block-size", str(BLOCK_SIZE), "--kv-cache-dtype", "float32",
                  "--num-blocks", str(args.num_blocks), "--host-cache-gib", str(HOST_CACHE_GIB),
                  "--compute-replicas", "0"]  # fmt: skip
    stack = LocalStack(run_dir, cache_args=cache_args, num_replicas=0, env=env)
    stack.start_cache()
    pid = stack.cache.proc.pid
    client = CacheClient.connect(stack.cache_address, token)
    rng = np.random.default_rng(seed)
    host_slots = (HOST_CACHE_GIB << 30) // BLOCK_BYTES
    fill = args.num_blocks // PER_ROUND - 2  # rounds that find free blocks (2 to spare: warm-up)
    # Full, the host tier still being filled; then enough rounds to wrap it.
    full = min(args.rounds, host_slots // PER_ROUND - 4)
    wrap = host_slots // PER_ROUND - full + 2
    profile = (
        (lambda phase: args.profile / f"{phase.replace(' ', '-')}-{seed}.json") if args.profile else None
    )
    meters = {}
    follower = start_follower(stack.cache_address, token, args.stream) if args.follower else None
    fpid = follower.pid if follower is not None else None
    try:
        client.attach("bench-cache-cpu")
        stop_beat = client.start_heartbeat_thread()
        meters["health"] = health_floor(stack.cache_address, pid, HEALTH_CALLS)
        save_rounds(client, prompts(rng, 1))  # warm-up: first calls of each method
        meters["not full"] = measured(client, pid, prompts(rng, fill), profile and profile("not full"), fpid)
        save_rounds(client, prompts(rng, 3))  # the pool fills: from here every Allocate evicts
        meters["full"] = measured(client, pid, prompts(rng, full), profile and profile("full"), fpid)
        save_rounds(client, prompts(rng, wrap))  # the host tier fills: from here it evicts too
        batches = prompts(rng, args.rounds)
        meters["host full"] = measured(client, pid, batches, profile and profile("host full"), fpid)
        stats = client.get_stats()
        stop_beat.set()
    finally:
        client.close()
        if follower is not None:
            follower.kill()
        stack.down()
    host = next(t for t in stats.tiers if t.medium == "host")
    return {"per_call": {k: m.per_call_ms() for k, m in meters.items()}, "evictions": stats.num_evictions,
            "host_evictions": host.num_evictions, "host_blocks": host.num_blocks}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh services, medians over them")
    ap.add_argument("--rounds", type=int, default=50, help="rounds measured in each phase with the pool full")
    ap.add_argument("--quick", action="store_true", help="1 run")
    ap.add_argument("--profile", type=Path, help="py-spy the service into this folder (speedscope files)")
    ap.add_argument("--follower", action="store_true",
                    help="an event reader follows every event, as a vLLM engine's block_index does")  # fmt: skip
    ap.add_argument("--stream", choices=list(STREAMS), default="runs",
                    help="what the follower reads: hash runs (as the block index), CacheEvent batches, or a message an event")  # fmt: skip
    ap.add_argument("--num-blocks", type=int, default=4096,
                    help="pool blocks (more: a longer phase with the pool not full, e.g. to profile it)")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvtier-cache-cpu-") as tmp:
        model = random_llama_dir(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=4,
                                 num_kv_heads=2, max_positions=4096)  # fmt: skip
        for run in range(args.runs):
            r = one_run(model, Path(tmp) / f"run-{run}", args, run)
            runs.append(r["per_call"])
            h = r["per_call"]["health"]
            phases = "; ".join(
                f"{p} {c['stat']:.3f} / {c['sched']:.3f} / {c['main']:.3f} / {c['client']:.3f}, {c['faults']:.0f} faults"
                + (f", follower {c['follower']:.3f}" if args.follower else "")
                for p, c in ((p, r["per_call"][p]) for p in PHASES)
            )  # fmt: skip
            print(f"run {run}: health Check {h['stat'] * 1e3:.0f} / {h['sched'] * 1e3:.0f} / {h['main'] * 1e3:.0f} µs "
                  f"per call (stat / schedstat / main thread); per saved request, ms (stat / schedstat / main "
                  f"thread / client): {phases}; {r['evictions']} pool and {r['host_evictions']} host evictions "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    med = {p: {k: statistics.median(r[p][k] for r in runs) for k in runs[0][p]} for p in runs[0]}
    calls = 2 / BATCH  # calls per saved request: an Allocate and a Free per BATCH requests
    floor = med["health"]["stat"] * calls
    ours = " / ".join(f"{med[p]['stat'] - floor:.3f}" for p in PHASES)
    print(
        f"headline ({args.runs} runs, medians, /proc/<pid>/stat: threads that ended count too): the cache "
        "service's CPU per saved request is "
        + ", ".join(f"{med[p]['stat']:.3f} ms {p}" for p in PHASES)
        + f"; the transport's floor (health Check {med['health']['stat'] * 1e3:.0f} µs x {calls:.2f} calls) "
        f"is {floor:.3f} ms, so the service adds {ours} ms; its loop (the main thread) "
        + " / ".join(f"{med[p]['main']:.3f}" for p in PHASES)
        + " ms; the client's own CPU "
        + " / ".join(f"{med[p]['client']:.3f}" for p in PHASES)
        + (
            ", the follower's " + " / ".join(f"{med[p]['follower']:.3f}" for p in PHASES)
            if args.follower
            else ""
        )
        + f" ms{follower_note(args)} (load average {os.getloadavg()[0]:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
