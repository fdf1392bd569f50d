"""vLLM's attention KV writes for one layer, as its backends do them: the writes
``block_layout.probe_layout`` learns a cache's layout from inside an engine (``impl.do_kv_cache_update``),
here for the benchmarks and tests that drive the connector's copies without an engine.

- ``CpuWrite``: vLLM's own CPU op (``cpu_attn_reshape_and_cache``, its ISA chosen as vLLM's CPU
  backend chooses it); needs the vLLM CPU build.
- ``FlashWrite``: vLLM 0.32's FlashAttention write (GPU), written in torch as its
  ``do_kv_cache_update`` lays it out: ``[blocks, heads, block_size, 2 x head_dim]``, keys then values
  in the last dim (``kv_cache.transpose(1, 2).split(head_dim, -1)``). vLLM's CUDA build cannot be
  installed on the GPU machine the checks run on, so this stands in for it; no vLLM import.
"""

from __future__ import annotations


class CpuWrite:
    def __init__(self, dtype, block_size: int, head_dim: int):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.block_size = block_size
        self.isa, self.impl = _get_attn_isa(dtype, block_size, head_dim), self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        from vllm import _custom_ops as ops

        view = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], 2 * self.block_size, -1)
        ops.cpu_attn_reshape_and_cache(key, value, *view.chunk(2, dim=2), slot_mapping, self.isa)


class FlashWrite:
    def __init__(self, head_dim: int):
        self.head_dim, self.impl = head_dim, self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_dim, dim=-1)  # [B, N, H, D]
        block_size = kv_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        key_cache[blocks, offsets] = key
        value_cache[blocks, offsets] = value
