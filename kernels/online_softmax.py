"""The steps both attention kernels share: load a tile of rows, walk a span of paged K/V folding
each tile into a flash-attention accumulator with an online softmax (fp32, exp2 domain), store.

`triton.jit` helpers, inlined into each kernel when it compiles; they own no grid or launch.
A paged view is a tuple (base pointer at the KV head, block stride, token stride); the K and V
scales share one view (base pointers of both, their common strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scale_operands(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale views an attention kernel takes: a quantized cache's own, else one float32 of
    filler each (QUANTIZED is off and nothing reads them)."""
    if k_scale is not None and v_scale is not None:
        if k_scale.stride()[:2] != v_scale.stride()[:2]:
            raise ValueError(f"k_scale strides {k_scale.stride()} differ from v_scale's {v_scale.stride()}")
        return k_scale, v_scale
    filler = torch.empty((1, 1, 1), dtype=torch.float32, device=device)
    return filler, filler


@triton.jit
def load_rows(
    base,
    rows,
    row_stride,
    row_mask,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """[len(rows), HEAD_DIM_PAD] values at ``base + row * row_stride + column`` (masked rows and
    the padding columns read 0); fp32 when DOT_IN_FP32 (the bf16 interpreter's tl.dot)."""
    d = tl.arange(0, HEAD_DIM_PAD)
    values = tl.load(
        base + rows[:, None] * row_stride + d[None, :],
        mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        values = values.to(tl.float32)
    return values


@triton.jit
def store_rows(base, rows, row_stride, row_mask, values, HEAD_DIM: tl.constexpr):
    """Store values [len(rows), HEAD_DIM_PAD] at ``base + row * row_stride + column``, the
    masked rows and the padding columns left alone."""
    d = tl.arange(0, values.shape[1])
    tl.store(
        base + rows[:, None] * row_stride + d[None, :],
        values,
        mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
    )


@triton.jit
def log_sum_exp(row_max, row_sum):
    """log2 of each row's softmax denominator (exp2 domain); -inf for a row that saw no key."""
    has_tokens = row_sum > 0
    return tl.where(has_tokens, row_max + tl.log2(tl.where(has_tokens, row_sum, 1.0)), float("-inf"))


@triton.jit
def attend_span(
    q,
    start,
    end,
    block_table,
    k_view,
    v_view,
    scale_view,
    qk_scale,
    causal,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Attend q [ROWS, HEAD_DIM_PAD] over key positions [start, end) in tiles of TILE_N; return
    (normalized output [ROWS, HEAD_DIM_PAD] fp32, row_max [ROWS], row_sum [ROWS]).

    block_table: the sequence's row of the block table (BLOCK_SIZE positions per block).
    causal: None (every key of the span is visible to every row) or (q_pos [ROWS], window): row r
    sees keys at positions in (q_pos[r] - window, q_pos[r]]. A row that sees no key (an empty
    span) has row_sum 0 and a zero output.
    """
    d = tl.arange(0, q.shape[1])
    d_mask = d < HEAD_DIM
    row_max = tl.full([q.shape[0]], float("-inf"), tl.float32)
    row_sum = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        # int64: block id * block stride overflows int32 on pools of a few GiB.
        block_ids = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        score_mask = valid[None, :]
        if causal is not None:
            q_pos = causal[0]
            seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - causal[1])
            score_mask = score_mask & seen
        acc, row_max, row_sum = attend_tile(
            q,
            acc,
            row_max,
            row_sum,
            k_view,
            v_view,
            scale_view,
            block_ids,
            pos % BLOCK_SIZE,
            d,
            valid[:, None] & d_mask[None, :],
            score_mask,
            qk_scale,
            DOT_IN_FP32,
            QUANTIZED,
        )
    result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    return result, row_max, row_sum


@triton.jit
def attend_tile(
    q,
    acc,
    row_max,
    row_sum,
    k_view,
    v_view,
    scale_view,
    block_ids,
    offsets,
    d,
    kv_mask,
    score_mask,
    qk_scale,
    DOT_IN_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Fold a tile of keys/values into ``(acc, row_max, row_sum)`` and return the new three.

    q: [ROWS, HEAD_DIM_PAD] queries (already fp32 when DOT_IN_FP32). block_ids, offsets:
    [TILE_N] pool block and slot of each key position; kv_mask: [TILE_N, HEAD_DIM_PAD] what to
    load; score_mask: broadcastable to [ROWS, TILE_N], the scores that count. qk_scale includes
    log2(e). A row must see a finite score by its first tile, so row_max is finite from then on;
    a fully masked row in a later tile adds exp2(-inf) = 0.

    QUANTIZED: K/V hold one-byte codes whose value is code * scale, one float32 scale per
    token-head at ``scale base + block * block stride + offset * token stride`` (scale_view; the
    K and V scales share strides). A code converts exactly to q's dtype (fp8 and int8 values are
    all representable in fp16/bf16), so K's scales multiply each key's column of scores (in fp32);
    V is dequantized into q's dtype (scaling the weights instead would push small weights into
    fp16's subnormals). Masked positions read block 0's scales, which exist and weigh nothing.
    """
    k = tl.load(
        k_view[0] + block_ids[:, None] * k_view[1] + offsets[:, None] * k_view[2] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    scale_at = block_ids * scale_view[2] + offsets * scale_view[3]
    if QUANTIZED:
        k = k.to(q.dtype)
    if DOT_IN_FP32:  # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584)
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, TILE_N]
    if QUANTIZED:
        scores = scores * tl.load(scale_view[0] + scale_at)[None, :]
    scores = tl.where(score_mask, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    v = tl.load(
        v_view[0] + block_ids[:, None] * v_view[1] + offsets[:, None] * v_view[2] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if QUANTIZED:
        v = (v.to(tl.float32) * tl.load(scale_view[1] + scale_at)[:, None]).to(q.dtype)
    # Weights rounded to the KV dtype, as tensor cores take them; kept in fp32 on bf16 interpreter.
    p = p.to(v.dtype)
    if DOT_IN_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, new_max, row_sum
