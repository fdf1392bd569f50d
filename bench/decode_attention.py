"""Paged decode attention against attention over a contiguous cache of the same K/V.

For each (batch, context) of the grid, the same K/V is stored twice: scattered over the blocks of a
block-major pool `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (blocks in random
order, read through per-layer views, as the compute service reads it), and contiguously as
`[batch, num_kv_heads, context, head_dim]`. Paged = `kernels.paged_decode_attention` (whatever
backend the dispatcher picks: torch on CPU, Triton on CUDA); contiguous =
`torch.nn.functional.scaled_dot_product_attention`, measured in the same run.

On CUDA it also reports the KV-read bandwidth of the paged kernel as a fraction of the device's
peak (table below, or --peak-bw-gbs), and the time of FlashInfer's and vLLM's paged decode where
they are importable. Writes a plot of time vs context length (--plot) and prints the headline
figure last: the paged/contiguous time ratio at the largest case on CPU, the bandwidth fraction
at batch 64, context 4096 on CUDA.

    .venv/bin/python bench/decode_attention.py [--quick] [--plot bench/out/decode_attention.png]

On a CPU shared with other busy processes, run with OMP_WAIT_POLICY=PASSIVE (or --threads 1):
with OpenMP's default spin-waiting, every parallel region of the multi-op torch path can stall
for a scheduler time slice, which a single fused SDPA call suffers far less.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtier import kernels  # noqa: E402

# Peak DRAM bandwidth in GB/s by device name (substring match, first hit wins: GH200 before H200).
PEAK_BANDWIDTH_GBS = {
    "GH200": 4900.0,
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "B200": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class DecodeCase:
    """One (batch, context) point: the same K/V paged and contiguous, and a query per sequence."""

    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # per-layer view of the pool [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, blocks per sequence] int32, random block order
    seq_lens: torch.Tensor  # [batch] int32
    k_contiguous: torch.Tensor  # [batch, num_kv_heads, context, head_dim]
    v_contiguous: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one decode step must read."""
        per_token = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * int(self.seq_lens.sum()) * per_token


def make_case(args: argparse.Namespace, batch: int, context: int, device: torch.device) -> DecodeCase:
    dtype = _DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(batch * 100_003 + context)
    blocks_per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, args.num_layers, 2, args.block_size, args.num_kv_heads, args.head_dim)
    pool = torch.empty(shape, device=device, dtype=dtype)
    pool.normal_(generator=None)
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = order.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    layer = args.num_layers - 1
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[block_tables.long()].reshape(
            batch, blocks_per_seq * args.block_size, args.num_kv_heads, -1
        )
        return rows[:, :context].transpose(1, 2).contiguous()

    return DecodeCase(
        q=torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.full((batch,), context, device=device, dtype=torch.int32),
        k_contiguous=contiguous(k_cache),
        v_contiguous=contiguous(v_cache),
    )


def paged_fn(case: DecodeCase, scale: float) -> Callable[[], torch.Tensor]:
    max_len = int(case.seq_lens.max())
    return lambda: kernels.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, max_seq_len=max_len
    )


def contiguous_fn(case: DecodeCase, scale: float) -> Callable[[], torch.Tensor]:
    q = case.q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    return lambda: F.scaled_dot_product_attention(
        q, case.k_contiguous, case.v_contiguous, scale=scale, enable_gqa=True
    )


def flashinfer_fn(case: DecodeCase, scale: float) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged decode over the same blocks (its NHD layout is ours)."""
    import flashinfer

    batch, num_heads, head_dim = case.q.shape
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    blocks = case.block_tables.shape[1]
    device = case.q.device
    indptr = torch.arange(0, (batch + 1) * blocks, blocks, device=device, dtype=torch.int32)
    indices = case.block_tables.reshape(-1).contiguous()
    last_len = ((case.seq_lens - 1) % block_size + 1).to(torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        indptr,
        indices,
        last_len,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        q_data_type=case.q.dtype,
        kv_data_type=case.k_cache.dtype,
        sm_scale=scale,
    )
    kv = (case.k_cache.contiguous(), case.v_cache.contiguous())  # its kernel, not its stride support
    return lambda: wrapper.run(case.q, kv)


def vllm_fn(case: DecodeCase, scale: float) -> Callable[[], torch.Tensor]:
    """vLLM's flash-attention decode over the same paged cache (`flash_attn_with_kvcache`)."""
    from vllm.vllm_flash_attn import flash_attn_with_kvcache

    q = case.q.unsqueeze(1)  # [batch, 1, heads, head_dim]
    k_cache, v_cache = case.k_cache.contiguous(), case.v_cache.contiguous()
    return lambda: flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=case.seq_lens,
        block_table=case.block_tables,
        softmax_scale=scale,
        causal=True,
    )


def time_cpu(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best-of-`repeats` wall time in ms. The functions run interleaved, round after round, so load
    from other processes hits both sides alike; the minimum is the least disturbed run."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: allocator, thread pool
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: min(s) for name, s in samples.items()}


def time_cuda(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median ms per call from `triton.testing.do_bench` (flushes L2 between calls, so every
    call reads its K/V from HBM)."""
    import triton.testing

    return {
        name: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        for name, fn in fns.items()
    }


def peak_bandwidth_gbs(device: torch.device, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-bw-gbs"
    name = torch.cuda.get_device_name(device)
    for key, gbs in PEAK_BANDWIDTH_GBS.items():
        if key in name:
            return gbs, name
    return None, name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default: float16 on CUDA, float32 on CPU"
    )
    parser.add_argument(
        "--batch", type=int, nargs="+", default=None, help="batch sizes (default: per device)"
    )
    parser.add_argument("--context", type=int, nargs="+", default=None, help="context lengths in tokens")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-layers", type=int, default=2, help="layers in the pool (sets the block stride)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="CPU: timed rounds per case")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's)")
    parser.add_argument("--peak-bw-gbs", type=float, default=None, help="CUDA: peak DRAM bandwidth, GB/s")
    parser.add_argument(
        "--sweep-configs",
        action="store_true",
        help="CUDA: also time the Triton decode kernel's (TILE_N, num_warps, num_stages) alternatives "
        "at batch 64, context 4096",
    )
    parser.add_argument(
        "--plot", type=Path, default=Path(__file__).resolve().parent / "out" / "decode_attention.png"
    )
    args = parser.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("float16" if cuda else "float32")
    if args.batch is None:
        args.batch = (
            ([1, 64] if args.quick else [1, 8, 32, 64, 128])
            if cuda
            else ([1, 8] if args.quick else [1, 4, 16])
        )
    if args.context is None:
        if cuda:
            args.context = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
        else:
            args.context = [256, 1024] if args.quick else [256, 1024, 4096]
    return args


def available_baselines(cuda: bool) -> dict[str, Callable[[DecodeCase, float], Callable[[], torch.Tensor]]]:
    """The comparison columns importable here (flashinfer, vllm; CUDA only), each skip noted."""
    baselines: dict[str, Callable[[DecodeCase, float], Callable[[], torch.Tensor]]] = {}
    if cuda:
        for name, factory, module in (("flashinfer", flashinfer_fn, "flashinfer"), ("vllm", vllm_fn, "vllm")):
            try:
                __import__(module)
                baselines[name] = factory
            except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
                print(f"note: {name} column skipped ({module} not importable: {type(exc).__name__}: {exc})")
    else:
        print("note: flashinfer / vllm columns are CUDA only; skipped on CPU")
    return baselines


def measure_point(
    args: argparse.Namespace, batch: int, context: int, device: torch.device, scale: float, baselines: dict
) -> dict:
    """Time paged vs contiguous (and the baselines) at one grid point, after checking paged
    agrees with contiguous; {batch, context, gbs (paged KV read rate), ms per function name}."""
    case = make_case(args, batch, context, device)
    fns = {"paged": paged_fn(case, scale), "contiguous": contiguous_fn(case, scale)}
    torch.testing.assert_close(
        fns["paged"]().float(), fns["contiguous"]().squeeze(2).float(), atol=2e-2, rtol=2e-2
    )
    for name, factory in baselines.items():
        try:
            fns[name] = factory(case, scale)
            fns[name]()
        except Exception as exc:  # noqa: BLE001 - a baseline's API drift must not stop the run
            print(f"note: {name} failed at batch {batch}, context {context}: {type(exc).__name__}: {exc}")
            fns.pop(name, None)
    times = time_cuda(fns) if device.type == "cuda" else time_cpu(fns, args.repeats)
    gbs = case.kv_bytes / (times["paged"] * 1e-3) / 1e9
    return {"batch": batch, "context": context, "gbs": gbs, **times}


def print_row(row: dict, peak: float | None, baselines: dict) -> None:
    line = (
        f"{row['batch']:>5} {row['context']:>7} {row['paged']:>9.3f} {row['contiguous']:>9.3f} "
        f"{row['paged'] / row['contiguous']:>6.2f} {row['gbs']:>10.1f}"
    )
    if peak:
        line += f" {100 * row['gbs'] / peak:>5.1f}%"
    for name in baselines:
        line += f" {row[name]:>13.3f}" if name in row else f" {'-':>13}"
    print(line, flush=True)


def print_headline(
    args: argparse.Namespace, rows: list[dict], device: torch.device, peak: float | None
) -> None:
    """CUDA: the KV read rate at batch 64, context 4096 (else the last point), against the peak;
    CPU: the paged/contiguous ratio at the largest point."""
    if device.type == "cuda":
        target = [r for r in rows if r["batch"] == 64 and r["context"] == 4096] or rows[-1:]
        r = target[0]
        if peak:
            print(
                f"headline: paged decode reads KV at {r['gbs']:.0f} GB/s = {100 * r['gbs'] / peak:.1f}% of peak "
                f"{peak:.0f} GB/s (batch {r['batch']}, context {r['context']}, {args.dtype})"
            )
        else:
            print(
                f"headline: paged decode reads KV at {r['gbs']:.0f} GB/s (batch {r['batch']}, context {r['context']})"
            )
    else:
        r = max(rows, key=lambda r: (r["batch"] * r["context"], r["context"]))
        print(
            f"headline: paged/contiguous time ratio {r['paged'] / r['contiguous']:.2f} at batch {r['batch']}, "
            f"context {r['context']} ({kernels.backend(device)} path, {args.dtype})"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = args.head_dim**-0.5
    torch.manual_seed(0)

    baselines = available_baselines(cuda)
    peak, peak_source = peak_bandwidth_gbs(device, args.peak_bw_gbs) if cuda else (None, "")
    where = (
        torch.cuda.get_device_name(device)
        if cuda
        else f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        f"device {device} ({where}), "
        f"backend {kernels.backend(device)}, {args.dtype}, heads {args.num_heads}/{args.num_kv_heads} KV, "
        f"head_dim {args.head_dim}, block_size {args.block_size}, pool layers {args.num_layers}"
    )
    if cuda:
        print(f"peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown'} ({peak_source})")
    header = f"{'batch':>5} {'context':>7} {'paged ms':>9} {'contig ms':>9} {'ratio':>6} {'paged GB/s':>10}"
    if peak:
        header += f" {'% peak':>6}"
    for name in baselines:
        header += f" {name + ' ms':>13}"
    print(header)

    rows = []
    for batch in args.batch:
        for context in args.context:
            rows.append(measure_point(args, batch, context, device, scale, baselines))
            print_row(rows[-1], peak, baselines)

    if cuda and args.sweep_configs:
        sweep_configs(args, device, scale)
    write_plot(args, rows, device)
    ratios = [r["paged"] / r["contiguous"] for r in rows]
    print(f"geomean paged/contiguous ratio over the grid: {statistics.geometric_mean(ratios):.2f}")
    print_headline(args, rows, device, peak)


def sweep_configs(args: argparse.Namespace, device: torch.device, scale: float) -> None:
    """Time the decode kernel under each launch config at batch 64, context 4096 (the headline
    point), against the shipped `launch_config`, so a device run says which one to ship."""
    from kvtier.kernels import decode_attention

    case = make_case(args, 64, 4096, device)
    head_dim_pad = max(16, 1 << (args.head_dim - 1).bit_length())
    shipped = decode_attention.launch_config(head_dim_pad, case.q.dtype, interpret=False)
    print(f"launch config sweep at batch 64, context 4096 (shipped: TILE_N, warps, stages = {shipped})")
    print(f"{'TILE_N':>6} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>8}")
    paged_args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    for tile_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                config = (tile_n, num_warps, num_stages)
                fn = functools.partial(
                    decode_attention.paged_decode_attention,
                    *paged_args,
                    max_seq_len=4096,
                    config=config,
                )
                try:
                    ms = time_cuda({"x": fn})["x"]
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this config
                    print(f"{tile_n:>6} {num_warps:>5} {num_stages:>6} failed: {type(exc).__name__}")
                    continue
                mark = "  <- shipped" if config == shipped else ""
                print(
                    f"{tile_n:>6} {num_warps:>5} {num_stages:>6} {ms:>8.3f} {case.kv_bytes / ms / 1e6:>8.0f}{mark}"
                )


def write_plot(args: argparse.Namespace, rows: list[dict], device: torch.device) -> None:
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib not importable; plot skipped")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, batch in enumerate(args.batch):
        points = [r for r in rows if r["batch"] == batch]
        contexts = [r["context"] for r in points]
        color = f"C{i}"
        ax.plot(contexts, [r["paged"] for r in points], "o-", color=color, label=f"paged, batch {batch}")
        ax.plot(
            contexts,
            [r["contiguous"] for r in points],
            "s--",
            color=color,
            label=f"contiguous, batch {batch}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time per decode step (ms)")
    ax.set_title(f"decode attention on {device.type} ({kernels.backend(device)}, {args.dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
