"""The attention hook: a Hugging Face model's attention over kvtier's paged KV pool.

`paged_attention_forward` is registered with transformers' `AttentionInterface` as
`ATTN_IMPLEMENTATION`; a model switched to it (`use_paged_attention`) writes each layer's new
K/V straight into pool blocks (`write_kv`) and attends over the blocks of each sequence with
kvtier's paged kernels. The metadata of one forward (`PagedBatch`) reaches every layer as a model
kwarg, never as hidden state, and carries the lease fence: past its write deadline a layer
raises `LeaseExpired` before it writes. computesvc.model builds the batch and runs the forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from kvtier.kernels import DecodePlans, paged_decode_attention, paged_prefill_attention, write_kv

ATTN_IMPLEMENTATION = "kvtier_paged"


def _no_deadline() -> float:
    return float("inf")


@dataclass
class PagedBatch:
    """Paged metadata of one packed forward, shared by every layer.

    slot_mapping: [num_tokens] int64, pool slot (block_id * block_size + offset) of each token.
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32, tokens in the pool
    after this forward. cu_query_lens: [num_seqs + 1] int32 for prefill, None for decode (one
    token per sequence). k_caches / v_caches: per-layer views [num_blocks, block_size,
    num_kv_heads, head_dim] of the pool. k_scales / v_scales: per-layer views [num_blocks,
    block_size, num_kv_heads] float32 of a quantized pool's scales, else None. max_seq_len /
    max_query_len: host-side bounds the Triton kernels take to spare a device sync.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_query_lens: torch.Tensor | None
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    max_seq_len: int
    max_query_len: int
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None
    # The monotonic time after which this process may no longer hold its blocks (lease fencing),
    # read before every layer's write: a renewal that lands mid-step moves it on.
    write_deadline: Callable[[], float] = _no_deadline
    # The torch path's decode plans of this step (kvtier.kernels.DecodePlans: one per window size,
    # made by the first layer that needs it); None for prefill and on other backends.
    decode_plans: DecodePlans | None = None


class LeaseExpired(RuntimeError):
    """The lease that owns the pool's blocks may have expired: writing now could clobber blocks
    the cache service has given to someone else, so the forward stops before its next write."""


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvtier_batch: PagedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the pool (`AttentionInterface` contract).

    query [1, num_heads, T, head_dim], key/value [1, num_kv_heads, T, head_dim] after RoPE.
    Writes this layer's K/V of the T tokens into the pool, then attends: over the layer's last
    `sliding_window` positions when transformers passes one (Mistral; Qwen2's windowed layers),
    else over the whole context. Returns
    ([1, T, num_heads, head_dim], None) like transformers' eager attention.
    """
    if kvtier_batch is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention runs only under ModelRunner (no kvtier_batch given)"
        )
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = module.scaling if scaling is None else scaling
    # transformers passes each layer's own window (None on full-attention layers of mixed models).
    window = kwargs.get("sliding_window")
    out = attend(kvtier_batch, module.layer_idx, q, k, v, scale, int(window) if window else None)
    return out.unsqueeze(0), None


def attend(
    batch: PagedBatch,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One layer's paged attention: q [T, num_heads, head_dim], k and v [T, num_kv_heads,
    head_dim] of the batch's T new tokens after RoPE. Checks the lease fence, writes k and v into
    the layer's pool blocks, then attends over each sequence's blocks (its last `window` positions
    when given). Returns [T, num_heads, head_dim]."""
    k_cache, v_cache = batch.k_caches[layer], batch.v_caches[layer]
    # NOTE: checked before every layer's write, so a process paused mid-forward (stalled, or
    # SIGSTOPped) past its lease never writes into blocks the cache may have reassigned.
    late_s = time.monotonic() - batch.write_deadline()
    if late_s > 0:
        raise LeaseExpired(
            f"lease deadline passed {late_s:.2f}s before layer {layer}'s KV write (no renewal in time); "
            "the step is abandoned"
        )
    scales = {}
    if batch.k_scales is not None and batch.v_scales is not None:
        scales = {"k_scale": batch.k_scales[layer], "v_scale": batch.v_scales[layer]}
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping, **scales)
    if batch.cu_query_lens is None:
        plan = None if batch.decode_plans is None else batch.decode_plans.get(window)
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            scale,
            max_seq_len=batch.max_seq_len,
            window=window,
            plan=plan,
            **scales,
        )
    return paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        batch.block_tables,
        batch.cu_query_lens,
        batch.seq_lens,
        scale,
        max_query_len=batch.max_query_len,
        window=window,
        **scales,
    )


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def use_paged_attention(model: PreTrainedModel) -> None:
    """Route the model's attention to kvtier's paged kernels; it then runs only under ModelRunner."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
