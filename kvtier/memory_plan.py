"""Device memory planning: how much of a GPU the cache service's pool may take, and whether a
compute replica still fits before it loads its weights.

vLLM's ``--gpu-memory-utilization`` semantics, for the two kinds of process kvtier runs on one
device: ``--memory-fraction`` is a share of the device's *total* memory for everything kvtier
runs on it. The cache service starts first and sizes its pool as

    pool = total x fraction - in use by others at startup - N x (weights + activation reserve)

(N = ``--compute-replicas``), so the replicas that start after it still find room for their
weights and their largest forward. Memory others hold at startup counts against the budget (as
vLLM's ``gpu_memory_utilization`` caps the device's use, not this process's share of what is
free). A replica checks free device memory before it loads weights and refuses with the numbers.

Pure arithmetic and file headers: no torch, no device. The callers read the device
(``torch.cuda.mem_get_info``) and pass the figures in, so every rule here is unit-tested on CPU
with stated device sizes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier import kv_dtypes

GIB = 1 << 30
MIB = 1 << 20

# Bytes per element of each safetensors dtype (the header's names): the checkpoint file format's
# own types (integers, bools); the dtypes weights and KV run in are kvtier.kv_dtypes.
SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}

# Per replica, beyond weights and activations: its CUDA context, cuBLAS / Triton workspaces and
# the caching allocator's fragmentation. Measured contexts run 300-600 MiB on recent drivers.
RUNTIME_OVERHEAD_BYTES = 768 * MIB

# The compute service's defaults (computesvc/config.py): the largest forward the estimate covers.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64

_MAX_HEADER_BYTES = 100 * MIB  # safetensors refuses larger headers too


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals (``1.50 GiB``)."""
    return f"{n / GIB:.2f} GiB"


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class WeightSize:
    """A model's weight bytes as a replica will hold them, and where the figure comes from."""

    num_bytes: int
    num_params: int | None
    source: str  # one line: "safetensors headers of 2 files, 1,100,048,384 params as bfloat16"


def safetensors_tensors(path: str | Path) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of a .safetensors file, read from its header alone (no tensor data).

    Raises ValueError naming the file when the header is not a safetensors header.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not JSON: {e}") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = (str(entry["dtype"]), [int(d) for d in entry["shape"]])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: safetensors entry {name!r} lacks dtype or shape") from None
    return out


def checkpoint_weight_bytes(model_dir: str | Path, dtype: str | None = None) -> WeightSize:
    """Weight bytes of a Hugging Face checkpoint directory, without loading it.

    From the safetensors headers (every ``*.safetensors``: shards too) when there are any:
    parameters times ``dtype``'s size (the dtype the replica runs in), or the stored bytes when
    ``dtype`` is None. Otherwise the weight files' sizes (``*.bin``), which is what they store.
    """
    model_dir = Path(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        params = 0
        stored = 0
        for shard in shards:
            for name, (st_dtype, shape) in safetensors_tensors(shard).items():
                numel = 1
                for d in shape:
                    numel *= d
                if st_dtype not in SAFETENSORS_ITEMSIZE:
                    raise ValueError(f"{shard}: tensor {name!r} has unknown dtype {st_dtype!r}")
                params += numel
                stored += numel * SAFETENSORS_ITEMSIZE[st_dtype]
        as_run = params * kv_dtypes.model_dtype(dtype).itemsize if dtype else stored
        what = f"as {dtype}" if dtype else "as stored"
        return WeightSize(
            as_run, params, f"safetensors headers of {len(shards)} file(s), {params:,} params {what}"
        )
    files = sorted(f for f in model_dir.glob("*.bin") if f.is_file())
    if not files:
        raise ValueError(f"no *.safetensors or *.bin weight files in {model_dir}")
    size = sum(f.stat().st_size for f in files)
    return WeightSize(size, None, f"sizes of {len(files)} *.bin file(s) (no safetensors header)")


def config_param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama / Qwen2 / Mistral decoder from its config dict (for a model built in
    code, which has no files to read): embeddings, per layer attention + MLP + two norms, the final
    norm, and the LM head unless tied."""
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    vocab = int(config["vocab_size"])
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if config.get("model_type") == "qwen2" or config.get("attention_bias"):
        attn += (heads + 2 * kv) * hd
    per_layer = attn + 3 * h * inter + 2 * h
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    return vocab * h + layers * per_layer + h + head


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Reserve:
    """Per-replica bytes beyond the weights: activations of the largest forward plus runtime overhead."""

    num_bytes: int
    source: str


def estimate_activation_reserve(
    config: dict[str, Any],
    dtype: str,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> Reserve:
    """The largest forward's transient memory, from the model shape, plus RUNTIME_OVERHEAD_BYTES.

    Per batched token, at the peak of one decoder layer (the others' activations are freed by
    then): the residual stream and its norm (2 x hidden), Q, K, V and the attention output
    ((2 x heads + 2 x kv heads) x head_dim), and the MLP's gate, up and product (3 x intermediate),
    each at ``dtype``'s size, doubled for the allocator's rounding and the copies the attention
    path makes (contiguous Q/K/V). Plus fp32 logits of the sequences' last tokens
    (``max_num_seqs`` x vocab x 4, twice: the logits and the sampler's softmax). An estimate;
    ``--activation-reserve-gib`` replaces it.
    """
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    per_token = (2 * h + (2 * heads + 2 * kv) * hd + 3 * inter) * kv_dtypes.model_dtype(dtype).itemsize * 2
    activations = max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab * 4
    return Reserve(
        activations + RUNTIME_OVERHEAD_BYTES,
        f"estimate: {gib(activations)} activations of a {max_num_batched_tokens}-token, "
        f"{max_num_seqs}-sequence forward + {gib(RUNTIME_OVERHEAD_BYTES)} CUDA context and allocator "
        "slack (--activation-reserve-gib overrides)",
    )


# --------------------------------------------------------------------------- the plan


class MemoryPlanError(ValueError):
    """The device's memory cannot hold what was asked; the message carries the arithmetic."""


@dataclass(frozen=True)
class DevicePoolPlan:
    """How the cache service's pool is sized on a device; ``describe()`` is the logged block."""

    device: str
    total_bytes: int
    free_bytes: int
    memory_fraction: float
    num_replicas: int
    weights: WeightSize
    reserve: Reserve
    block_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.memory_fraction)

    @property
    def used_by_others(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def per_replica_bytes(self) -> int:
        return self.weights.num_bytes + self.reserve.num_bytes

    @property
    def replicas_bytes(self) -> int:
        return self.num_replicas * self.per_replica_bytes

    @property
    def pool_bytes(self) -> int:
        """What is left for the pool (negative when the budget cannot even hold the rest)."""
        return self.budget_bytes - self.used_by_others - self.replicas_bytes

    @property
    def num_blocks(self) -> int:
        return max(0, self.pool_bytes) // self.block_bytes

    def describe(self) -> str:
        rows = [
            f"device memory plan for {self.device}:",
            f"  device total                        {gib(self.total_bytes):>12}",
            f"  x --memory-fraction {self.memory_fraction:<5g}          = {gib(self.budget_bytes):>12}"
            "  budget for everything kvtier runs on this device",
            f"  - in use by others at startup       {gib(self.used_by_others):>12}"
            f"  (total - free; free {gib(self.free_bytes)})",
            f"  - {self.num_replicas} compute replica(s) x {gib(self.per_replica_bytes):<10} = "
            f"{gib(self.replicas_bytes):>12}  (--compute-replicas)",
            f"      weights                         {gib(self.weights.num_bytes):>12}"
            f"  ({self.weights.source})",
            f"      activation reserve              {gib(self.reserve.num_bytes):>12}  ({self.reserve.source})",
            f"  = KV pool                           {gib(self.pool_bytes):>12}"
            f"  = {self.num_blocks} blocks x {self.block_bytes} bytes",
        ]
        return "\n".join(rows)

    def check(self) -> DevicePoolPlan:
        """Self, or MemoryPlanError (with the whole block) when the pool gets less than one block."""
        if self.num_blocks < 1:
            raise MemoryPlanError(
                f"the device memory budget leaves {gib(self.pool_bytes)} for the KV pool, less than "
                f"one block ({self.block_bytes} bytes): raise --memory-fraction, lower "
                "--compute-replicas or --activation-reserve-gib, free the device, or give --num-blocks\n"
                + self.describe()
            )
        return self


def plan_device_pool(
    *,
    device: str,
    total_bytes: int,
    free_bytes: int,
    memory_fraction: float,
    block_bytes: int,
    num_replicas: int,
    weights: WeightSize,
    reserve: Reserve,
) -> DevicePoolPlan:
    """The pool's share of a device of ``total_bytes`` with ``free_bytes`` free now (module doc).

    Raises MemoryPlanError for a fraction outside (0, 1], a negative replica count, figures that
    contradict each other, or a budget that leaves less than one block.
    """
    if not 0 < memory_fraction <= 1:
        raise MemoryPlanError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    if num_replicas < 0:
        raise MemoryPlanError(f"--compute-replicas must be >= 0, got {num_replicas}")
    if block_bytes < 1:
        raise MemoryPlanError(f"block size in bytes must be >= 1, got {block_bytes}")
    if not 0 <= free_bytes <= total_bytes:
        raise MemoryPlanError(
            f"device reports {free_bytes} bytes free of {total_bytes}: not 0 <= free <= total"
        )
    return DevicePoolPlan(
        device, total_bytes, free_bytes, memory_fraction, num_replicas, weights, reserve, block_bytes
    ).check()


def check_replica_fits(
    *, device: str, total_bytes: int, free_bytes: int, weights: WeightSize, reserve: Reserve
) -> str:
    """Before a replica loads its weights: raise MemoryPlanError unless free memory holds its
    weights and activation reserve; return the one-line figures otherwise (for the log)."""
    need = weights.num_bytes + reserve.num_bytes
    figures = (
        f"{device}: {gib(free_bytes)} free of {gib(total_bytes)}; this replica needs {gib(need)} = "
        f"weights {gib(weights.num_bytes)} ({weights.source}) + activation reserve "
        f"{gib(reserve.num_bytes)} ({reserve.source})"
    )
    if free_bytes < need:
        raise MemoryPlanError(
            f"not enough free device memory to load the model on {figures}; short by "
            f"{gib(need - free_bytes)}. The cache service's pool, other replicas and other processes "
            "hold the rest: start the cache service with a lower --memory-fraction or a higher "
            "--compute-replicas (its pool is sized for that many replicas), or stop what else runs there"
        )
    return figures


def model_needs(
    model_dir: str | Path | None, dtype: str, reserve_bytes: int | None = None
) -> tuple[WeightSize, Reserve]:
    """Weights (at ``dtype``) and activation reserve of one replica of the model in ``model_dir``
    (None: the built-in tiny model, counted from its config). ``reserve_bytes`` overrides the estimate."""
    if model_dir is None:
        from kvtier.model_spec import TINY_LLAMA_CONFIG

        config: dict[str, Any] = {"model_type": "llama", **TINY_LLAMA_CONFIG}
        params = config_param_count(config)
        weights = WeightSize(
            params * kv_dtypes.model_dtype(dtype).itemsize,
            params,
            f"{params:,} params of the built-in model as {dtype}",
        )
    else:
        config_file = Path(model_dir) / "config.json"
        try:
            config = json.loads(config_file.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json in model directory {model_dir}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        weights = checkpoint_weight_bytes(model_dir, dtype)
    if reserve_bytes is not None:
        reserve = Reserve(reserve_bytes, "given (--activation-reserve-gib)")
    else:
        try:
            reserve = estimate_activation_reserve(config, dtype)
        except KeyError as e:
            raise ValueError(
                f"config of {model_dir} lacks {e.args[0]!r}: give --activation-reserve-gib"
            ) from None
    return weights, reserve
