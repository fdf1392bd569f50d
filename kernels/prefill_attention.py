"""Triton paged prefill attention: new tokens attend causally over their sequence's cached
prefix plus themselves, a varlen batch packed along the token axis.

One program per (sequence, query head, tile of `BLOCK_M` new tokens). The new tokens' K/V are
already in the pool (`write_kv` ran first), so every key is read through the block table; the
program walks positions 0 .. (last query position of its tile) in tiles of `TILE_N`, with a
causal mask (key position <= query position) and an online softmax in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvtier.kernels.online_softmax import attend_span, load_rows, scale_operands, store_rows

# The window of full attention: q_pos - _NO_WINDOW is below 0 for any int32 position.
_NO_WINDOW = 2**31 - 1
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    group,
    window,
    stride_q_tok,
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
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq, head, m_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(cu_query_lens_ptr + seq)
    query_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = m < query_len
    tokens = (q_start + m).to(tl.int64)
    q = load_rows(
        q_ptr + head * stride_q_head, tokens, stride_q_tok, row_valid, HEAD_DIM, HEAD_DIM_PAD, DOT_IN_FP32
    )
    kv_start, kv_end = _visible_keys(prefix_len, query_len, seq_len, m_tile, window, BLOCK_M)
    result, _, _ = attend_span(
        q,
        kv_start,
        kv_end,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
        (k_ptr + kv_head * stride_k_head, stride_k_block, stride_k_tok),
        (v_ptr + kv_head * stride_v_head, stride_v_block, stride_v_tok),
        (k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_s_block, stride_s_tok),
        qk_scale,
        (prefix_len + m, window),
        HEAD_DIM,
        BLOCK_SIZE,
        TILE_N,
        DOT_IN_FP32,
        QUANTIZED,
    )
    out = result.to(out_ptr.dtype.element_ty)
    store_rows(out_ptr + head * stride_o_head, tokens, stride_o_tok, row_valid, out, HEAD_DIM)


@triton.jit
def _visible_keys(prefix_len, query_len, seq_len, m_tile, window, BLOCK_M: tl.constexpr):
    """The key positions [start, end) a tile of BLOCK_M queries (tile m_tile of a sequence
    whose query_len new tokens follow prefix_len cached ones) may see.

    The end is the tile's last query position (a tile past the query range reads nothing); the
    start is the tile's first query's earliest visible position (0 without a window). Row r sees
    start + r (or 0) first, inside the first key tile as BLOCK_M <= TILE_N: row_max is finite
    after it.
    """
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * BLOCK_M)
    kv_end = tl.where(m_tile * BLOCK_M < query_len, kv_end, 0)
    kv_start = tl.maximum(prefix_len + m_tile * BLOCK_M - window + 1, 0)
    return kv_start, kv_end


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton paged prefill attention; same contract as `kernels.paged_prefill_attention`.

    max_query_len: an upper bound of the per-sequence query lengths, to spare the device->host
    read that sizes the grid otherwise. window: a sliding window in tokens, None for full
    attention; each tile starts at its first query's earliest visible key. Returns [num_query_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    scales = scale_operands(k_scale, v_scale, q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    interpret = os.environ.get("TRITON_INTERPRET") == "1" or q.device.type != "cuda"
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # NOTE: from sm_90 compiles without a GPU: no register spills (fp32 spills at 64 x 64 tiles).
    if interpret:
        block_m, tile_n, num_warps, num_stages = 16, 64, 1, 1
    elif q.dtype == torch.float32 or head_dim_pad > 128:
        block_m, tile_n, num_warps, num_stages = 32, 32, 8, 2
    else:
        block_m, tile_n, num_warps, num_stages = 64, 64, 8, 3
    grid = (num_seqs, num_heads, triton.cdiv(max(max_query_len, 1), block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        block_tables,
        cu_query_lens,
        seq_lens,
        out,
        scale * _LOG2E,
        num_heads // num_kv_heads,
        window or _NO_WINDOW,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        scales[0].stride(0),
        scales[0].stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        DOT_IN_FP32=interpret and q.dtype == torch.bfloat16,
        QUANTIZED=k_scale is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
