"""Refuse what cannot match: a vLLM engine against the cache service's pool.

KV is shared only between engines that would have computed the same bytes: the same model (its
fingerprint: config and weights), the same number of layers, KV heads and head size, the same KV
dtype and the same block size. Any difference stops vLLM at startup with one line naming each
side of each difference and how to start the cache service to match.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from kvtier import kv_dtypes
from kvtier.model_spec import ModelShape
from kvtier.pool import PoolSpec


class IncompatiblePool(RuntimeError):
    """The engine's KV cannot be stored in, or served from, the cache service's pool."""


@dataclass(frozen=True)
class EngineKV:
    """What a vLLM engine's KV is: the fields compared with the pool's, in this order."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # kvtier's name of the KV element type
    block_size: int


def model_directory(model: str, revision: str | None = None) -> Path:
    """The local directory of vLLM's ``--model`` (a path, or a Hugging Face repo already downloaded)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:
        raise IncompatiblePool(
            f"kvtier connector: cannot find the files of model {model!r} locally to fingerprint it ({e})"
        ) from None


def engine_kv(vllm_config, kv_cache_spec, num_layers: int) -> EngineKV:
    """The engine's side, from its config and its (single) KV cache group's attention spec."""
    model_config = vllm_config.model_config
    directory = model_directory(model_config.model, getattr(model_config, "revision", None))
    return EngineKV(
        model_fingerprint=ModelShape.from_model_dir(directory).fingerprint,
        num_layers=num_layers,
        num_kv_heads=kv_cache_spec.num_kv_heads,
        head_dim=kv_cache_spec.head_size,
        dtype=kv_dtypes.of_torch(kv_cache_spec.dtype).name,
        block_size=kv_cache_spec.block_size,
    )


def pool_kv(spec: PoolSpec) -> EngineKV:
    """The pool's side, from its spec (shape ``[blocks, layers, 2, block_size, kv_heads, head_dim]``)."""
    return EngineKV(
        model_fingerprint=spec.model_fingerprint,
        num_layers=spec.shape[1],
        num_kv_heads=spec.shape[4],
        head_dim=spec.shape[5],
        dtype=kv_dtypes.lookup(spec.dtype, "pool dtype").name,
        block_size=spec.block_size,
    )


def check_engine_fits_pool(engine: EngineKV, spec: PoolSpec, address: str, model: str) -> None:
    """Raise IncompatiblePool, one line naming both sides of every field that differs."""
    pool = pool_kv(spec)
    diffs = []
    for field in fields(EngineKV):
        ours, theirs = getattr(engine, field.name), getattr(pool, field.name)
        if ours != theirs:
            if field.name == "model_fingerprint":
                ours, theirs = f"{ours[:12]}… ({model})", f"{theirs[:12]}…"
            diffs.append(f"{field.name} {ours} (vLLM) != {theirs} (pool)")
    if diffs:
        raise IncompatiblePool(
            f"kvtier connector: this vLLM engine cannot use the pool of the cache service at {address}: "
            + "; ".join(diffs)
            + f". Start the cache service for this engine: kvtier cache --model {model} "
            f"--block-size {engine.block_size} --kv-cache-dtype {engine.dtype}"
        )
