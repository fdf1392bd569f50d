"""Cache-service domain layer, in process: cost of one sequence lifecycle, with and without prefix caching.

Synthetic trace: --sequences requests; each prompt is one of --prefixes shared prefixes
(--prefix-len tokens, picked with Zipf(--zipf) popularity) followed by a unique suffix, so
about half of a 1k-token prompt can hit. One lifecycle, as the cache service sees it:

    allocate 1 prompt -> --decode extends (each grows room by one token) -> commit -> free

Baseline in the same run: the same trace with a unique cache_salt per request, so nothing
ever hits (prefix caching off, everything else equal).

Hashing is timed on its own over the same trace and subtracted, so the figures "excl. hashing"
are the block manager and sequence bookkeeping. Hashing is what a lifecycle spends turning token
ids into block names: packing the prompt's ids to bytes (allocate) and, at commit, packing and
SHA-256 for every block the lifecycle names for the first time. A prefix hit costs no SHA-256:
the index compares hash preimages and hands back the stored hash (cachesvc.block_manager), so
the replay hashes exactly the blocks after each lifecycle's hit. ns/token divides by every
token of the lifecycle (prompt + decode); "sha/life" counts the blocks SHA-256 ran on.

    python bench/block_manager.py            # 2000 sequences, 5 runs
    python bench/block_manager.py --quick    # 300 sequences

Targets: <= 100 µs per lifecycle excluding hashing; hashing <= 50 ns per token.
The last line is the headline.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachesvc.block_manager import BlockManager, extra_key, hash_full_blocks, pack_token_ids  # noqa: E402
from cachesvc.events import EventLog  # noqa: E402
from cachesvc.sequences import AllocateSpec, SequenceTable  # noqa: E402

VOCAB = 50257
FINGERPRINT = "bench-model"
LEASE = "bench"


@dataclass
class Trace:
    prompts: list[list[int]]
    generated: list[list[int]]


def make_trace(args: argparse.Namespace) -> Trace:
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, VOCAB, args.prefix_len).tolist() for _ in range(args.prefixes)]
    weights = 1.0 / np.arange(1, args.prefixes + 1) ** args.zipf
    picks = rng.choice(args.prefixes, size=args.sequences, p=weights / weights.sum())
    suffix_len = args.prompt_len - args.prefix_len
    prompts = [prefixes[p] + rng.integers(0, VOCAB, suffix_len).tolist() for p in picks]
    generated = [rng.integers(0, VOCAB, args.decode).tolist() for _ in range(args.sequences)]
    return Trace(prompts, generated)


@dataclass(frozen=True)
class Mode:
    name: str
    unique_salts: bool  # a salt per request: nothing ever hits (the no-prefix-caching baseline)
    record_events: bool = True  # BlockStored / BlockRemoved for WatchEvents, drained every lifecycle


MODES = (
    Mode("prefix caching", unique_salts=False),
    Mode("baseline (no hits)", unique_salts=True),
    Mode("prefix, no events", unique_salts=False, record_events=False),
)


def make_table(args: argparse.Namespace, mode: Mode) -> SequenceTable:
    gc.unfreeze()  # let the previous run's table go
    bm = BlockManager(args.num_blocks, args.block_size, record_events=mode.record_events)
    gc.collect()
    gc.freeze()  # as the cache service does once its pool is built
    return SequenceTable(
        bm,
        None,
        model_fingerprint=FINGERPRINT,
        vocab_size=VOCAB,
        max_model_len=args.prompt_len + args.decode + 64,
    )


def salts(args: argparse.Namespace, unique: bool) -> list[str]:
    return [f"req-{i}" if unique else "" for i in range(args.sequences)]


def run_lifecycles(args: argparse.Namespace, trace: Trace, mode: Mode) -> tuple[np.ndarray, float, list[int]]:
    """Nanoseconds of each lifecycle of the trace (a timer around each), the prefix hit rate and
    each lifecycle's hit in blocks."""
    table = make_table(args, mode)
    bm = table.block_manager
    events = EventLog(args.block_size)
    decode = args.decode
    specs = [
        AllocateSpec(p, cache_salt=s)
        for p, s in zip(trace.prompts, salts(args, mode.unique_salts), strict=True)
    ]
    clock = time.thread_time_ns
    times = np.empty(len(specs), dtype=np.int64)
    hits: list[int] = []
    gc.collect()
    for k, (spec, gen) in enumerate(zip(specs, trace.generated, strict=True)):
        t0 = clock()
        (view,) = table.allocate(LEASE, [spec])
        sid = view.sequence_id
        for i in range(1, decode + 1):
            table.extend(LEASE, [(sid, i)])
        table.commit(LEASE, [(sid, gen, len(spec.token_ids) + decode)])
        table.free(LEASE, [sid])
        events.extend(bm.take_event_records())  # the servicer drains events every call
        times[k] = clock() - t0
        hits.append(view.num_cached_tokens // args.block_size)
    stats = table.stats
    return times, stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens), hits


def run_breakdown(args: argparse.Namespace, trace: Trace, mode: Mode) -> np.ndarray:
    """Nanoseconds of [allocate, all extends, commit, free, drain events] per lifecycle, [sequences, 5]."""
    table = make_table(args, mode)
    bm = table.block_manager
    events = EventLog(args.block_size)
    decode = args.decode
    specs = [
        AllocateSpec(p, cache_salt=s)
        for p, s in zip(trace.prompts, salts(args, mode.unique_salts), strict=True)
    ]
    clock = time.thread_time_ns
    out = np.empty((len(specs), 5), dtype=np.int64)
    gc.collect()
    for k, (spec, gen) in enumerate(zip(specs, trace.generated, strict=True)):
        t0 = clock()
        (view,) = table.allocate(LEASE, [spec])
        t1 = clock()
        sid = view.sequence_id
        for i in range(1, decode + 1):
            table.extend(LEASE, [(sid, i)])
        t2 = clock()
        table.commit(LEASE, [(sid, gen, len(spec.token_ids) + decode)])
        t3 = clock()
        table.free(LEASE, [sid])
        t4 = clock()
        events.extend(bm.take_event_records())  # as the servicer does after every call
        t5 = clock()
        out[k] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
    return out


def run_hashing(
    args: argparse.Namespace, trace: Trace, mode: Mode, hits: list[int]
) -> tuple[np.ndarray, int, int]:
    """Nanoseconds spent hashing exactly what each lifecycle hashes (``hits[k]``: its hit in
    blocks), tokens per lifecycle, and blocks SHA-256 ran on in all."""
    bs = args.block_size
    extras = [extra_key(FINGERPRINT, s) for s in salts(args, mode.unique_salts)]
    full = (args.prompt_len + args.decode) // bs
    clock = time.thread_time_ns
    times = np.empty(len(trace.prompts), dtype=np.int64)
    hashed = 0
    gc.collect()
    for k, (prompt, gen, extra, hit) in enumerate(
        zip(trace.prompts, trace.generated, extras, hits, strict=True)
    ):
        # Outside the timer: commit appends to a list it already has; the hit's last hash is stored.
        tokens = prompt + gen
        parent = hash_full_blocks(prompt[: hit * bs], bs, extra)[-1] if hit else None
        t0 = clock()
        pack_token_ids(prompt)  # allocate: validation and the prefix walk's keys
        hash_full_blocks(tokens[hit * bs : full * bs], bs, extra, parent)  # commit: new blocks
        times[k] = clock() - t0
        hashed += full - hit
    return times, len(trace.prompts[0]) + args.decode, hashed


def best_of(runs: list[np.ndarray]) -> np.ndarray:
    """Per-lifecycle minimum over repeated runs of the same deterministic trace.

    Lifecycle k does the same work in every run, so its minimum is its cost without the
    preemptions a shared machine adds; summing minima filters noise that a min of totals keeps.
    """
    return np.min(np.stack(runs), axis=0)


def python_speed_ns() -> float:
    """ns per iteration of an empty Python loop (best of 20): how fast this machine runs Python now."""
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter_ns()
        for _ in range(10_000):
            pass
        best = min(best, (time.perf_counter_ns() - t0) / 10_000)
    return best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each shared prefix")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (prefix + unique suffix)")
    parser.add_argument("--decode", type=int, default=64, help="extends of one token per lifecycle")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of prefix popularity")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5, help="runs; each lifecycle's best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="300 sequences")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences = 300
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trace = make_trace(args)
    speed_before = python_speed_ns()
    n = args.sequences
    print(
        f"trace: {n} sequences, prompt {args.prompt_len} tokens ({args.prefixes} shared prefixes of "
        f"{args.prefix_len}, Zipf {args.zipf}), {args.decode} one-token extends, block size "
        f"{args.block_size}, {args.num_blocks} blocks; per-lifecycle best of {args.repeats} runs"
    )
    lifecycles: dict[Mode, list[np.ndarray]] = {m: [] for m in MODES}
    hashing: dict[Mode, list[np.ndarray]] = {m: [] for m in MODES}
    breakdown: dict[Mode, list[np.ndarray]] = {m: [] for m in MODES}
    hit_rate: dict[Mode, float] = {}
    sha_blocks: dict[Mode, int] = {}
    # Modes interleave run by run, so all see the same machine load.
    for _ in range(args.repeats):
        for mode in MODES:
            times, hit_rate[mode], hits = run_lifecycles(args, trace, mode)
            lifecycles[mode].append(times)
            hash_times, lifecycle_tokens, sha_blocks[mode] = run_hashing(args, trace, mode, hits)
            hashing[mode].append(hash_times)
            breakdown[mode].append(run_breakdown(args, trace, mode))
    rows = {}
    for mode in MODES:
        total = best_of(lifecycles[mode]).sum() / n / 1e3
        hash_us = best_of(hashing[mode]).sum() / n / 1e3
        parts = best_of(breakdown[mode]).sum(axis=0) / n / 1e3
        rows[mode.name] = {
            "hit": hit_rate[mode],
            "total_us": total,
            "hash_us": hash_us,
            "excl_us": total - hash_us,
            "hash_ns_tok": hash_us * 1e3 / lifecycle_tokens,
            "sha_blocks": sha_blocks[mode] / n,
            "allocate": parts[0],
            "extend": parts[1] / args.decode,
            "commit": parts[2],
            "free": parts[3],
            "events": parts[4],
        }

    speed_after = python_speed_ns()
    print(
        f"machine: empty Python loop {speed_before:.1f} / {speed_after:.1f} ns per iteration before / after "
        f"(a quiet modern x86 core runs ~8-12); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = (
        f"{'mode':<20} {'hit %':>6} {'µs/life':>8} {'hashing':>8} {'excl.hash':>9} "
        f"{'ns/tok':>7} {'sha/life':>8} {'alloc':>7} {'extend':>7} {'commit':>7} {'free':>6} {'events':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:<20} {r['hit'] * 100:>6.1f} {r['total_us']:>8.1f} {r['hash_us']:>8.1f} {r['excl_us']:>9.1f} "
            f"{r['hash_ns_tok']:>7.1f} {r['sha_blocks']:>8.1f} {r['allocate']:>7.1f} {r['extend']:>7.2f} {r['commit']:>7.1f} {r['free']:>6.1f} "
            f"{r['events']:>6.1f}"
        )
    print(
        "(µs of CPU time per lifecycle; alloc/commit/free/events per lifecycle and extend per call come from a run "
        "with a timer per call; alloc and commit include their hashing)"
    )
    pc, base = rows["prefix caching"], rows["baseline (no hits)"]
    print(
        f"headline: {pc['excl_us']:.1f} µs per lifecycle excluding hashing with prefix caching "
        f"({pc['hit'] * 100:.0f}% hit; baseline no-hit {base['excl_us']:.1f} µs; target <= 100), "
        f"hashing {pc['hash_ns_tok']:.1f} ns/token (target <= 50; SHA-256 on {pc['sha_blocks']:.0f} of "
        f"{lifecycle_tokens // args.block_size} blocks, baseline {base['hash_ns_tok']:.1f} ns/token)"
    )


if __name__ == "__main__":
    main()
