"""The KV block pool: one allocation, block-major, shared between processes.

Layout (docs/architecture.md, "The pool"): ``pool[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``.
A block id names the same slot in every layer, and one block is one contiguous region. A block
of a quantized dtype (kvtier.kv_dtypes: fp8_e4m3, fp8_e5m2, int8) holds its one-byte elements
followed by their float32 scales ``[num_layers, 2, block_size, num_kv_heads]``, so it still
swaps and copies as one region and a shared prefix block carries its own scales.

Two backends, one class each. The cache service calls ``create()``; a compute process calls
``attach(spec)`` with the :class:`PoolSpec` it got from ``Attach``. The spec's format (how a
handle is carried) lives only here.

- ``cpu-shm``: POSIX shared memory under /dev/shm, mode 0600, mapped by name.
- ``cuda``: one raw device allocation through CuPy, exported with ``cudaIpcGetMemHandle``
  (kvtier.cuda_pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import secrets
import weakref
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier import kv_dtypes

if TYPE_CHECKING:
    import torch

    from kvtier.cuda_pool import CudaPool

log = logging.getLogger(__name__)

# NOTE: torch is imported only where a tensor is made, so clients that only talk to the cache
# service (routers, benchmarks' load generators) do not pay for importing it.
SHM_PREFIX = "kvtier-"


class PoolUnavailable(RuntimeError):
    """The requested backend cannot be used on this machine (the message says why)."""


def pool_shape(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
) -> list[int]:
    return [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


def contiguous_strides(shape: list[int]) -> list[int]:
    """Strides in elements of a row-major tensor of `shape`."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return list(reversed(strides))


def block_layout(shape: list[int], dtype: str) -> tuple[int, int]:
    """(bytes of one block, bytes of its elements) of a pool of `shape` in `dtype`; a quantized
    dtype's scales fill the rest of the block, one float32 per (layer, K/V, token, KV head)."""
    entry = kv_dtypes.lookup(dtype, "pool dtype")
    elements = math.prod(shape[1:]) * entry.itemsize
    scales = math.prod(shape[1:5]) * kv_dtypes.SCALE_BYTES if entry.needs_scales else 0
    return elements + scales, elements


def pool_strides(shape: list[int], dtype: str) -> list[int]:
    """Strides in elements of the pool's element view: row-major within a block, blocks
    `block_layout(...)[0]` bytes apart (a quantized block's scales follow its elements)."""
    strides = contiguous_strides(list(shape))
    strides[0] = block_layout(shape, dtype)[0] // kv_dtypes.itemsize(dtype)
    return strides


@dataclass
class PoolSpec:
    """Everything a client needs to map the pool. Mirrors ``kvtier.v1.PoolSpec``."""

    backend: str
    dtype: str
    shape: list[int]
    strides: list[int]
    size_bytes: int
    block_size: int
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    device_uuid: str = ""
    model_fingerprint: str = ""
    vocab_size: int = 0
    max_model_len: int = 0

    @classmethod
    def laid_out(cls, backend: str, shape: list[int], dtype: str, **fields) -> PoolSpec:
        """The spec of a pool of ``shape`` and ``dtype``: strides, bytes and block size follow from
        them (``pool_strides``, ``block_layout``); ``fields`` are the rest (a handle, the model's)."""
        shape = list(shape)
        size = shape[0] * block_layout(shape, dtype)[0]
        return cls(backend, dtype, shape, pool_strides(shape, dtype), size, shape[3], **fields)

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.size_bytes // self.shape[0]


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a pool of `dtype` (any name of kvtier.kv_dtypes)."""
    return kv_dtypes.lookup(dtype, "pool dtype").torch_dtype()


@dataclass
class PoolViews:
    """The tensor views of one pool allocation, for a backend's dataclass to hold.

    tensor: the elements, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in
    the pool's torch dtype. scales: ``[num_blocks, num_layers, 2, block_size, num_kv_heads]``
    float32 for a quantized dtype, else None. rows: ``[num_blocks, block_bytes]`` uint8, each
    block whole (what the host tier copies).
    """

    tensor: torch.Tensor
    scales: torch.Tensor | None
    rows: torch.Tensor


def pool_views(flat: torch.Tensor, spec: PoolSpec) -> PoolViews:
    """Views of `flat` (the allocation as uint8, at least spec.size_bytes) laid out as `spec`."""
    import torch

    block_bytes, element_bytes = block_layout(spec.shape, spec.dtype)
    n = spec.num_blocks
    rows = flat[: n * block_bytes].view(n, block_bytes)
    tensor = torch.as_strided(flat.view(torch_dtype(spec.dtype)), spec.shape, spec.strides)
    scales = None
    if block_bytes > element_bytes:
        shape = spec.shape[:5]
        per_block = block_bytes // kv_dtypes.SCALE_BYTES
        strides = [per_block, *contiguous_strides(shape[1:])]
        scales = torch.as_strided(
            flat[: n * block_bytes].view(torch.float32), shape, strides, element_bytes // 4
        )
    return PoolViews(tensor, scales, rows)


def private_pool(shape: list[int], dtype: str, device: str = "cpu") -> PoolViews:
    """The views of a zeroed pool of `shape` and `dtype` in this process's own memory, laid out as
    a shared one (benchmarks and tests that need no second process)."""
    import torch

    spec = PoolSpec.laid_out("private", shape, dtype)
    return pool_views(torch.zeros(spec.size_bytes, dtype=torch.uint8, device=device), spec)


class MappedViews:
    """What both backends show of their allocation (PoolViews); all None once closed."""

    views: PoolViews | None

    @property
    def tensor(self) -> torch.Tensor:
        return None if self.views is None else self.views.tensor

    @property
    def scales(self) -> torch.Tensor | None:
        return None if self.views is None else self.views.scales

    @property
    def rows(self) -> torch.Tensor:
        return None if self.views is None else self.views.rows


@dataclass
class ShmPool(MappedViews):
    """Pool in POSIX shared memory (the default without a GPU)."""

    spec: PoolSpec
    views: PoolViews | None = field(repr=False)
    _shm: shared_memory.SharedMemory = field(repr=False)
    _owner: bool = False
    _mapping: weakref.ref = field(init=False, repr=False)

    backend = "cpu-shm"

    def __post_init__(self) -> None:
        self._mapping = weakref.ref(self._shm._mmap)

    def mapped(self) -> bool:
        """Whether the segment is still mapped in this process (after `close`, until the last
        tensor view of it is gone)."""
        mapping = self._mapping()
        return mapping is not None and not mapping.closed

    @classmethod
    def create(cls, shape: list[int], dtype: str, **spec_fields) -> ShmPool:
        """Create a new segment (mode 0600) sized for `shape`; the caller owns and unlinks it."""
        spec = PoolSpec.laid_out(cls.backend, shape, dtype, **spec_fields)
        remove_stale_segments()
        name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        # NOTE: SharedMemory creates the segment with mode 0600, so only our uid can map it.
        # The creating process stays registered with the resource tracker on purpose: if the
        # cache service is killed, the tracker unlinks the segment (mappings that exist live on).
        shm = shared_memory.SharedMemory(name=name, create=True, size=spec.size_bytes)
        os.chmod(f"/dev/shm/{shm.name}", 0o600)
        spec.shm_name = shm.name
        pool = cls(spec=spec, views=_view(shm, spec), _shm=shm, _owner=True)
        pool.rows.zero_()
        return pool

    @classmethod
    def attach(cls, spec: PoolSpec) -> ShmPool:
        """Map an existing segment by name (the compute side)."""
        if spec.backend != cls.backend:
            raise ValueError(f"pool backend is {spec.backend!r}, not {cls.backend!r}")
        try:
            shm = shared_memory.SharedMemory(name=spec.shm_name, create=False)
        except FileNotFoundError:
            raise PoolUnavailable(
                f"shared-memory segment /dev/shm/{spec.shm_name} does not exist: the cache service "
                "runs in another IPC namespace (share it, e.g. compose `ipc: service:cache`) or has restarted"
            ) from None
        # NOTE: Python < 3.13 registers every attached segment with this process's resource tracker,
        # which would unlink the cache service's segment when we exit. We do not own it: unregister.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")
        if shm.size < spec.size_bytes:
            shm.close()
            raise PoolUnavailable(
                f"segment {spec.shm_name} has {shm.size} bytes, the spec says {spec.size_bytes}"
            )
        return cls(spec=spec, views=_view(shm, spec), _shm=shm, _owner=False)

    def close(self) -> None:
        """Drop our mapping (and unlink the segment if we created it).

        NOTE: closing the mapping while a tensor view of it is alive would segfault on the next
        access, so the mapping is only closed once no view can reach it; otherwise it is unmapped
        when the last view is gone (`mapped()` tells).
        """
        self.views = None
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        try:
            self._shm.close()
        except BufferError:
            # A tensor view (the host tier's, a step in flight) still exports the buffer. The
            # views hold the mapping alive, and it is unmapped when the last one goes; the
            # SharedMemory object lets go of it now, so its finalizer does not try again at exit
            # (a "BufferError: cannot close exported pointers exist" traceback).
            self._shm._buf = self._shm._mmap = None
            with contextlib.suppress(OSError):
                self._shm.close()  # closes the file descriptor
            log.debug(
                "pool %s still has tensor views; it stays mapped until they are gone", self.spec.shm_name
            )


def _view(shm: shared_memory.SharedMemory, spec: PoolSpec) -> PoolViews:
    import numpy as np
    import torch

    # NOTE: through numpy, the view holds a buffer export of the mapping, so SharedMemory.close()
    # (explicit or at garbage collection) raises BufferError instead of unmapping memory a tensor
    # still points into; torch.frombuffer holds no export and would leave a dangling view.
    flat = torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8, count=spec.size_bytes))
    return pool_views(flat, spec)


def remove_stale_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink kvtier segments of ours whose creating process no longer exists.

    A cache service killed with SIGKILL normally has its segment removed by the resource
    tracker; this catches the case where the tracker died too.
    """
    removed = []
    for path in Path(shm_dir).glob(f"{SHM_PREFIX}*"):
        try:
            pid = int(path.name[len(SHM_PREFIX) :].split("-")[0])
            if path.stat().st_uid != os.getuid():
                continue
        except (ValueError, OSError):
            continue
        if not _pid_alive(pid):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    if removed:
        log.info("removed %d stale shared-memory segment(s): %s", len(removed), ", ".join(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


BACKENDS = ("cpu-shm", "cuda")


def backend_class(name: str) -> type[ShmPool] | type[CudaPool] | None:
    """The class of backend `name` (None if unknown). The cuda backend's module (and CuPy, which
    it imports when a pool is made) loads only when a cuda pool is asked for."""
    if name == ShmPool.backend:
        return ShmPool
    if name == "cuda":
        from kvtier.cuda_pool import CudaPool

        return CudaPool
    return None


def default_backend() -> str:
    """`cuda` where CUDA is usable, else `cpu-shm`."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu-shm"


def create_pool(backend: str, shape: list[int], dtype: str, **spec_fields) -> ShmPool | CudaPool:
    cls = backend_class(backend)
    if cls is None:
        raise ValueError(f"pool backend {backend!r} is not one of {sorted(BACKENDS)}")
    return cls.create(shape, dtype, **spec_fields)


def attach_pool(spec: PoolSpec) -> ShmPool | CudaPool:
    cls = backend_class(spec.backend)
    if cls is None:
        raise PoolUnavailable(f"pool backend {spec.backend!r} is unknown to this client ({sorted(BACKENDS)})")
    return cls.attach(spec)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: map (and zero) a range's pages now, bytes kept


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def populate(start: int, size: int) -> bool:
    """Map ``size`` bytes of this process's memory from ``start`` (page aligned) now, writable
    (``MADV_POPULATE_WRITE``; an anonymous page is zeroed, a mapped one kept), so later copies
    into them do not fault page by page; False where the kernel or the platform refuses (pages are
    then mapped on first touch, as without it)."""
    with contextlib.suppress(OSError, AttributeError):
        return _madvise()(start, size, MADV_POPULATE_WRITE) == 0
    return False
