"""Swap-tier bandwidth: HostTier.swap_out / swap_in in GB/s against the bandwidth of a plain copy
of the same bytes measured in the same run.

On CUDA the baseline is the device's pinned-memory copy bandwidth (one device -> pinned host and
one pinned host -> device `copy_` of a contiguous buffer as large as the batch): what PCIe / NVLink-C2C
gives; the swap tier adds a gather / scatter over the pool and one copy per run of consecutive
slots. On CPU both the tier and the baseline are memcpy (labelled so): the figure there says
what the bookkeeping costs, not what a GPU would do.

    python bench/swap.py --quick          # CPU: a few MiB; CUDA: as given
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
        nargs=5,
        default=[22, 2, 16, 4, 64],
        metavar=("LAYERS", "KV", "BLOCK_SIZE", "KV_HEADS", "HEAD_DIM"),
        help="one pool block (default: a 1B Llama's, TinyLlama's shape: 352 KiB in bfloat16)",
    )
    ap.add_argument("--pool-blocks", type=int, default=4096, help="device blocks in the pool")
    ap.add_argument("--batch-blocks", type=int, default=512, help="blocks moved per swap call")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls of each kind (best is reported)")
    ap.add_argument("--quick", action="store_true", help="a small pool and batch (CPU-sized)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    return ap.parse_args(argv)


def _best(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvtier.cachesvc.host_tier import HostTier

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    if args.quick:
        args.pool_blocks, args.batch_blocks = min(args.pool_blocks, 256), min(args.batch_blocks, 64)
    dtype = getattr(torch, args.dtype)
    pool = torch.zeros((args.pool_blocks, *args.block_shape), dtype=dtype, device=device)
    tier = HostTier(pool, args.batch_blocks)
    block_bytes = tier.block_bytes
    n = args.batch_blocks
    nbytes = n * block_bytes
    ids = list(range(0, 2 * n, 2))[:n] if 2 * n <= args.pool_blocks else list(range(n))  # strided blocks

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    state: dict = {}

    def swap_out() -> None:
        if "slots" in state:
            tier.release(state.pop("slots"))
        state["slots"] = tier.swap_out(ids)

    t_out = _best(swap_out, sync, args.repeats)
    # swap_in releases the slots: time it alone, re-filling the tier outside the clock.
    best_in = float("inf")
    for _ in range(args.repeats + 1):
        if "slots" not in state:
            state["slots"] = tier.swap_out(ids)
        slots = state.pop("slots")
        sync()
        t = time.perf_counter()
        tier.swap_in(slots, ids)
        sync()
        best_in = min(best_in, time.perf_counter() - t)
    t_in = best_in

    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if cuda:
        d2h = _best(lambda: flat_host.copy_(flat_dev, non_blocking=True), sync, args.repeats)
        h2d = _best(lambda: flat_dev.copy_(flat_host, non_blocking=True), sync, args.repeats)
        baseline = "pinned-copy bandwidth of this device (contiguous, same bytes, same run)"
        name = torch.cuda.get_device_name()
    else:
        d2h = _best(lambda: flat_host.copy_(flat_dev), sync, args.repeats)
        h2d = d2h
        baseline = "CPU memcpy bandwidth (no GPU: this is memcpy, not PCIe)"
        name = "cpu"
    gbs = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    report = {
        "device": name,
        "dtype": args.dtype,
        "block_bytes": block_bytes,
        "batch_blocks": n,
        "batch_bytes": nbytes,
        "swap_out_gbs": gbs(t_out),
        "swap_in_gbs": gbs(t_in),
        "baseline": baseline,
        "baseline_d2h_gbs": gbs(d2h),
        "baseline_h2d_gbs": gbs(h2d),
        "slots_pinned": bool(tier.slots.is_pinned()) if cuda else False,
    }
    report["swap_out_fraction"] = report["swap_out_gbs"] / report["baseline_d2h_gbs"]
    report["swap_in_fraction"] = report["swap_in_gbs"] / report["baseline_h2d_gbs"]
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = run(args)
    print(
        f"{r['device']}: {r['batch_blocks']} blocks x {r['block_bytes']} bytes = {r['batch_bytes'] / 2**20:.1f} MiB "
        f"per call, {r['dtype']}, host slots pinned: {r['slots_pinned']}"
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
