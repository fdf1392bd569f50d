"""kvtier's paged-attention kernels and the one dispatcher the model code calls.

    from kvtier.kernels import paged_decode_attention, paged_prefill_attention, write_kv, backend

Where the work runs (`backend(device)` says which):
- "triton": tensors on a CUDA device -> the Triton kernels (decode_attention.py, kv_write.py,
  prefill_attention.py).
- "triton-interpreter": `TRITON_INTERPRET=1` in the environment -> the same Triton kernels run by
  Triton's CPU interpreter (slow; for tests with tiny shapes). The variable must be set before
  the kernel modules are first imported, which this package defers to the first call.
- "torch": anything else, CPU tensors by default -> the torch implementations in reference.py.

The pool is read through per-layer views `[num_blocks, block_size, num_kv_heads, head_dim]` with
any block stride (`pool[:, layer, 0]` / `pool[:, layer, 1]` of the block-major pool); the last
dimension must be contiguous. A quantized cache (fp8_e4m3, fp8_e5m2, int8; kvtier.kv_dtypes)
comes with `k_scale` / `v_scale`, float32 views `[num_blocks, block_size, num_kv_heads]` (any
block stride, the rest dense) holding one scale per token-head: writes quantize, reads dequantize
(reference.quantize_ref), and the queries may be any model dtype.

NOTE: transformers probes for a hub package whose import name is also `kernels`. It finds this
one, maps it to the `kvtier` distribution and rejects its version, so it never imports from us.
Do not give this package a `__version__`: transformers would read it as the hub package's.
The Triton write kernel lives in kv_write.py, not write_kv.py: importing a submodule binds it as
an attribute of the package, which would replace the exported `write_kv` function.
"""

from __future__ import annotations

import os

import torch

from kvtier import kv_dtypes
from kvtier.kernels.decode_plan import DecodePlan, DecodePlans
from kvtier.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

__all__ = ["DecodePlans", "backend", "paged_decode_attention", "paged_prefill_attention", "write_kv"]

_DTYPES = tuple(kv_dtypes.torch_dtype(name) for name in kv_dtypes.MODEL_DTYPES)
_QUANTIZED = tuple(kv_dtypes.torch_dtype(name) for name in kv_dtypes.QUANTIZED_DTYPES)


def backend(device: torch.device | str | None = None) -> str:
    """The implementation that serves tensors on `device`: "triton", "triton-interpreter" or
    "torch". With no device, the one serving the default device (CUDA if present, else CPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "triton-interpreter"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "triton" if torch.device(device).type == "cuda" else "torch"


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (MHA, GQA, MQA).

    q: [num_seqs, num_heads, head_dim]. k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], same dtype as q (fp32, fp16 or bf16), or quantized with k_scale /
    v_scale (module doc). block_tables:
    [num_seqs, max_blocks] int32, the block ids of each sequence in order (entries past its
    length are never read). seq_lens: [num_seqs] int32, context length in tokens including the
    new token, whose K/V must already be written; 0 marks a padding row (output zeros).
    scale: softmax scale, usually head_dim ** -0.5. Query head h reads KV head
    h // (num_heads // num_kv_heads). window: sliding window in tokens (the query reads its last
    `window` positions; table entries of blocks wholly before them may be placeholders), None
    for full attention.

    Torch only: plan, the step's `DecodePlans.get(window)` for these tables and lengths (what
    each layer reads, worked out once per step; made here when None).
    Triton only: num_splits forces the flash-decoding split count (default: a heuristic from
    batch and context length); max_seq_len, an upper bound of seq_lens, sizes the splits
    (default: max_blocks * block_size of block_tables, read without a device sync).
    Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    _check_cache(q, k_cache, v_cache, num_query_heads=q.shape[1] if q.dim() == 3 else 0)
    _check_scales(k_cache, k_scale, v_scale)
    _check_window(window)
    _check_index("block_tables", block_tables, 2, q.device)
    _check_index("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            f"one row per sequence of q ({q.shape[0]})"
        )
    kind = backend(q.device)
    if kind == "torch":
        return paged_decode_attention_ref(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, plan
        )
    from kvtier.kernels import decode_attention

    return decode_attention.paged_decode_attention(
        _contiguous_last(q),
        k_cache,
        v_cache,
        _contiguous_last(block_tables),
        seq_lens.contiguous(),
        scale,
        num_splits=num_splits,
        max_seq_len=max_seq_len,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
    )


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
    """Causal attention of new tokens over their sequence's cached prefix plus themselves.

    q: [num_query_tokens, num_heads, head_dim], the new tokens of all sequences packed in order.
    cu_query_lens: [num_seqs + 1] int32 cumulative query lengths, starting at 0. seq_lens:
    [num_seqs] int32 total tokens per sequence (cached prefix + new). The new tokens' K/V must
    already be in the cache (`write_kv`): every key is read through block_tables
    [num_seqs, max_blocks] int32. Query j of sequence i sits at position
    seq_lens[i] - query_len_i + j and attends to positions <= its own (and, with a sliding
    `window` in tokens, > its own - window; None for full attention).
    Triton only: max_query_len, an upper bound of the query lengths, spares a device sync.
    k_scale, v_scale: a quantized cache's scales (module doc). Returns [num_query_tokens, num_heads, head_dim] in q's dtype.
    """
    _check_cache(q, k_cache, v_cache, num_query_heads=q.shape[1] if q.dim() == 3 else 0)
    _check_scales(k_cache, k_scale, v_scale)
    _check_window(window)
    _check_index("block_tables", block_tables, 2, q.device)
    _check_index("cu_query_lens", cu_query_lens, 1, q.device)
    _check_index("seq_lens", seq_lens, 1, q.device)
    num_seqs = seq_lens.shape[0]
    if cu_query_lens.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"cu_query_lens {tuple(cu_query_lens.shape)} must have num_seqs + 1 = {num_seqs + 1} entries "
            f"and block_tables {tuple(block_tables.shape)} {num_seqs} rows"
        )
    kind = backend(q.device)
    if kind == "torch":
        return paged_prefill_attention_ref(
            q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, k_scale, v_scale, window
        )
    from kvtier.kernels import prefill_attention

    return prefill_attention.paged_prefill_attention(
        _contiguous_last(q),
        k_cache,
        v_cache,
        _contiguous_last(block_tables),
        cu_query_lens.contiguous(),
        seq_lens.contiguous(),
        scale,
        max_query_len=max_query_len,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
    )


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
    """Scatter new tokens' K/V into their pool slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim] (cast to the cache dtype, or quantized per
    token-head into a quantized cache, whose scales k_scale / v_scale receive). k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]. slot_mapping: [num_tokens] int32 or int64,
    slot = block_id * block_size + offset in the block; a negative slot skips the token (padding).
    Slots must be < num_blocks * block_size: the Triton path does not check (that would cost a
    device sync), as block ids in block_tables are trusted by the attention kernels.
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [num_tokens, num_kv_heads, head_dim]"
        )
    _check_cache(k, k_cache, v_cache, num_query_heads=None)
    _check_scales(k_cache, k_scale, v_scale)
    _check_index("slot_mapping", slot_mapping, 1, k.device, dtypes=(torch.int32, torch.int64))
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    if backend(k.device) == "torch":
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from kvtier.kernels import kv_write

    kv_write.write_kv(
        _contiguous_last(k),
        _contiguous_last(v),
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _check_cache(
    x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_query_heads: int | None
) -> None:
    """Shapes, dtypes and devices of a query (or new K) against the two caches.
    num_query_heads: None for new K/V (heads must equal the cache's), else the query heads,
    which must be a multiple of the cache's KV heads."""
    if x.dim() != 3:
        raise ValueError(f"expected [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    _, _, num_kv_heads, head_dim = k_cache.shape
    if x.shape[2] != head_dim:
        raise ValueError(f"head_dim {x.shape[2]} does not match the cache's {head_dim}")
    if num_query_heads is None:
        if x.shape[1] != num_kv_heads:
            raise ValueError(f"{x.shape[1]} KV heads given, the cache holds {num_kv_heads}")
    elif num_query_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_query_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    quantized = k_cache.dtype in _QUANTIZED
    if num_query_heads is not None and x.dtype != k_cache.dtype and not quantized:
        raise ValueError(f"q dtype {x.dtype} differs from the cache dtype {k_cache.dtype}")
    if x.dtype not in _DTYPES:
        raise ValueError(
            f"{'q' if num_query_heads is not None else 'k'} dtype {x.dtype}; supported: {_DTYPES}"
        )
    if k_cache.dtype not in _DTYPES + _QUANTIZED or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype}; supported: {_DTYPES + _QUANTIZED}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim axis must be contiguous (stride 1)")
    if not (x.device == k_cache.device == v_cache.device):
        raise ValueError(f"tensors on different devices: {x.device}, {k_cache.device}, {v_cache.device}")


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """A quantized cache needs both scale views, shaped [num_blocks, block_size, num_kv_heads]
    float32 on its device with dense token and head axes; any other cache takes none."""
    if k_cache.dtype not in _QUANTIZED:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} cache takes no scales (only {_QUANTIZED} do)")
        return
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None:
            raise ValueError(f"a {k_cache.dtype} cache needs {name} (one float32 scale per token-head)")
        dense = scales.dim() == 3 and scales.stride(2) == 1 and scales.stride(1) == scales.shape[2]
        if scales.shape != k_cache.shape[:3] or scales.dtype != torch.float32 or not dense:
            raise ValueError(
                f"{name} must be float32 {tuple(k_cache.shape[:3])} (blocks, block_size, kv heads) with "
                f"dense token and head axes, got {scales.dtype} {tuple(scales.shape)} strides {scales.stride()}"
            )
        if scales.device != k_cache.device:
            raise ValueError(f"{name} is on {scales.device}, the cache on {k_cache.device}")


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1 (tokens), got {window!r}")


def _check_index(
    name: str,
    t: torch.Tensor,
    dim: int,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.int32,),
) -> None:
    if t.dim() != dim or t.dtype not in dtypes or t.device != device:
        raise ValueError(
            f"{name} must be a {dim}-d tensor of {'/'.join(str(d) for d in dtypes)} on {device}, "
            f"got {t.dim()}-d {t.dtype} on {t.device}"
        )


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels assume a unit stride on the last axis; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()
