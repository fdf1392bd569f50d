"""Triton scatter of new tokens' K/V into their pool slots.

One program per token copies its `[num_kv_heads, head_dim]` K and V (padded to powers of two,
masked) to slot `block_id * block_size + offset` through the cache strides. A negative slot is
padding: the program stores nothing. Into a quantized cache (QUANTIZED) each token-head is stored
as codes of `x / scale` with scale = absmax / QMAX, and the scale goes to the scale view, as
`kernels.reference.quantize_ref` does.

(Named kv_write.py, not write_kv.py, so importing it does not rebind `kernels.write_kv`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier import kv_dtypes
from kvtier.kernels.online_softmax import scale_operands


@triton.jit
def _store_token(
    x,
    cache_ptr,
    scale_ptr,
    cache_at,
    scale_at,
    mask,
    head_mask,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    INTEGER: tl.constexpr,
):
    """Store one token's [HEADS_PAD, HEAD_DIM_PAD] tile `x` at `cache_at` (masked), quantized per
    head with its scale at `scale_at` when QUANTIZED."""
    if QUANTIZED:
        xf = x.to(tl.float32)
        scale = tl.max(tl.abs(xf), 1) / QMAX  # [HEADS_PAD]; padding lanes load 0
        scaled = xf / tl.where(scale > 0, scale, 1.0)[:, None]
        if INTEGER:
            scaled = tl.floor(scaled + 0.5)
        scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
        if INTEGER:
            codes = scaled.to(cache_ptr.dtype.element_ty)
        else:
            codes = scaled.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(cache_ptr + cache_at, codes, mask=mask)
        tl.store(scale_ptr + scale_at, scale, mask=head_mask)
    else:
        tl.store(cache_ptr + cache_at, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    stride_s_block,
    stride_s_tok,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    INTEGER: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: block id * block stride overflows int32 on pools of a few GiB.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    keep = (h * 0 + slot) >= 0  # the slot test as a vector: a scalar mask term breaks the interpreter
    head_mask = keep & (h < NUM_KV_HEADS)
    mask = head_mask[:, None] & (d[None, :] < HEAD_DIM)
    scale_at = block * stride_s_block + offset * stride_s_tok + h

    k = tl.load(k_ptr + token * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask, other=0.0)
    k_at = block * stride_kc_block + offset * stride_kc_tok + h[:, None] * stride_kc_head + d[None, :]
    _store_token(k, k_cache_ptr, k_scale_ptr, k_at, scale_at, mask, head_mask, QUANTIZED, QMAX, INTEGER)
    v = tl.load(v_ptr + token * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask, other=0.0)
    v_at = block * stride_vc_block + offset * stride_vc_tok + h[:, None] * stride_vc_head + d[None, :]
    _store_token(v, v_cache_ptr, v_scale_ptr, v_at, scale_at, mask, head_mask, QUANTIZED, QMAX, INTEGER)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton write_kv; same contract as `kernels.write_kv` (in place, negative slot = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    scales = scale_operands(k_scale, v_scale, k.device)
    entry = kv_dtypes.of_torch(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        scales[0].stride(0),
        scales[0].stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        QUANTIZED=entry.needs_scales,
        QMAX=entry.qmax or 1.0,
        INTEGER=not k_cache.dtype.is_floating_point,
        num_warps=4 if k.device.type == "cuda" else 1,
    )
