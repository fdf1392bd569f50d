"""Swap bandwidth: SwapOut / SwapIn of a preempted sequence through swap's share of the one host
area, in GB/s, against a plain copy of the same bytes measured in the same run.

The path is a default cache service's (the host cache on): the host area is the host cache's
(``cachesvc.host_cache.HostCache``), the only tier of a ``TierStack``, beside a pool laid out as
the service lays it out (``kvtier.pool.private_pool``: one block, one row of bytes). A swap is
``cachesvc.swap.Swapping``, what the sequence table calls on SwapOut and SwapIn: ``move_out``
reserves slots through ``TierStack.reserve`` (the host cache gives up its least recently used
blocks for them; it is refilled outside the clock before each one, full as a service's is once
it has run a while), copies the sequence's device blocks in (``HostArea.store``) and frees them;
``move_in`` allocates device blocks from the block manager, copies the slots back
(``HostArea.load``) and releases them. The sequence's blocks are every other pool block.

On CUDA the baseline is the device's pinned-memory copy bandwidth (one device -> pinned host and
one pinned host -> device ``copy_`` of a contiguous buffer as large as the sequence): what PCIe /
NVLink-C2C gives. The area copies block by block on a side stream, and waits for it. On CPU both
the swap and the baseline (one numpy memcpy) are memcpy, labelled so: the figure there says what
the bookkeeping and the per-block copies cost, not what a GPU would do.

    python bench/swap.py --quick          # a small pool and sequence (CPU-sized)
    python bench/swap.py --device cuda --batch-blocks 256 --json out.json

The last line is the headline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument(
        "--block-shape",
        type=int,
        nargs=4,
        default=[22, 16, 4, 64],
        metavar=("LAYERS", "BLOCK_SIZE", "KV_HEADS", "HEAD_DIM"),
        help="one pool block, K and V (default: a 1B Llama's, TinyLlama's shape: 352 KiB in bfloat16)",
    )
    ap.add_argument("--pool-blocks", type=int, default=4096, help="device blocks in the pool")
    ap.add_argument("--host-blocks", type=int, help="slots of the host area (default: as many as the pool)")
    ap.add_argument("--batch-blocks", type=int, default=512, help="blocks of the sequence each swap moves")
    ap.add_argument("--repeats", type=int, default=10, help="timed swaps of each kind (best is reported)")
    ap.add_argument("--quick", action="store_true", help="a small pool and sequence (CPU-sized), 5 repeats")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_blocks, args.batch_blocks = min(args.pool_blocks, 256), min(args.batch_blocks, 64)
        args.repeats = min(args.repeats, 5)
    if args.host_blocks is None:
        args.host_blocks = args.pool_blocks
    if not 0 < args.batch_blocks <= min(args.host_blocks, args.pool_blocks // 2):
        ap.error(f"--batch-blocks {args.batch_blocks} must be > 0, <= --host-blocks and <= half the pool")
    return args


class SwapRig:
    """A default service's swap path over a private pool: the block manager and its device tier,
    the host cache as the only tier below (a ``TierStack``), and ``Swapping`` over them."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        from kvtier.cachesvc.block_manager import BlockManager
        from kvtier.cachesvc.host_cache import HostCache
        from kvtier.cachesvc.lower_tiers import TierStack
        from kvtier.cachesvc.records import CacheStats
        from kvtier.cachesvc.swap import Swapping
        from kvtier.cachesvc.tiers import DeviceTier
        from kvtier.pool import private_pool

        layers, block_size, kv_heads, head_dim = args.block_shape
        shape = [args.pool_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.views = private_pool(shape, args.dtype, device=device)
        self.block_bytes = self.views.rows.shape[1]
        self.block_size = block_size
        self.host = HostCache(args.host_blocks, self.block_bytes, device=device)
        self.host.attach_pool(self.views.rows)
        self.stack = TierStack(self.views.rows, [self.host])
        bm = BlockManager(args.pool_blocks, block_size)
        self.device = DeviceTier(bm, self.block_bytes)
        self.stats = CacheStats()
        self.swapping = Swapping(self.device, self.host, self.stats, self.stack)
        self._keys = 0

    def fill_host(self) -> None:
        """Store fresh blocks until every slot not swap's holds a cached block (outside the clock)."""
        from kvtier.cachesvc.tiers import Blocks

        room = self.host.num_slots - self.host.counts().blocks - self.host.num_used_blocks
        while room > 0:
            n = min(room, self.views.rows.shape[0])
            keys = [self._key() for _ in range(n)]
            self.host.submit_store(Blocks(keys, self.views.rows, range(n)))
            room -= n
        self.host.take_events()

    def _key(self) -> bytes:
        self._keys += 1
        return bytes(32) + self._keys.to_bytes(4 * self.block_size, "little")

    def sequence(self, num_blocks: int):
        """A committed device sequence on every other pool block, its bytes seeded."""
        from kvtier.cachesvc.records import DEVICE, Sequence

        taken = self.device.allocate(2 * num_blocks)
        table, spare = taken[::2], taken[1::2]
        self.device.release(spare)
        rows = self.views.rows
        rows[table] = rows[table].random_(0, 256)
        tokens = list(range(num_blocks * self.block_size))
        return Sequence(
            sequence_id=1, lease_id="bench", token_ids=tokens, block_table=table,
            num_computed_tokens=len(tokens), num_cached_tokens=0, location=DEVICE, tier_slots=[],
            extra=b"", prompt_bytes=b"", block_hashes=[], room=len(tokens),
        )  # fmt: skip


def _timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def baseline_copies(nbytes: int, device: str):
    """A plain device -> host and host -> device copy of ``nbytes`` (two callables), and what it is."""
    import numpy as np
    import torch

    cuda = device.startswith("cuda")
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if cuda:
        return (
            lambda: flat_host.copy_(flat_dev, non_blocking=True),
            lambda: flat_dev.copy_(flat_host, non_blocking=True),
            "pinned-copy bandwidth of this device (contiguous, same bytes, same run)",
        )
    src, dst = flat_dev.numpy(), flat_host.numpy()
    return (
        lambda: np.copyto(dst, src),
        lambda: np.copyto(src, dst),
        "CPU memcpy bandwidth, one numpy copy (no GPU: this is memcpy, not PCIe)",
    )


def time_rounds(rig: SwapRig, seq, args: argparse.Namespace, device: str, sync) -> dict:
    """Best seconds of ``move_out`` and ``move_in`` of ``seq`` and of the baseline's two copies,
    interleaved round by round (a busy machine slows both alike; one untimed round first), and
    the cached blocks the timed swap-outs gave up; checks the sequence's bytes came back."""
    d2h, h2d, baseline = baseline_copies(len(seq.live_blocks) * rig.block_bytes, device)
    want = rig.views.rows[seq.live_blocks].clone()
    best = dict.fromkeys(("out", "in", "d2h", "h2d"), float("inf"))
    given_up = 0
    for k in range(args.repeats + 1):
        rig.fill_host()
        evictions = rig.host.counts().evictions
        took = {"out": _timed(lambda: rig.swapping.move_out([seq]), sync), "d2h": _timed(d2h, sync)}
        rig.swapping.check_in(len(seq.tier_slots))
        took |= {"in": _timed(lambda: rig.swapping.move_in([seq]), sync), "h2d": _timed(h2d, sync)}
        if k:
            best = {name: min(best[name], took[name]) for name in best}
            given_up += rig.host.counts().evictions - evictions
    if not rig.views.rows[seq.live_blocks].equal(want):
        raise AssertionError("a swapped sequence came back with other bytes")
    rig.host.check_invariants()
    return best | {"given_up": given_up, "baseline": baseline}


def run(args: argparse.Namespace) -> dict:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rig = SwapRig(args, device)
    seq = rig.sequence(args.batch_blocks)
    t = time_rounds(rig, seq, args, device, sync)
    n = args.batch_blocks
    nbytes = n * rig.block_bytes
    gbs = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": args.dtype,
        "block_bytes": rig.block_bytes,
        "batch_blocks": n,
        "batch_bytes": nbytes,
        "host_blocks": rig.host.num_slots,
        "repeats": args.repeats,
        "cached_blocks_given_up": t["given_up"],  # by the timed swap-outs' reserve (the host cache full)
        "swap_out_gbs": gbs(t["out"]),
        "swap_in_gbs": gbs(t["in"]),
        "baseline": t["baseline"],
        "baseline_d2h_gbs": gbs(t["d2h"]),
        "baseline_h2d_gbs": gbs(t["h2d"]),
        "slots_pinned": bool(rig.host.slots.is_pinned()) if cuda else False,
        "swap_out_blocks": rig.stats.num_swap_out_blocks,
        "swap_in_blocks": rig.stats.num_swap_in_blocks,
    }
    report["swap_out_fraction"] = report["swap_out_gbs"] / report["baseline_d2h_gbs"]
    report["swap_in_fraction"] = report["swap_in_gbs"] / report["baseline_h2d_gbs"]
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = run(args)
    print(
        f"{r['device']}: a sequence of {r['batch_blocks']} blocks x {r['block_bytes']} bytes = "
        f"{r['batch_bytes'] / 2**20:.1f} MiB per swap, {r['dtype']}, host area {r['host_blocks']} slots "
        f"(pinned: {r['slots_pinned']}), best of {r['repeats']}; the timed swap-outs gave up "
        f"{r['cached_blocks_given_up']} cached blocks"
    )
    print(f"baseline: {r['baseline']}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(
        f"headline: swap out {r['swap_out_gbs']:.2f} GB/s = {r['swap_out_fraction']:.0%} of "
        f"{r['baseline_d2h_gbs']:.2f} GB/s device->host; swap in {r['swap_in_gbs']:.2f} GB/s = "
        f"{r['swap_in_fraction']:.0%} of {r['baseline_h2d_gbs']:.2f} GB/s host->device "
        f"({'pinned copies' if r['slots_pinned'] else 'memcpy, no GPU'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
