"""Triton scatter of new tokens' K/V into their pool slots.

One program per token copies its `[num_kv_heads, head_dim]` K and V (padded to powers of two,
masked) to slot `block_id * block_size + offset` through the cache strides. A negative slot is
padding: the program stores nothing.

(Named kv_write.py, not write_kv.py, so importing it does not rebind `kernels.write_kv`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: block id * block stride overflows int32 on pools of a few GiB.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    keep = (h * 0 + slot) >= 0  # the slot test as a vector: a scalar mask term breaks the interpreter
    mask = (keep & (h < NUM_KV_HEADS))[:, None] & (d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    tl.store(
        k_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_tok
        + h[:, None] * stride_kc_head
        + d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    v = tl.load(v_ptr + token * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    tl.store(
        v_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_tok
        + h[:, None] * stride_vc_head
        + d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton write_kv; same contract as `kernels.write_kv` (in place, negative slot = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
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
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if k.device.type == "cuda" else 1,
    )
