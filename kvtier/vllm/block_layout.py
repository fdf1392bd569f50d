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

The layouts vLLM's backends use are transposes and packings of kvtier's dims, so each part of a
layer block (K, V) is one strided view of vLLM's block (``strided_parts``): a relayout is then one
``copy_`` between two strided views per part, layer and run of consecutive block ids, at about
the speed of a plain copy (a save goes straight from vLLM's blocks into pool blocks, in vLLM's
step: ``save``). vLLM 0.32 keeps every layer's cache in one allocation a constant stride apart
(``layer_stride``): then one view spans the layers, and a run is one copy per part for them all.
Blocks whose ids are scattered go through one index op (``index_select`` / ``index_copy_``: plain
row copies) on the scattered side. A layout that is no strided view is still copied, element by
element through an index. Nothing is copied per token; on a GPU the copies run device to device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Part:
    """One part of a layer block (its K or its V) as strided dims: each dim's size, in kvtier's
    order, with its stride (elements) in kvtier's block and in vLLM's, and where the part starts in each."""

    sizes: tuple[int, ...]
    kvtier_strides: tuple[int, ...]
    vllm_strides: tuple[int, ...]
    kvtier_start: int
    vllm_start: int


def _radices(size: int) -> list[int]:
    """``size`` as the digits of a mixed-radix index, highest first: its odd factor (when not 1),
    then a 2 for each factor of two (so a dim split or packed by powers of two is still strided)."""
    twos = (size & -size).bit_length() - 1
    return ([size >> twos] if size >> twos > 1 else []) + [2] * twos


def strided_parts(offsets: torch.Tensor, block_shape: tuple[int, ...]) -> list[Part] | None:
    """``offsets`` (for each element of kvtier's layer block ``block_shape``, in its order, where it
    lies in vLLM's block) as one ``Part`` per index of ``block_shape[0]``; None when a part is not
    one strided view with positive strides.

    NOTE: each part is checked whole: its offsets must equal a base plus a stride per digit of its
    index (``_radices`` of each dim), and digits whose strides continue each other are merged, so a
    transpose of whole dims comes out as a handful of dims (CPU ``vec``: K ``[32, 2, 64]`` with
    strides ``[1, 4096, 32]``) that torch copies in one loop.
    """
    size = math.prod(block_shape[1:])
    radices = [r for dim in block_shape[1:] for r in _radices(dim)]
    units, unit = [], 1  # the digits' strides in kvtier's (contiguous) part
    for r in reversed(radices):
        units.insert(0, unit)
        unit *= r
    index = torch.arange(size, device=offsets.device)
    parts = []
    for p in range(block_shape[0]):
        sub = offsets[p * size : (p + 1) * size]
        base = int(sub[0])
        steps = [int(sub[u]) - base for u in units]
        if any(step <= 0 for step in steps):
            return None
        rebuilt = base + sum(
            ((index // u) % r) * step for u, r, step in zip(units, radices, steps, strict=True)
        )
        if not torch.equal(rebuilt, sub):
            return None
        dims: list[list[int]] = []  # [size, kvtier stride, vLLM stride], highest first
        for r, u, step in zip(radices, units, steps, strict=True):
            if dims and dims[-1][2] == step * r:
                dims[-1] = [dims[-1][0] * r, u, step]
            else:
                dims.append([r, u, step])
        parts.append(Part(*(tuple(d[i] for d in dims) for i in range(3)), p * size, base))  # type: ignore[arg-type]
    return parts


def block_offsets(cache: torch.Tensor) -> torch.Tensor:
    """For each element of a block of ``cache`` (``[num_blocks, ...]``), in its logical order, its
    offset in memory (elements) from the block's first one."""
    block = cache[0]
    offsets = torch.zeros((), dtype=torch.int64, device=cache.device)
    for size, stride in zip(block.shape, block.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, device=cache.device) * stride
    return offsets.reshape(-1)


MAX_RUNS = 16  # more runs than this: one index op (a plain pass more over the bytes) beats a copy per run


def runs(a: list[int], b: list[int], limit: int | None = MAX_RUNS) -> list[tuple[int, int, int]] | None:
    """``(a_start, b_start, length)`` of the maximal stretches where both id lists count up by one,
    or None when there are more than ``limit`` of them."""
    found: list[tuple[int, int, int]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if i and x == a[i - 1] + 1 and y == b[i - 1] + 1:
            start_a, start_b, length = found[-1]
            found[-1] = (start_a, start_b, length + 1)
        elif len(found) == limit:
            return None
        else:
            found.append((x, y, 1))
    return found


def layer_stride(caches: list[torch.Tensor]) -> int | None:
    """The elements from one layer's cache to the next's when every one is a view of the same
    storage, alike (shape, strides, dtype) and a constant positive stride apart; else None."""
    first = caches[0]
    if len(caches) < 2:
        return None
    stride = caches[1].storage_offset() - first.storage_offset()
    for i, cache in enumerate(caches):
        if (
            cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or (cache.shape, cache.stride(), cache.dtype) != (first.shape, first.stride(), first.dtype)
            or cache.storage_offset() - first.storage_offset() != i * stride
        ):
            return None
    return stride if stride > 0 else None


# A place of blocks: (tensor, first element past its storage offset, block stride, layer stride).
Place = tuple[torch.Tensor, int, int, int]


def _at(tensor: torch.Tensor, block: int, layer: int = 0) -> Place:
    """Block ``block`` (layer ``layer``) of a vLLM cache, the pool or a staging tensor ``[n, layers, ...]``."""
    return tensor, block * tensor.stride(0) + layer * tensor.stride(1), tensor.stride(0), tensor.stride(1)


def _view(place: Place, n: int, layers: int, start: int, sizes, strides) -> torch.Tensor:
    """``n`` blocks (and ``layers`` layers, if not 0) at ``place``, each as the dims ``sizes, strides`` from ``start``."""
    tensor, first, block_stride, layer_stride = place
    lead = ((n, block_stride), (layers, layer_stride)) if layers else ((n, block_stride),)
    return tensor.as_strided(
        (*(d for d, _ in lead), *sizes),
        (*(s for _, s in lead), *strides),
        tensor.storage_offset() + first + start,
    )


class BlockCopier:
    """Whole blocks between vLLM's per-layer caches and kvtier's pool, batched.

    ``kv_caches``: vLLM's caches in layer order, each ``[num_blocks, ...]``; ``gathers``: each
    layer's ``probe_layout``; ``block_shape``: kvtier's layer block ``[2, block_size, heads,
    head_dim]``. Pools, staging and blocks in kvtier's layout are ``[n, num_layers, ...]`` on the
    caches' device (any strides between blocks and between layers; each layer block contiguous).
    """

    def __init__(
        self, kv_caches: list[torch.Tensor], gathers: list[torch.Tensor], block_shape: tuple[int, ...]
    ):
        self.kv_caches = kv_caches
        self.block_shape = tuple(block_shape)  # [2, block_size, num_kv_heads, head_dim]
        self.elements = math.prod(block_shape)
        # One block, every layer:
        self.block_bytes = len(kv_caches) * self.elements * kv_caches[0].element_size()
        identity = torch.arange(self.elements, device=gathers[0].device)
        self.gathers = [None if torch.equal(g, identity) else g for g in gathers]  # None: kvtier's own layout
        # Where each kvtier element of a layer block lies in vLLM's block (memory), and as strided views.
        self.offsets = [block_offsets(c)[g.to(c.device)] for c, g in zip(kv_caches, gathers, strict=True)]
        self.parts = [strided_parts(o, self.block_shape) for o in self.offsets]
        # Placing scattered vLLM blocks by an index op needs each block in one piece (``load``); one
        # copy per part for every layer of a staging tensor needs the layers laid out alike.
        self.raw = all(c[0].is_contiguous() for c in kv_caches)
        self.alike = self.parts[0] is not None and all(p == self.parts[0] for p in self.parts)
        # vLLM (0.32's allocate_kv_cache) keeps every layer in one allocation, layer l of block b at
        # l * layer_stride + b * block_stride: one strided view then spans the layers, and a run of
        # blocks is one copy per part for every layer (not one per layer: 44 launches on a GPU).
        self.layer_stride = layer_stride(kv_caches) if self.alike else None
        self._blocks: torch.Tensor | None = None  # save's room for scattered pool blocks, reused

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    def _move(self, n: int, vllm: Place, kvtier: Place, to_vllm: bool, layer: int | None) -> None:
        """``n`` blocks between vLLM's layout at ``vllm`` and kvtier's at ``kvtier``: of one layer,
        or of every layer (``layer`` None: both places hold them a layer stride apart, laid out alike)."""
        parts = self.parts[layer or 0]
        layers = self.num_layers if layer is None else 0
        if parts is None:  # no strided view: element by element through the offsets (one layer)
            tensor, first, block_stride, _ = vllm
            flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
            starts = torch.arange(n, device=tensor.device) * block_stride + tensor.storage_offset() + first
            index = starts[:, None] + self.offsets[layer or 0]
            rows = _view(kvtier, n, 0, 0, (self.elements,), (1,))
            if to_vllm:
                flat[index] = rows.to(tensor.device)
            else:
                rows.copy_(flat[index])
            return
        for part in parts:
            v = _view(vllm, n, layers, part.vllm_start, part.sizes, part.vllm_strides)
            k = _view(kvtier, n, layers, part.kvtier_start, part.sizes, part.kvtier_strides)
            (v if to_vllm else k).copy_(k if to_vllm else v)

    def _every_layer(self, vllm, block: int, staged: bool) -> Place | None:
        """Block ``block`` of every layer of ``vllm`` as one place, when one view spans the layers: a
        staging tensor of layers laid out alike, or vLLM's caches in one allocation (through the first
        layer's storage); else None (a copy per layer)."""
        if staged:
            return _at(vllm, block) if self.alike else None
        if self.layer_stride is None:
            return None
        first = vllm[0]
        return first, block * first.stride(0), first.stride(0), self.layer_stride

    def _pairs(self, vllm, vllm_ids: list[int], kvtier: torch.Tensor, kvtier_ids: list[int], to_vllm: bool,
               limit: int | None = None) -> bool:  # fmt: skip
        """Blocks ``vllm_ids`` of ``vllm`` (the caches, or a staging tensor) and ``kvtier_ids`` of
        ``kvtier``, pairwise: a copy per run of consecutive ids and part (every layer in one from a
        staging tensor of layers laid out alike; else one per layer). False, with nothing copied,
        when there are more than ``limit`` runs."""
        stretches = runs(vllm_ids, kvtier_ids, limit)
        if stretches is None:
            return False
        staged = isinstance(vllm, torch.Tensor)
        for v, k, n in stretches:
            spanned = self._every_layer(vllm, v, staged)
            if spanned is not None:
                self._move(n, spanned, _at(kvtier, k), to_vllm, None)
                continue
            for layer in range(self.num_layers):
                at = _at(vllm, v, layer) if staged else _at(vllm[layer], v)
                self._move(n, at, _at(kvtier, k, layer), to_vllm, layer)
        return True

    def load(self, pool: torch.Tensor, pool_ids: list[int], vllm_ids: list[int]) -> None:
        """Pool blocks (``pool``: the pool's element tensor) into vLLM's blocks: a strided copy per
        layer, part and run of consecutive ids; an index op more on the side whose ids are scattered."""
        n = len(pool_ids)
        if runs(pool_ids, list(range(n))) is None:  # scattered pool blocks: gathered by one index op
            pool, pool_ids = pool.index_select(0, torch.tensor(pool_ids, device=pool.device)), list(range(n))
        if self._pairs(self.kv_caches, vllm_ids, pool, pool_ids, True, MAX_RUNS if self.raw else None):
            return
        rows = self.staging(n)  # scattered vLLM blocks: relaid out together, placed by one index op a layer
        self._pairs(rows, list(range(n)), pool, pool_ids, to_vllm=True)
        index = torch.tensor(vllm_ids, device=rows.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(0, index, rows[:, layer].view(n, *cache.shape[1:]))

    def save(self, pool: torch.Tensor, pool_ids: list[int], vllm_ids: list[int]) -> None:
        """vLLM's blocks into pool blocks, relaid out on the way: a strided copy per layer, part and
        run of consecutive ids on both sides; scattered pool blocks are relaid out into a reused
        buffer first and placed by one index op."""
        if self._pairs(self.kv_caches, vllm_ids, pool, pool_ids, to_vllm=False, limit=MAX_RUNS):
            return
        n = len(pool_ids)
        if self._blocks is None or len(self._blocks) < n:  # reused: fresh memory costs a page fault a page
            self._blocks = torch.empty(
                (n, self.num_layers, *self.block_shape), dtype=pool.dtype, device=pool.device
            )
        self._pairs(self.kv_caches, vllm_ids, self._blocks, list(range(n)), to_vllm=False)
        pool.index_copy_(0, torch.tensor(pool_ids, device=pool.device), self._blocks[:n])

    def staging(self, n: int) -> torch.Tensor:
        """Room for ``n`` blocks of vLLM's cache, ``[n, num_layers, elements]``, each layer's blocks
        side by side (so one index op fills a layer)."""
        cache = self.kv_caches[0]
        return torch.empty(
            (self.num_layers, n, self.elements), dtype=cache.dtype, device=cache.device
        ).transpose(0, 1)

    def read_blocks(self, vllm_block_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """vLLM blocks as kvtier blocks ``[n, num_layers, 2, block_size, heads, head_dim]``, in a new
        tensor: a strided copy per layer, part and run of consecutive ids."""
        ids = [int(i) for i in vllm_block_ids]
        n = len(ids)
        blocks = self.staging(n).unflatten(2, self.block_shape)
        self._pairs(self.kv_caches, ids, blocks, list(range(n)), to_vllm=False)
        return blocks
