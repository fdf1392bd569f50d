"""The inner step both attention kernels share: fold one tile of paged K/V into a flash-attention
accumulator with an online softmax (fp32, exp2 domain).

A `triton.jit` helper, inlined into each kernel when it compiles; it owns no grid or launch.
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
def attend_tile(
    q,
    acc,
    row_max,
    row_sum,
    k_head,
    v_head,
    block_ids,
    offsets,
    d,
    kv_mask,
    score_mask,
    qk_scale,
    stride_k_block,
    stride_k_tok,
    stride_v_block,
    stride_v_tok,
    k_scale_head,
    v_scale_head,
    stride_s_block,
    stride_s_tok,
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
    token-head at ``*_scale_head + block * stride_s_block + offset * stride_s_tok`` (the K and V
    scale views share strides). A code converts exactly to q's dtype (fp8 and int8 values are
    all representable in fp16/bf16), so K's scales multiply each key's column of scores (in fp32);
    V is dequantized into q's dtype (scaling the weights instead would push small weights into
    fp16's subnormals). Masked positions read block 0's scales, which exist and weigh nothing.
    """
    k = tl.load(
        k_head + block_ids[:, None] * stride_k_block + offsets[:, None] * stride_k_tok + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    scale_at = block_ids * stride_s_block + offsets * stride_s_tok
    if QUANTIZED:
        k = k.to(q.dtype)
    if DOT_IN_FP32:  # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584)
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, TILE_N]
    if QUANTIZED:
        scores = scores * tl.load(k_scale_head + scale_at)[None, :]
    scores = tl.where(score_mask, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    v = tl.load(
        v_head + block_ids[:, None] * stride_v_block + offsets[:, None] * stride_v_tok + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if QUANTIZED:
        v = (v.to(tl.float32) * tl.load(v_scale_head + scale_at)[:, None]).to(q.dtype)
    # Weights rounded to the KV dtype, as tensor cores take them; kept in fp32 on bf16 interpreter.
    p = p.to(v.dtype)
    if DOT_IN_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, new_max, row_sum
