"""The inner step both attention kernels share: fold one tile of paged K/V into a flash-attention
accumulator with an online softmax (fp32, exp2 domain).

A `triton.jit` helper, inlined into each kernel when it compiles; it owns no grid or launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    DOT_IN_FP32: tl.constexpr,
):
    """Fold a tile of keys/values into ``(acc, row_max, row_sum)`` and return the new three.

    q: [ROWS, HEAD_DIM_PAD] queries (already fp32 when DOT_IN_FP32). block_ids, offsets:
    [TILE_N] pool block and slot of each key position; kv_mask: [TILE_N, HEAD_DIM_PAD] what to
    load; score_mask: broadcastable to [ROWS, TILE_N], the scores that count. qk_scale includes
    log2(e). A row must see a finite score by its first tile, so row_max is finite from then on;
    a fully masked row in a later tile adds exp2(-inf) = 0.
    """
    k = tl.load(
        k_head + block_ids[:, None] * stride_k_block + offsets[:, None] * stride_k_tok + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if DOT_IN_FP32:  # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584)
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, TILE_N]
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
    # Weights rounded to the KV dtype, as tensor cores take them; kept in fp32 on bf16 interpreter.
    p = p.to(v.dtype)
    if DOT_IN_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, new_max, row_sum
