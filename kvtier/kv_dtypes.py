"""The one table of element types: what the KV pool may store and what model weights may run in.

Every place that sizes, maps, checks or computes on KV (the pool, the model shape, the memory
plan, the services' flags, the kernels) reads this table; none keeps its own list.

A *model* dtype (float32, float16, bfloat16) is stored as is. A *quantized* KV dtype (fp8_e4m3,
fp8_e5m2, int8) stores each element in one byte plus one float32 scale per (layer, K/V, token,
KV head), kept inside the same pool block (docs/architecture.md, "The pool"): the value is
``stored.float() * scale``. ``fp8`` is vLLM's name for fp8_e4m3. ``auto`` is resolved by the
callers (the model's dtype; see ``pool_dtype`` and ``weights_dtype``).

No torch import at module level: the cache service reads the table before (or without) torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVDtype:
    """One element type.

    name: kvtier's name (flags, PoolSpec.dtype). itemsize: bytes per element. torch_name: the
    attribute of `torch` holding the dtype. needs_scales: stored quantized, with one float32 scale
    per token-head. qmax: the largest magnitude the quantized type holds (0 for model dtypes);
    a token-head's scale is its absolute maximum / qmax.
    """

    name: str
    itemsize: int
    torch_name: str
    needs_scales: bool = False
    qmax: float = 0.0

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


# Bytes of one scale: float32, so a scale never under- or overflows for any activation range.
SCALE_BYTES = 4

TABLE: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("float32", 4, "float32"),
        KVDtype("float16", 2, "float16"),
        KVDtype("bfloat16", 2, "bfloat16"),
        KVDtype("fp8_e4m3", 1, "float8_e4m3fn", needs_scales=True, qmax=448.0),
        KVDtype("fp8_e5m2", 1, "float8_e5m2", needs_scales=True, qmax=57344.0),
        KVDtype("int8", 1, "int8", needs_scales=True, qmax=127.0),
    )
}
ALIASES = {"fp8": "fp8_e4m3"}

# What model weights (and the attention math) may run in: the dtypes stored as they are.
MODEL_DTYPES = tuple(name for name, d in TABLE.items() if not d.needs_scales)
QUANTIZED_DTYPES = tuple(name for name, d in TABLE.items() if d.needs_scales)
# The choices of --kv-cache-dtype, vLLM's names included.
KV_CACHE_DTYPE_CHOICES = ("auto", *MODEL_DTYPES, "fp8", *QUANTIZED_DTYPES)


def lookup(name: str, what: str = "KV dtype") -> KVDtype:
    """The entry named `name` (aliases resolved); ValueError naming the value and the choices."""
    entry = TABLE.get(ALIASES.get(name, name))
    if entry is None:
        raise ValueError(f"{what} {name!r} is not one of {sorted([*TABLE, *ALIASES])}")
    return entry


def model_dtype(name: str, what: str = "model dtype") -> KVDtype:
    """The entry of a dtype weights can run in; ValueError for a quantized or unknown one."""
    entry = lookup(name, what)
    if entry.needs_scales:
        raise ValueError(f"{what} {name!r} is not one of {list(MODEL_DTYPES)}")
    return entry


def of_torch(dtype: torch.dtype) -> KVDtype:
    """The entry whose torch dtype is `dtype`; ValueError naming it and the table's."""
    name = str(dtype).removeprefix("torch.")
    for entry in TABLE.values():
        if entry.torch_name == name:
            return entry
    raise ValueError(f"torch dtype {name} is not one of {[d.torch_name for d in TABLE.values()]}")


def itemsize(name: str) -> int:
    """Bytes per element of the dtype `name`."""
    return lookup(name).itemsize


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype that stores elements of `name` (float8_e4m3fn for fp8_e4m3)."""
    return lookup(name).torch_dtype()


def token_head_bytes(name: str, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes in a pool block: its elements plus, for a
    quantized dtype, its scale."""
    entry = lookup(name)
    return head_dim * entry.itemsize + (SCALE_BYTES if entry.needs_scales else 0)


# Triton converts fp8 codes (fp8e4nv, fp8e5) on devices of compute capability 8.9 and later.
FP8_MIN_CAPABILITY = (8, 9)


def unsupported_reason(name: str, device: str | torch.device = "cpu") -> str | None:
    """Why the kernels cannot store and read KV of dtype `name` on `device`, or None if they can.

    CPU (the torch path): torch must have the dtype and convert to and from it. CUDA (Triton):
    fp8 needs compute capability 8.9+ (Ada, Hopper and later)."""
    import torch

    entry = lookup(name)
    if not hasattr(torch, entry.torch_name):
        return f"this torch ({torch.__version__}) has no torch.{entry.torch_name}"
    device = torch.device(device)
    if not entry.needs_scales:
        return None  # the dtypes models run in: every path reads them as they are
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if entry.torch_name.startswith("float8") and capability < FP8_MIN_CAPABILITY:
            return (
                f"{name} needs compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))}+ for Triton's "
                f"fp8 conversions; {torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}"
            )
        return None
    try:
        torch.ones(2, device=device).to(entry.torch_dtype()).float()
    except (RuntimeError, TypeError) as e:
        return f"torch cannot convert to {entry.torch_name} on {device}: {e}"
    return None


def pool_dtype(kv_cache_dtype: str, backend: str, checkpoint_dtype: str) -> str:
    """The pool's dtype for --kv-cache-dtype `kv_cache_dtype` (aliases resolved): auto = the
    checkpoint's dtype on cuda, float32 on cpu-shm (the CPU kernels compute in fp32 anyway)."""
    if kv_cache_dtype == "auto":
        return checkpoint_dtype if backend == "cuda" else "float32"
    return lookup(kv_cache_dtype, "--kv-cache-dtype").name


def weights_dtype(pool: str, backend: str, checkpoint_dtype: str) -> str:
    """The dtype a compute replica runs the weights in next to a pool of dtype `pool`: the pool's
    own for a model dtype (attention reads the cache as it is), else what `auto` would give the
    pool (queries and dequantized keys meet in that dtype's attention)."""
    if not lookup(pool, "pool dtype").needs_scales:
        return pool
    return pool_dtype("auto", backend, checkpoint_dtype)
