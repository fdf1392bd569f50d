"""Separation overhead: decode throughput with the block manager behind gRPC vs in the same process.

Both runs use the same scheduler, model runner and model (the built-in tiny Llama unless
--model), the same batch of sequences, and the same block manager code:
  in-process  the scheduler calls cachesvc's SequenceTable directly (pool: a local tensor);
  remote      the scheduler calls a real cache service process over its Unix socket (pool: the
              service's shared memory, mapped zero-copy), exactly as a compute replica does.

    python bench/separation.py                 # batch 32, 256 new tokens per sequence
    python bench/separation.py --quick

A trace replay (in-process: the count of control calls does not depend on the transport) then
runs requests arriving over time with mixed prompt and output lengths, and counts control calls
per request; its baseline in the same run is what the same calls made when every commit was a
Commit call of its own (before Extend, Free and SwapOut carried them).

Targets (issues 4, 13): remote/in-process tokens/s >= 0.95 at batch 32; <= 0.1 cache calls per
decode step; <= 3 control calls per request in the trace replay.
The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtier.cachesvc.block_manager import BlockManager  # noqa: E402
from kvtier.cachesvc.errors import ResourceExhausted  # noqa: E402
from kvtier.cachesvc.sequences import SequenceTable  # noqa: E402
from kvtier.computesvc.cache_port import NoFreeBlocks, SequenceBlocks  # noqa: E402
from kvtier.computesvc.model import ModelRunner, load_model  # noqa: E402
from kvtier.computesvc.request import Request  # noqa: E402
from kvtier.computesvc.sampling import SamplingParams  # noqa: E402
from kvtier.computesvc.scheduler import Scheduler, SchedulerConfig  # noqa: E402


class InProcessCache:
    """The scheduler's BlockCache port over a SequenceTable in this process (no gRPC).

    Extend and commit items pass through as they are: the port's items are the tuples the
    table takes.
    """

    def __init__(self, table: SequenceTable, max_model_len: int):
        self.table = table
        self.block_size = table.block_size
        self.max_model_len = max_model_len
        self.lease = "in-process"
        # Calls that carried commits: each one was two calls (a Commit, then the call) before
        # Extend, Free and SwapOut could carry them.
        self.carried = 0

    def _carrying(self, commits) -> None:
        self.carried += bool(commits)

    def _do(self, fn, *args):
        try:
            return fn(self.lease, *args)
        except ResourceExhausted as e:
            raise NoFreeBlocks(str(e)) from None

    @staticmethod
    def _blocks(table_blocks) -> list[SequenceBlocks]:
        return [SequenceBlocks(b.sequence_id, list(b.block_table), b.num_cached_tokens) for b in table_blocks]

    async def allocate(self, items):
        # The scheduler's items are the table's own type (kvtier.sequence_types).
        return self._blocks(self._do(self.table.allocate, items))

    async def extend(self, items, commits=(), releases=()):
        self._carrying(commits)
        return self._blocks(self._do(self.table.extend, items, commits, releases))

    async def commit(self, items):
        self._do(self.table.commit, items)

    async def free(self, ids, commits=()):
        self._carrying(commits)
        self._do(self.table.free, ids, commits)

    async def swap_out(self, ids, commits=()):
        self._carrying(commits)
        return self._do(self.table.swap_out, ids, commits)[1]

    async def swap_in(self, ids):
        return self._blocks(self._do(self.table.swap_in, ids)[0])


async def decode_throughput(
    scheduler: Scheduler, batch: int, prompt_len: int, new_tokens: int, stagger: bool = False
) -> dict:
    """Run `batch` sequences to completion; tokens/s over the decode phase."""
    requests = [
        Request(
            f"r{i}",
            [(i * 37 + j) % 250 for j in range(prompt_len + (i % 32 if stagger else 0))],
            SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
        )
        for i in range(batch)
    ]
    for r in requests:
        scheduler.add(r)
    # Prefill first (not timed), then time the decode steps.
    while any(r.num_computed < len(r.prompt_token_ids) for r in requests):
        await scheduler.step()
    stats = scheduler.observer.stats
    calls0, steps0 = stats.cache_calls, stats.decode_steps
    tokens0 = sum(len(r.output_token_ids) for r in requests)
    t0 = time.perf_counter()
    while scheduler.has_work:
        await scheduler.step()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) for r in requests) - tokens0
    steps = stats.decode_steps - steps0
    return {
        "tokens_per_s": tokens / elapsed,
        "decode_steps": steps,
        "cache_calls": stats.cache_calls - calls0,
        "calls_per_step": (stats.cache_calls - calls0) / max(1, steps),
        "outputs": [r.output_token_ids for r in requests],
    }


LOOKAHEAD_BLOCKS = SchedulerConfig.lookahead_blocks


def make_scheduler(loaded, pool: torch.Tensor, cache, block_size: int) -> Scheduler:
    runner = ModelRunner(loaded.model, pool, block_size)
    config = SchedulerConfig(max_num_seqs=256, lookahead_blocks=LOOKAHEAD_BLOCKS)
    return Scheduler(runner, cache, loaded.tokenizer, loaded.eos_token_ids, config)


async def run_remote(loaded, args, num_blocks: int) -> dict:
    from kvtier.cache_client import CacheClient
    from kvtier.cli.stack import LocalStack
    from kvtier.computesvc.remote_cache import RemoteCache
    from kvtier.pool import attach_pool

    token = "bench-token"
    run_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-sep-"))
    cache_args = ["--num-blocks", str(num_blocks), "--swap-space", "0", "--log-level", "WARNING"]
    if args.model:
        cache_args += ["--model", args.model]
    stack = LocalStack(run_dir, cache_args, num_replicas=0, env=dict(os.environ, KVTIER_TOKEN=token))
    stack.start_cache()
    try:
        client = CacheClient.connect(stack.cache_address, token, aio=True)
        await client.attach("bench", loaded.shape.fingerprint)
        pool = attach_pool(client.pool)
        scheduler = make_scheduler(loaded, pool.tensor, RemoteCache(client), client.pool.block_size)
        beat = asyncio.ensure_future(client.heartbeat_forever())
        result = await decode_throughput(
            scheduler, args.batch, args.prompt_len, args.new_tokens, args.stagger
        )
        beat.cancel()
        await client.close()
        del scheduler  # its model runner holds the last view of the pool: close the mapping after it
        pool.close()
        return result
    finally:
        stack.down()


def in_process_table(loaded, num_blocks: int, block_size: int) -> tuple[torch.Tensor, SequenceTable]:
    shape = loaded.shape
    pool = torch.zeros(
        num_blocks,
        shape.num_layers,
        2,
        block_size,
        shape.num_kv_heads,
        shape.head_dim,
        dtype=loaded.model.dtype,
    )
    table = SequenceTable(
        BlockManager(num_blocks, block_size),
        None,  # no swap: the batch fits
        model_fingerprint=shape.fingerprint,
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_model_len,
    )
    return pool, table


async def run_in_process(loaded, args, num_blocks: int, block_size: int) -> dict:
    pool, table = in_process_table(loaded, num_blocks, block_size)
    scheduler = make_scheduler(loaded, pool, InProcessCache(table, loaded.shape.max_model_len), block_size)
    return await decode_throughput(scheduler, args.batch, args.prompt_len, args.new_tokens, args.stagger)


async def trace_replay(loaded, num_requests: int, block_size: int, seed: int = 0) -> dict:
    """Requests arriving over time (0-3 per step), prompts of 16-200 tokens sharing 4 system
    prefixes, 4-96 new tokens each, at most 32 running: control calls per request, and what the
    same run made before Extend/Free/SwapOut carried commits (one Commit more per carrying call)."""
    import random

    rng = random.Random(seed)
    systems = [[(s * 41 + j) % 250 for j in range(rng.randrange(16, 96))] for s in range(4)]
    requests = [
        Request(
            f"t{i}",
            rng.choice(systems) + [rng.randrange(250) for _ in range(rng.randrange(0, 104))],
            SamplingParams(max_tokens=rng.randrange(4, 97), temperature=0, ignore_eos=True),
        )
        for i in range(num_requests)
    ]
    num_blocks = 32 * (300 // block_size + 2) + 64
    pool, table = in_process_table(loaded, num_blocks, block_size)
    cache = InProcessCache(table, loaded.shape.max_model_len)
    runner = ModelRunner(loaded.model, pool, block_size)
    config = SchedulerConfig(max_num_seqs=32, lookahead_blocks=LOOKAHEAD_BLOCKS)
    scheduler = Scheduler(runner, cache, loaded.tokenizer, loaded.eos_token_ids, config)
    pending = list(requests)
    while pending or scheduler.has_work:
        for _ in range(min(len(pending), rng.randrange(0, 4))):
            scheduler.add(pending.pop(0))
        await scheduler.step()
    stats = scheduler.observer.stats
    return {
        "calls_per_request": stats.cache_calls / num_requests,
        "before_per_request": (stats.cache_calls + cache.carried) / num_requests,
        "calls_per_step": stats.cache_calls / max(1, stats.decode_steps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--repeats", type=int, default=3, help="alternate in-process/remote runs; report the best of each"
    )
    ap.add_argument("--model", help="local HF model dir (default: built-in tiny model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (as a compute replica uses)")
    ap.add_argument(
        "--lookahead-blocks", type=int, default=SchedulerConfig.lookahead_blocks, help="as computesvc's flag"
    )
    ap.add_argument(
        "--stagger",
        action="store_true",
        help="prompt lengths 64..95 instead of all 64 (block boundaries spread out)",
    )
    ap.add_argument("--trace-requests", type=int, default=200, help="requests in the trace replay")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    global LOOKAHEAD_BLOCKS
    LOOKAHEAD_BLOCKS = args.lookahead_blocks
    if args.quick:
        args.new_tokens, args.repeats, args.trace_requests = 96, 1, 100
    torch.set_num_threads(args.threads)
    block_size = 16
    num_blocks = args.batch * ((args.prompt_len + 32 + args.new_tokens) // block_size + 8) + 64
    loaded = load_model(args.model, dtype="float32")
    best = {"in-process": None, "remote": None}
    for _ in range(args.repeats):
        for name in best:
            if name == "remote":
                r = asyncio.run(run_remote(loaded, args, num_blocks))
            else:
                r = asyncio.run(run_in_process(loaded, args, num_blocks, block_size))
            if best[name] is None or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = r
            print(
                f"{name:>10}: {r['tokens_per_s']:8.1f} tokens/s, {r['calls_per_step']:.3f} cache calls/decode step"
            )
    local, remote = best["in-process"], best["remote"]
    same = local["outputs"] == remote["outputs"]
    print(f"outputs identical in both modes: {same}")
    trace = asyncio.run(trace_replay(loaded, args.trace_requests, block_size))
    print(
        f"trace replay, {args.trace_requests} requests arriving over time: {trace['calls_per_request']:.2f} control "
        f"calls per request ({trace['before_per_request']:.2f} with a Commit call of its own before every carrying "
        f"Extend/Free/SwapOut, as before); {trace['calls_per_step']:.3f} per decode step"
    )
    ratio = remote["tokens_per_s"] / local["tokens_per_s"]
    print(
        f"headline: batch {args.batch}: remote/in-process decode throughput {ratio:.3f} (target >= 0.95); "
        f"{remote['calls_per_step']:.3f} cache calls per decode step (target <= 0.1); "
        f"{trace['calls_per_request']:.2f} per request in the trace replay (target <= 3)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
