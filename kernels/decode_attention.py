"""Triton paged decode attention: one query token per sequence over its paged KV context.

Layout of the work (flash-decoding):
- one program per (sequence, kv_head, split). It loads the queries of every head of the GQA
  group at once (the group padded to a power of two >= 16 so `tl.dot` can take it, extra rows
  masked), walks the token range of its split in tiles of `TILE_N` positions, finds each
  position's block through the block table, loads K/V tiles through the cache strides and
  folds them in with an online softmax in fp32 (exp2 domain).
- with one split the program writes the normalized output directly. With several, each writes
  its normalized partial output and log-sum-exp, and `_reduce_splits_kernel` merges the splits
  of each (sequence, head).

The number of splits comes from `choose_num_splits`: split only while the device would
otherwise have too few programs to be busy, and never into splits shorter than
`MIN_SPLIT_TOKENS` (the reduce pass would cost more than it saves).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from kvtier.kernels.online_softmax import attend_span, load_rows, log_sum_exp, scale_operands, store_rows

# NOTE: a split shorter than this reads too little KV to pay for its partial write + reduce.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# The window of full attention: seq_len - _NO_WINDOW is below 0 for any int32 seq_len.
_NO_WINDOW = 2**31 - 1
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    group,
    tokens_per_split,
    window,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_s_block,
    stride_s_tok,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _split_span(seq_lens_ptr + seq, split, tokens_per_split, window)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < group
    heads = kv_head * group + g
    q = load_rows(
        q_ptr + seq * stride_q_seq, heads, stride_q_head, g_mask, HEAD_DIM, HEAD_DIM_PAD, DOT_IN_FP32
    )
    # Every tile holds at least one valid position, so row_max is finite from the first tile on.
    result, row_max, row_sum = attend_span(
        q,
        start,
        end,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
        (k_ptr + kv_head * stride_k_head, stride_k_block, stride_k_tok),
        (v_ptr + kv_head * stride_v_head, stride_v_block, stride_v_tok),
        (k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_s_block, stride_s_tok),
        qk_scale,
        None,
        HEAD_DIM,
        BLOCK_SIZE,
        TILE_N,
        DOT_IN_FP32,
        QUANTIZED,
    )
    # An empty range (seq_len 0, or a split past the end) has row_sum 0: its output is zeros.
    if WRITE_PARTIAL:
        part_out = part_out_ptr + seq * stride_po_seq + split * stride_po_split
        store_rows(part_out, heads, stride_po_head, g_mask, result, HEAD_DIM)
        lse = log_sum_exp(row_max, row_sum)
        tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=g_mask)
    else:
        out = result.to(out_ptr.dtype.element_ty)
        store_rows(out_ptr + seq * stride_o_seq, heads, stride_o_head, g_mask, out, HEAD_DIM)


@triton.jit
def _split_span(seq_len_ptr, split, tokens_per_split, window):
    """The key positions [start, end) one split of a sequence reads: its share of the sequence,
    from the window's start on (a split wholly before a sliding window reads nothing)."""
    seq_len = tl.load(seq_len_ptr)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    return tl.maximum(start, seq_len - window), end


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM

    lse = tl.load(
        part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + s, mask=s_mask, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): shift by 0 so the weights are exp2(-inf) = 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [SPLITS_PAD]
    total = tl.sum(weights, 0)
    part = tl.load(
        part_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + s[:, None] * stride_po_split
        + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    result = tl.sum(part * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + d,
        result.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per sequence for flash-decoding.

    The main kernel has num_seqs * num_kv_heads programs per split. Split only while that is
    under two waves of the device (`num_sms` streaming multiprocessors), and keep every split at
    least `MIN_SPLIT_TOKENS` long. A batch of 64 x 8 KV heads never splits; one sequence of 32k
    tokens on 132 SMs with 8 KV heads splits 33 ways.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = math.ceil(2 * num_sms / programs)
    by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter runs programs one at a time, so splitting buys nothing there: a notional
    # small device keeps the heuristic defined (tests force splits with num_splits).
    return 4


def launch_config(head_dim_pad: int, dtype: torch.dtype, interpret: bool) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages) of the decode kernel.

    NOTE: chosen from sm_90 compiles without a GPU: these keep registers <= 118 with no spills
    and let the pipeliner prefetch the next K/V tile with cp.async; fp32 (FMA dots, wide
    accumulators) spills with 4 warps and 64-token tiles. bench/decode_attention.py
    --sweep-configs measures the alternatives on a real device.
    """
    if interpret:
        return 64, 1, 1  # the interpreter pays per op per loop step: wide tiles, fewer steps
    if dtype == torch.float32:
        return 32, 8, 2
    return (64, 4, 3) if head_dim_pad <= 128 else (32, 4, 2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: tuple[int, int, int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; same contract as `kernels.paged_decode_attention`.

    num_splits: force the number of splits (default: `choose_num_splits`). max_seq_len: an
    upper bound of seq_lens that sizes the splits (default: the block table's capacity,
    max_blocks * block_size; pass the true maximum when tables are padded far beyond it).
    config: (TILE_N, num_warps, num_stages) instead of `launch_config`'s (for tuning).
    k_scale, v_scale: a quantized cache's scales (kernels/__init__.py). window: a sliding window
    in tokens, None for full attention; positions before it are never loaded (splits wholly
    before it write an empty partial). Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    scales = scale_operands(k_scale, v_scale, q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1" or q.device.type != "cuda"
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n, num_warps, num_stages = config or launch_config(head_dim_pad, q.dtype, interpret)
    # The block table's capacity bounds every seq_len without reading seq_lens back (a device
    # sync per layer per step).
    max_seq_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    num_splits, tokens_per_split = _split_plan(
        num_seqs, num_kv_heads, block_size, max_seq_len, num_splits, q.device
    )
    write_partial = num_splits > 1
    part_out, part_lse = _split_partials(out, num_splits)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        group,
        tokens_per_split,
        window or _NO_WINDOW,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *scales[0].stride()[:2],
        block_tables.stride(0),
        *out.stride()[:2],
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        DOT_IN_FP32=interpret and q.dtype == torch.bfloat16,
        QUANTIZED=k_scale is not None,
        WRITE_PARTIAL=write_partial,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if write_partial:
        _reduce_splits(part_out, part_lse, out, head_dim_pad, interpret)
    return out


def _split_plan(
    num_seqs: int,
    num_kv_heads: int,
    block_size: int,
    max_seq_len: int,
    num_splits: int | None,
    device: torch.device,
) -> tuple[int, int]:
    """(splits per sequence, tokens per split): the forced count or `choose_num_splits`'s, each
    split a whole number of blocks (at least one) covering max_seq_len tokens."""
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(device))
    num_splits = max(1, num_splits)
    # Splits start on block boundaries so no block is read by two programs.
    tokens_per_split = math.ceil(math.ceil(max_seq_len / num_splits) / block_size) * block_size
    return num_splits, max(tokens_per_split, block_size)


def _split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's partial output [num_seqs, num_heads, num_splits, head_dim] and log-sum-exp
    [num_seqs, num_heads, num_splits], float32; with one split, unused placeholders (the kernel
    writes `out` directly, but its arguments need tensors)."""
    num_seqs, num_heads, head_dim = out.shape
    if num_splits == 1:
        return out.new_empty((1, 1, 1, 1), dtype=torch.float32), out.new_empty((1, 1, 1), dtype=torch.float32)
    part_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), device=out.device, dtype=torch.float32
    )
    part_lse = torch.empty((num_seqs, num_heads, num_splits), device=out.device, dtype=torch.float32)
    return part_out, part_lse


def _reduce_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, head_dim_pad: int, interpret: bool
) -> None:
    """Combine the splits' partials into `out` [num_seqs, num_heads, head_dim] (flash-decoding's
    second pass: each split weighted by its share of the log-sum-exp)."""
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    _reduce_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if not interpret else 1,
    )
