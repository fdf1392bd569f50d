"""The ``cuda`` pool backend: one raw device allocation through CuPy, shared with compute
processes through a CUDA IPC handle (kvtier.pool has the layout, the spec and the shm backend).

The handle names the whole allocation (never a slice of torch's caching allocator) and the spec
carries the device UUID, so a replica on another GPU refuses to attach. CuPy is imported only
when a cuda pool is made or attached (``require_cuda``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

from kvtier.pool import (
    MappedViews,
    PoolSpec,
    PoolUnavailable,
    PoolViews,
    pool_views,
)


def require_cuda():
    """Import CuPy lazily and check a device exists; raise PoolUnavailable saying why not."""
    try:
        import cupy
    except ImportError as e:
        raise PoolUnavailable(
            "the cuda backend needs CuPy matching torch's CUDA (pip install 'kvtier[cuda]' for CUDA 12, "
            f"'kvtier[cuda13]' for CUDA 13): {e}"
        ) from None
    try:
        available = cupy.cuda.is_available()
    except Exception:  # CuPy raises various CUDA errors without a driver
        available = False
    if not available:
        raise PoolUnavailable("the cuda backend is unavailable: CuPy finds no CUDA device on this machine")
    import torch

    if not torch.cuda.is_available():
        raise PoolUnavailable(
            "the cuda backend is unavailable: this torch build has no CUDA (install a CUDA torch)"
        )
    return cupy


def device_uuid(device: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"GPU-{props.uuid}" if not str(props.uuid).startswith("GPU-") else str(props.uuid)


@dataclass
class CudaPool(MappedViews):
    """Pool in one raw CUDA allocation, shared through a CUDA IPC handle."""

    spec: PoolSpec
    views: PoolViews | None = field(repr=False)
    # cupy Memory (owner), or a weak reference to the _IpcMapping that the views hold (client)
    _memory: object = field(repr=False)
    _owner: bool = False

    backend = "cuda"

    def mapped(self) -> bool:
        """Whether this process still holds the allocation (a client: the opened IPC handle)."""
        if self._owner:
            return self._memory is not None
        return self._memory is not None and self._memory() is not None

    @classmethod
    def create(cls, shape: list[int], dtype: str, device: int = 0, **spec_fields) -> CudaPool:
        cupy = require_cuda()
        spec = PoolSpec.laid_out(cls.backend, shape, dtype, device_uuid=device_uuid(device), **spec_fields)
        size = spec.size_bytes
        with cupy.cuda.Device(device):
            # NOTE: cupy.cuda.Memory is a plain cudaMalloc, not a pool slice: the IPC handle must
            # name the whole allocation, which the caching allocators of torch/CuPy do not promise.
            memory = cupy.cuda.Memory(size)
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
            raw = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
            raw.fill(0)
        spec.cuda_ipc_handle = handle
        return cls(spec=spec, views=_torch_view(raw, spec), _memory=memory, _owner=True)

    @classmethod
    def attach(cls, spec: PoolSpec) -> CudaPool:
        if spec.backend != cls.backend:
            raise ValueError(f"pool backend is {spec.backend!r}, not {cls.backend!r}")
        cupy = require_cuda()
        import torch

        local = {device_uuid(i): i for i in range(torch.cuda.device_count())}
        if spec.device_uuid not in local:
            raise PoolUnavailable(
                f"the pool lives on {spec.device_uuid}, which this process cannot see "
                f"(visible: {', '.join(local) or 'none'}); run compute on the cache service's GPU"
            )
        device = local[spec.device_uuid]
        with cupy.cuda.Device(device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(spec.cuda_ipc_handle)
            # The views hold the array, the array the memory, the memory its owner: the handle is
            # closed when the last view is gone (_IpcMapping), never under a live one.
            mapping = _IpcMapping(ptr, device)
            memory = cupy.cuda.UnownedMemory(ptr, spec.size_bytes, owner=mapping, device_id=device)
            raw = cupy.ndarray(
                (spec.size_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
        return cls(spec=spec, views=_torch_view(raw, spec), _memory=weakref.ref(mapping), _owner=False)

    def close(self) -> None:
        """Let go of the allocation: a client's IPC handle is closed at once if no tensor view of
        it is left, else when the last one is gone (as the shm backend's mapping)."""
        self.views = None
        if self._owner:
            self._memory = None


class _IpcMapping:
    """Owns one opened CUDA IPC handle and closes it when it is garbage: the CuPy memory of the
    pool's tensor holds it, so that is when no view of the pool is left."""

    def __init__(self, ptr: int, device: int) -> None:
        self.ptr = ptr
        weakref.finalize(self, _close_ipc_handle, ptr, device)


def _close_ipc_handle(ptr: int, device: int) -> None:
    with contextlib.suppress(Exception):  # at exit, CUDA may be gone before us: nothing to close then
        cupy = require_cuda()
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def _torch_view(raw, spec: PoolSpec) -> PoolViews:
    # CuPy has no bfloat16: share the bytes as uint8 and reinterpret them in torch.
    import torch

    return pool_views(torch.as_tensor(raw, device=f"cuda:{raw.device.id}"), spec)
