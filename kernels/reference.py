"""Torch implementations of the paged kernels: the CPU path and the reference the Triton kernels
are tested against.

All three read and write the pool through per-layer views shaped
`[num_blocks, block_size, num_kv_heads, head_dim]` with any block stride (the block-major pool
gives `pool[:, layer, 0]` / `pool[:, layer, 1]`). Attention math is done in fp32 and the result
is cast back to the query's dtype.

A quantized cache (fp8_e4m3, fp8_e5m2, int8: kvtier.kv_dtypes) comes with its scales, views
`[num_blocks, block_size, num_kv_heads]` float32 (`pool.scales[:, layer, 0]`): `write_kv_ref`
quantizes each token-head with the scale absmax / qmax (`quantize_ref`), and the attention
functions read `stored.float() * scale`.

`paged_decode_attention_ref` runs every decode step of the compute service on CPU, so it is
vectorized over sequences (no loop per sequence): the blocks of every sequence are gathered whole
(`index_select` of block rows, a plain memcpy per block) into a reused workspace (fresh multi-MiB
buffers would cost page faults on every step) and attended by SDPA's flash CPU kernel in one
call, the query heads of each KV head taken as that head's queries. Both attention functions
run SDPA on 4-d inputs: on 3-d ones it falls back to its math path, which materialises the
scores (measured in bench/README.md, "Compute against vLLM's CPU engine").
"""

from __future__ import annotations

import math
import threading

import torch

from kvtier import kv_dtypes
from kvtier.kernels.decode_plan import DecodePlan, SharedPrefixes, additive_mask, plan_decode


class _Workspace(threading.local):
    """Per-thread scratch buffers, reused across calls so a decode step allocates (and page-faults)
    nothing proportional to the context. One flat buffer per (device, dtype, slot, inference mode),
    grown on demand: a buffer made under `torch.inference_mode` may not be written outside it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype, str, bool], torch.Tensor] = {}

    def get(
        self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (device, dtype, slot, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_workspace = _Workspace()


def quantize_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` [..., head_dim] per row to the quantized torch `dtype` (int8, float8_*).

    Returns (stored [..., head_dim] in `dtype`, scale [...] float32) with scale = absmax / qmax, so
    the row's largest magnitude maps to qmax; an all-zero row gets scale 0 (it reads back as 0).
    int8 rounds half up (floor(x + 0.5), as the Triton kernel does); fp8 rounds to nearest even in
    the cast.
    """
    entry = kv_dtypes.of_torch(dtype)
    xf = x.float()
    scales = xf.abs().amax(-1) / entry.qmax
    scaled = xf / torch.where(scales > 0, scales, 1.0)[..., None]
    if not dtype.is_floating_point:
        scaled = torch.floor(scaled + 0.5)
    return scaled.clamp(-entry.qmax, entry.qmax).to(dtype), scales


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    q: [num_seqs, num_heads, head_dim]. k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]. block_tables: [num_seqs, max_blocks] int32 block ids (entries past a sequence's
    length are ignored). seq_lens: [num_seqs] int32 context length in tokens, the new token
    included; 0 marks a padding row whose output is zeros. Query head h reads KV head
    h // (num_heads // num_kv_heads). k_scale, v_scale: [num_blocks, block_size, num_kv_heads]
    float32 for a quantized cache, else None. window: a sliding window in tokens (the query reads
    only its last `window` positions, itself included; table entries of blocks wholly before it
    may be placeholders, any id: they are never attended), None for full attention. plan: the
    step's `decode_plan.plan_decode` of these tables, lengths and window, made once for all
    layers (built here when None). Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if plan is None:
        tables, lens = block_tables.tolist(), seq_lens.tolist()
        plan = plan_decode(tables, lens, block_size, q.device, window, num_blocks_total)
    if max(plan.lens, default=0) == 0:
        return torch.zeros_like(q)
    k = _gather_blocks(k_cache, plan.ids, num_seqs, k_scale, "k").float()  # [S, T, Hkv, D]
    v = _gather_blocks(v_cache, plan.ids, num_seqs, v_scale, "v").float()  # no copy when fp32
    # NOTE: the G query heads sharing a KV head are that head's "query tokens" (one KV read per KV
    # head, no repeat), through SDPA's flash CPU kernel over the gathered blocks: one fused pass,
    # no scores in memory. A padding row (no visible key) would give NaN: it is zeroed below.
    queries = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    if plan.shared is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            queries,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=plan.bias,
            scale=scale,
        )  # [S, Hkv, G, D]
        out = o.reshape(num_seqs, num_heads, head_dim)
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.bias, scale=scale
        )
        if plan.alone_empty is not None:  # no key of its own: the kernel's log-sum-exp reads 0
            lse.masked_fill_(plan.alone_empty, float("-inf"))
        own = o.reshape(num_seqs, num_heads, head_dim), lse.reshape(num_seqs, num_heads)
        out = _merge(own, _attend_prefixes(queries, k_cache, v_cache, plan.shared, k_scale, v_scale, scale))
    out = out.to(q.dtype)
    if min(plan.lens) == 0:
        lens = torch.tensor(plan.lens, device=q.device)
        out.masked_fill_((lens == 0)[:, None, None], 0.0)
    return out


def _attend_prefixes(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared: SharedPrefixes,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's prefix attended once by the query heads of all its members: returns, per
    sequence, the output [S, H, D] and log-sum-exp [S, H] over its group's prefix (zeros and
    -inf for a sequence in no group)."""
    num_seqs, num_kv_heads, group, head_dim = queries.shape
    groups, members = shared.groups, shared.members
    k = _gather_blocks(k_cache, shared.ids, groups, k_scale, "pk").float()  # [groups, P, Hkv, D]
    v = _gather_blocks(v_cache, shared.ids, groups, v_scale, "pv").float()
    rows = queries[shared.rows].view(groups, members, num_kv_heads, group, head_dim)
    rows = rows.transpose(1, 2).reshape(groups, num_kv_heads, members * group, head_dim)
    bias = shared.bias
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )  # [groups, Hkv, members * G, D], [groups, Hkv, members * G]
    o = o.view(groups, num_kv_heads, members, group, head_dim).transpose(1, 2)
    lse = lse.view(groups, num_kv_heads, members, group).transpose(1, 2)
    num_heads = num_kv_heads * group
    out = queries.new_zeros(num_seqs, num_heads, head_dim)
    out[shared.seqs] = o.reshape(-1, num_heads, head_dim)[shared.real]
    out_lse = queries.new_full((num_seqs, num_heads), float("-inf"))
    out_lse[shared.seqs] = lse.reshape(-1, num_heads)[shared.real]
    return out, out_lse


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output [S, H, D] and
    log-sum-exp [S, H] (-inf: that set is empty)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp_(), (lse_b - top).exp_()
    total = w_a + w_b
    return out_a * (w_a / total)[..., None] + out_b * (w_b / total)[..., None]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over each sequence's cached prefix plus
    themselves.

    q: [num_query_tokens, num_heads, head_dim], the new tokens of all sequences packed in order.
    cu_query_lens: [num_seqs + 1] int32 cumulative query lengths (starts at 0). seq_lens:
    [num_seqs] int32 total tokens of each sequence (cached prefix + new). The new tokens' K/V
    must already be in the cache (`write_kv`). Query j of sequence i sits at position
    seq_lens[i] - query_len_i + j and attends to positions <= its own. k_scale, v_scale: as
    `paged_decode_attention_ref`'s. window: a sliding window in tokens (query at position p reads
    positions p - window + 1 .. p; blocks wholly before the first query's window are not read),
    None for full attention. Returns [num_query_tokens, num_heads, head_dim] in q's dtype.
    """
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = cu_query_lens.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(device=q.device, dtype=torch.long)
    masks: dict[tuple[int, int, int], torch.Tensor | None] = {}  # equal shapes share a mask
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        # The keys read start at the block holding the first query's earliest visible position.
        first = max(0, seq_len - query_len - window + 1) // block_size * block_size if window else 0
        blocks = tables[i, first // block_size : -(-seq_len // block_size)]
        k = _read_tokens(k_cache, k_scale, blocks, seq_len - first, "k")  # [L, Hkv, D] fp32
        v = _read_tokens(v_cache, v_scale, blocks, seq_len - first, "v")
        qi = q[q_start:q_end].float().transpose(0, 1)[None]  # [1, H, Q, D]
        key = (seq_len, query_len, first)
        if key not in masks:
            masks[key] = _prefill_mask(seq_len, query_len, first, window, q.device)
        mask = masks[key]
        # NOTE: SDPA's flash CPU kernel (it takes only 4-d inputs: 3-d ones fall back to the math
        # path, which materialises the scores) instead of explicit scores + softmax: same fp32
        # math, this is the CPU path of every prefill. A whole prompt needs no mask (is_causal).
        o = torch.nn.functional.scaled_dot_product_attention(
            qi,
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )  # [1, H, Q, D]
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new tokens' K/V into their pool slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim]. slot_mapping: [num_tokens] int, slot =
    block_id * block_size + offset in the block; a negative slot skips that token (padding).
    A quantized cache (k_scale, v_scale given) stores `quantize_ref` of each token-head.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k.device, dtype=torch.long)
    if slots.numel() and int(slots.min()) < 0:  # padding: filtered only when there is some
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for new, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scales is None:
            cache[blocks, offsets] = new.to(cache.dtype)
        else:
            cache[blocks, offsets], scales[blocks, offsets] = quantize_ref(new, cache.dtype)


def _prefill_mask(
    seq_len: int, query_len: int, first: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The additive mask [Q, L] (0 / -inf) of `query_len` new tokens ending a sequence of
    `seq_len` over its keys from position `first`: causal, and within `window` when given. None
    for a whole prompt without a window (SDPA's is_causal does it)."""
    if not window and query_len == seq_len:
        return None
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    k_pos = torch.arange(first, seq_len, device=device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return additive_mask(visible)


def _read_tokens(
    cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, num_tokens: int, slot: str
) -> torch.Tensor:
    """The first `num_tokens` tokens of the cache's `blocks`, [num_tokens, num_kv_heads, head_dim]
    fp32 (dequantized when `scales` are given), in the workspace `slot` (`_gather_blocks`)."""
    return _gather_blocks(cache, blocks, 1, scales, slot)[0, :num_tokens].float()


def _gather_blocks(
    cache: torch.Tensor, ids: torch.Tensor, num_seqs: int, scales: torch.Tensor | None, slot: str
) -> torch.Tensor:
    """The blocks `ids` ([num_seqs * n] block ids, sequence-major) of a cache as
    `[num_seqs, n * block_size, num_kv_heads, head_dim]`, in a workspace buffer that the next call
    with the same `slot` overwrites: the cache's dtype when it is a model dtype, else fp32
    dequantized with `scales` ([num_blocks, block_size, num_kv_heads]).

    A block whose `[block_size, num_kv_heads, head_dim]` is dense is one row of a
    `[num_blocks, block_elements]` view of the cache, so the gather is one memcpy per block."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    tokens = ids.numel() // num_seqs * block_size
    strides = cache.stride()
    if strides[3] == 1 and strides[2] == head_dim and strides[1] == num_kv_heads * head_dim:
        block_elements = block_size * num_kv_heads * head_dim
        rows = torch.as_strided(cache, (cache.shape[0], block_elements), (strides[0], 1))
        blocks = _workspace.get(slot, (ids.numel(), block_elements), cache.dtype, cache.device)
        torch.index_select(rows, 0, ids, out=blocks)
    else:  # any other strided cache: advanced indexing, slower but always valid
        blocks = cache[ids]
    natural = blocks.view(num_seqs, tokens, num_kv_heads, head_dim)
    if scales is None:
        return natural
    per_token = scales[ids].view(num_seqs, tokens, num_kv_heads, 1)
    return natural.float().mul_(per_token)
