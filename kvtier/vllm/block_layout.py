"""vLLM's KV block layout against kvtier's, and the batched copies between them.

kvtier's pool block is ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``. A vLLM
attention layer's cache is ``[num_blocks, ...]`` with a layout of its attention backend's own
choosing: on CPU, ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` whose K half is stored
per ISA (the ``vec`` kernels keep K transposed, ``[head_dim, block_size]``, V as is). Rather than
encode each backend's layout here, it is learned at startup from the backend's own write
(``impl.do_kv_cache_update``, what the model runs to store K and V): known codes are written into
vLLM's null block (block 0, never given to a request; its bytes are put back) and read back, which
gives, for every element of a vLLM block, the kvtier position it holds. A write that is not a
one-to-one move of elements (a quantized cache, a backend that writes elsewhere) is refused.

Copies are batched over blocks and done per layer, never per token; on a GPU they run device to
device. Blocks whose ids run consecutively on both sides (what a fresh request gets from vLLM's
free list and from the pool, most of the time) are copied in one pass straight from one tensor
into the other through strided views (``runs``); scattered ids go through index ops (index_select,
the permutation, index_copy_), which cost two more passes over the bytes.
"""

from __future__ import annotations

import math

import torch


class UnknownLayout(RuntimeError):
    """vLLM's write is not a permutation of kvtier's block elements (the message says what was seen)."""


def _digits(codes: torch.Tensor, place: int) -> torch.Tensor:
    """Base-256 digit ``place`` of ``codes``, plus one (so an unwritten 0 is told apart): 1..256,
    exact in every float dtype vLLM stores KV in (bfloat16 holds integers up to 256 exactly)."""
    return ((codes >> (8 * place)) & 255) + 1


def probe_layout(
    layer: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
):
    """The permutation from one vLLM block of ``kv_cache`` (flattened in its logical order) to a
    kvtier layer block ``[2, block_size, num_kv_heads, head_dim]`` (flattened): ``kvtier =
    vllm[gather]``. ``layer`` is vLLM's attention module of that cache (its ``impl`` writes it)."""
    block = kv_cache[0]
    elements = 2 * block_size * num_kv_heads * head_dim
    if block.numel() != elements:
        raise UnknownLayout(
            f"a vLLM KV block of this layer has {block.numel()} elements, kvtier's has {elements} "
            f"(2 x {block_size} tokens x {num_kv_heads} heads x {head_dim}): a quantized or padded cache"
        )
    device = kv_cache.device
    codes = torch.arange(elements, device=device).view(2, block_size, num_kv_heads, head_dim)
    slots = torch.arange(block_size, device=device, dtype=torch.int64)  # every slot of block 0
    saved = block.clone()
    found = torch.zeros(elements, dtype=torch.int64, device=device)
    try:
        for place in range(math.ceil(math.log(elements, 256)) or 1):
            block.zero_()
            key, value = (_digits(codes[i], place).to(kv_cache.dtype) for i in (0, 1))
            layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
            read = kv_cache[0].reshape(-1).to(torch.float64) - 1
            if not bool(((read >= 0) & (read <= 255) & (read == read.round())).all()):
                raise UnknownLayout(
                    f"{type(layer.impl).__name__}.do_kv_cache_update did not store the probe's values "
                    "unchanged (a quantized KV cache, or the write happens elsewhere)"
                )
            found += read.to(torch.int64) << (8 * place)
    finally:
        block.copy_(saved)
    gather = torch.full((elements,), -1, dtype=torch.int64, device=device)
    gather[found] = torch.arange(elements, device=device)
    if bool((gather < 0).any()):
        raise UnknownLayout(f"{type(layer.impl).__name__}'s KV write is not one-to-one onto a block")
    return gather


def bit_moves(gather: torch.Tensor, parts: int = 2) -> list[tuple[dict[int, int], list[int]]] | None:
    """``gather`` as strided views, when it is one: per part of kvtier's block (K, then V), the raw
    bits it holds fixed (bit -> value) and, for each of the part's index bits from the highest, the
    raw bit it moves to; None when a size is not a power of two or a part is not a bit permutation.

    NOTE: vLLM's layouts are transposes and packings of power-of-two dims, which are exactly such
    bit permutations; a strided copy of them runs at memory speed, an element gather at a fraction.
    """
    elements = gather.numel()
    bits = elements.bit_length() - 1
    if elements != 1 << bits or elements % parts:
        return None
    size = elements // parts
    part_bits = size.bit_length() - 1
    index = torch.arange(size, device=gather.device)
    moves = []
    for part in range(parts):
        sub = gather[part * size : (part + 1) * size]
        base = int(sub[0])
        steps = [int(sub[1 << b]) - base for b in range(part_bits)]
        if any(d <= 0 or d & (d - 1) or base & d for d in steps) or len(set(steps)) != part_bits:
            return None
        rebuilt = base + sum(((index >> b) & 1) * d for b, d in enumerate(steps))
        if not torch.equal(rebuilt, sub):
            return None
        used = {d.bit_length() - 1 for d in steps}
        fixed = {r: (base >> r) & 1 for r in range(bits) if r not in used}
        moves.append((fixed, [steps[b].bit_length() - 1 for b in reversed(range(part_bits))]))
    return moves


def _part_view(rows: torch.Tensor, bits: int, fixed: dict[int, int], order: list[int]) -> torch.Tensor:
    """The view of ``rows`` ``[n, 2**bits]`` holding one part, its dims in the part's bit order."""
    view = rows.view(rows.shape[0], *[2] * bits)
    for raw_bit in sorted(fixed):  # dim of raw bit r is bits - r; lowest bits first keeps dims valid
        view = view.select(bits - raw_bit, fixed[raw_bit])
    remaining = [r for r in reversed(range(bits)) if r not in fixed]  # the view's dims, highest bit first
    return view.permute(0, *[1 + remaining.index(r) for r in order])


MAX_RUNS = 16  # more runs than this: one batched index op per layer beats a copy per run


def runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]] | None:
    """``(a_start, b_start, length)`` of the maximal stretches where both id lists count up by one,
    or None when there are more than ``MAX_RUNS`` of them."""
    found: list[tuple[int, int, int]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if i and x == a[i - 1] + 1 and y == b[i - 1] + 1:
            start_a, start_b, length = found[-1]
            found[-1] = (start_a, start_b, length + 1)
        elif len(found) == MAX_RUNS:
            return None
        else:
            found.append((x, y, 1))
    return found


def write_rows(pool: torch.Tensor, pool_ids: list[int], blocks: torch.Tensor, rows: list[int]) -> None:
    """``pool[pool_ids[i]] = blocks[rows[i]]``: a copy per run of consecutive ids, else one index op."""
    stretches = runs(pool_ids, rows)
    if stretches is None:
        index = torch.tensor(rows, device=blocks.device)
        pool.index_copy_(
            0, torch.tensor(pool_ids, device=pool.device), blocks.index_select(0, index).to(pool.device)
        )
        return
    for p, r, n in stretches:
        pool[p : p + n].copy_(blocks[r : r + n])


class BlockCopier:
    """Whole blocks between vLLM's per-layer caches and kvtier's pool, batched.

    ``kv_caches``: vLLM's caches in layer order, each ``[num_blocks, ...]``; ``gathers``: each
    layer's ``probe_layout``; ``pool``: the pool's element tensor ``[num_blocks, num_layers, 2,
    block_size, num_kv_heads, head_dim]`` on the same device.
    """

    def __init__(
        self, kv_caches: list[torch.Tensor], gathers: list[torch.Tensor], block_shape: tuple[int, ...]
    ):
        self.kv_caches = kv_caches
        self.block_shape = block_shape  # [2, block_size, num_kv_heads, head_dim]
        self.elements = math.prod(block_shape)
        self.block_bytes = (
            len(kv_caches) * self.elements * kv_caches[0].element_size()
        )  # one block, all layers
        identity = torch.arange(self.elements, device=gathers[0].device)
        # NOTE: a layout equal to kvtier's (an identity permutation) skips the gather, one copy less.
        self.gathers = [None if torch.equal(g, identity) else g for g in gathers]
        self.scatters = [None if g is None else torch.argsort(g) for g in self.gathers]
        self.moves = [None if g is None else bit_moves(g, parts=block_shape[0]) for g in self.gathers]
        self.bits = self.elements.bit_length() - 1

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    def _rows(self, cache: torch.Tensor, start: int, n: int) -> torch.Tensor | None:
        """vLLM blocks ``[start, start + n)`` of one layer's cache as a ``[n, elements]`` view, or
        None if the cache's blocks are not laid out contiguously."""
        part = cache[start : start + n]
        return part.view(n, self.elements) if part.is_contiguous() else None

    def _move(self, layer: int, dst: torch.Tensor, src: torch.Tensor, to_vllm: bool) -> None:
        """One layer of ``n`` blocks, ``[n, elements]`` views both, from kvtier's order into vLLM's
        (``to_vllm``) or back, in one pass."""
        gather, moves = self.gathers[layer], self.moves[layer]
        n = src.shape[0]
        if gather is None:
            dst.copy_(src)
        elif moves is None:
            dst.copy_(src[:, self.scatters[layer]] if to_vllm else src[:, gather])
        else:
            kvtier = src if to_vllm else dst
            parts = kvtier.view(n, len(moves), -1)
            vllm = dst if to_vllm else src
            for part, (fixed, order) in enumerate(moves):
                strided = _part_view(vllm, self.bits, fixed, order)
                plain = parts[:, part].view(n, *[2] * len(order))
                (strided if to_vllm else plain).copy_(plain if to_vllm else strided)

    def load(self, pool: torch.Tensor, pool_ids: list[int], vllm_ids: list[int]) -> None:
        """Pool blocks (``pool``: the pool's element tensor) into vLLM's blocks, in one pass per
        layer and run of consecutive ids; an index op per layer when the ids are scattered."""
        stretches = runs(pool_ids, vllm_ids)
        if stretches is None or any(self._rows(c, 0, 1) is None for c in self.kv_caches):
            device = self.kv_caches[0].device
            blocks = pool.index_select(0, torch.tensor(pool_ids, device=pool.device)).to(device)
            return self.write_blocks(torch.tensor(vllm_ids, device=device), blocks)
        flat = pool.view(pool.shape[0], self.num_layers, self.elements)
        for p, v, n in stretches:
            for layer, cache in enumerate(self.kv_caches):
                src = flat[p : p + n, layer]
                if src.device != cache.device:
                    src = src.to(cache.device)
                self._move(layer, self._rows(cache, v, n), src, to_vllm=True)

    def stage(self, vllm_block_ids: list[int], into: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """vLLM blocks copied into ``into``'s first rows (a ``staging`` tensor) as cheaply as memory
        allows, for ``write_staged``: (rows, raw). Raw: still in vLLM's layout, a plain copy per layer
        and run of consecutive ids (the relayout is left to ``write_staged``, off vLLM's step);
        else in kvtier's (``read_blocks``: scattered ids, or a layout as kvtier's)."""
        ids = [int(i) for i in vllm_block_ids]
        stretches = runs(ids, list(range(len(ids))))
        if (
            stretches is None
            or all(g is None for g in self.gathers)
            or any(self._rows(c, 0, 1) is None for c in self.kv_caches)
        ):
            return self.read_blocks(ids, into=into).view(len(ids), self.num_layers, self.elements), False
        out = into[: len(ids)]
        for v, o, n in stretches:
            for layer, cache in enumerate(self.kv_caches):
                out[o : o + n, layer].copy_(self._rows(cache, v, n))
        return out, True

    def write_staged(self, pool: torch.Tensor, pool_ids: list[int], staged: torch.Tensor, rows: list[int],
                     raw: bool) -> None:  # fmt: skip
        """``pool[pool_ids[i]] = staged[rows[i]]`` in kvtier's layout; ``staged, raw`` from ``stage``."""
        if raw:
            stretches = runs(pool_ids, rows)
            if stretches is None:  # scattered pool blocks: into kvtier's layout, then one index op
                blocks = self.staging(len(rows))
                for layer in range(self.num_layers):
                    self._move(layer, blocks[:, layer], staged[rows, layer], to_vllm=False)
                staged, rows = blocks, list(range(len(rows)))
            else:
                flat = pool.view(pool.shape[0], self.num_layers, self.elements)
                for p, r, n in stretches:
                    for layer in range(self.num_layers):
                        self._move(layer, flat[p : p + n, layer], staged[r : r + n, layer], to_vllm=False)
                return
        write_rows(pool, pool_ids, staged.view(len(staged), self.num_layers, *self.block_shape), rows)

    def staging(self, n: int) -> torch.Tensor:
        """Room for ``n`` blocks read out of vLLM's cache (``read_blocks``' ``into``)."""
        return torch.empty((n, self.num_layers, self.elements), dtype=self.kv_caches[0].dtype,
                           device=self.kv_caches[0].device)  # fmt: skip

    def read_blocks(
        self, vllm_block_ids: torch.Tensor | list[int], into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """vLLM blocks as kvtier blocks ``[n, num_layers, 2, block_size, heads, head_dim]``, in the
        first rows of ``into`` (a ``staging`` tensor) or a new tensor (one pass per layer and run of
        consecutive ids; an index op more when they are scattered)."""
        n = len(vllm_block_ids)
        out = self.staging(n) if into is None else into[:n]
        ids = [int(i) for i in vllm_block_ids]
        stretches = runs(ids, list(range(n)))
        if stretches is not None and all(self._rows(c, 0, 1) is not None for c in self.kv_caches):
            for v, o, length in stretches:
                for layer, cache in enumerate(self.kv_caches):
                    self._move(layer, out[o : o + length, layer], self._rows(cache, v, length), to_vllm=False)
            return out.view(n, self.num_layers, *self.block_shape)
        vllm_block_ids = torch.as_tensor(ids, device=self.kv_caches[0].device)
        for layer, (cache, gather) in enumerate(zip(self.kv_caches, self.gathers, strict=True)):
            rows = cache.index_select(0, vllm_block_ids).reshape(n, self.elements)
            moves = self.moves[layer]
            if gather is None:
                out[:, layer] = rows
            elif moves is None:
                out[:, layer] = rows.index_select(1, gather)
            else:
                parts = out[:, layer].view(n, len(moves), -1)
                for part, (fixed, order) in enumerate(moves):
                    dst = parts[:, part].view(n, *[2] * len(order))
                    dst.copy_(_part_view(rows, self.bits, fixed, order))
        return out.view(n, self.num_layers, *self.block_shape)

    def write_blocks(self, vllm_block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Store kvtier blocks ``[n, num_layers, 2, block_size, heads, head_dim]`` into vLLM's blocks."""
        n = len(vllm_block_ids)
        flat = blocks.reshape(n, self.num_layers, self.elements)
        for layer, (cache, scatter) in enumerate(zip(self.kv_caches, self.scatters, strict=True)):
            moves = self.moves[layer]
            if scatter is None:
                rows = flat[:, layer]
            elif moves is None:
                rows = flat[:, layer][:, scatter]
            else:
                rows = torch.empty((n, self.elements), dtype=flat.dtype, device=flat.device)
                parts = flat[:, layer].reshape(n, len(moves), -1)
                for part, (fixed, order) in enumerate(moves):
                    _part_view(rows, self.bits, fixed, order).copy_(parts[:, part].view(n, *[2] * len(order)))
            cache.index_copy_(0, vllm_block_ids, rows.reshape(n, *cache.shape[1:]))
