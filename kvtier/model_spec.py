"""What the cache service and compute service must agree on about the model.

The cache service sizes its pool from a `ModelShape` (it never loads weights); the compute
service builds one from the model it loaded and refuses to attach to a pool made for another.
No torch import here: the cache service reads this without paying for torch's import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier import kv_dtypes
from kvtier.file_digests import file_digests

log = logging.getLogger("kvtier.model")

# LlamaConfig kwargs of the built-in test model: a byte-level vocabulary (256 bytes + bos + eos).
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 258,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "bos_token_id": 256,
    "eos_token_id": 257,
}

# Decoder families whose attention is plain causal GQA with RoPE: what our kernels compute.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

# Keys of config.json that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "use_cache", "return_dict"})

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# The tokenizer's files, hashed whole with the weights where a model directory has them: they
# decide the token ids a prompt becomes, and so which KV a record holds for a given text.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class ModelShape:
    """The model's KV geometry plus an identity, enough to size and check a pool.

    `dtype` is the checkpoint's own dtype ("float32", "float16", "bfloat16"); the pool's dtype is
    chosen separately (see `block_bytes`). `fingerprint` is a hex sha256 over the config and the
    weights' identity: two compute processes may share KV blocks only if their fingerprints match.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: str
    fingerprint: str

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], weights_id: str = "") -> ModelShape:
        """Shape of a Hugging Face config dict (as in config.json); `weights_id` names the weights.

        Raises ValueError for a model type other than Llama, Qwen2, Mistral or a missing field.
        """
        model_type = config.get("model_type")
        _check_supported(model_type)
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            num_layers = int(config["num_hidden_layers"])
            vocab_size = int(config["vocab_size"])
            max_positions = int(config["max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"config of model_type {model_type!r} lacks field {e.args[0]!r}") from None
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        kv_dtypes.model_dtype(dtype, "config dtype")
        # A sliding window caps no context: the kernels read each windowed layer's window only
        # (the layer's `sliding_window` reaches computesvc.paged_attention), so every position serves.
        max_model_len = max_positions
        identity = {
            k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")
        }
        blob = json.dumps({"config": identity, "weights_id": weights_id}, sort_keys=True, default=str)
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            dtype=dtype,
            fingerprint=hashlib.sha256(blob.encode()).hexdigest(),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        """Shape of a local Hugging Face model directory (config.json + weight files).

        The weights' identity is a sha256 over each weight and tokenizer file's name, size and
        blake3 digest of its every byte (``kvtier.file_digests``: hashed at streaming speed, then
        cached by file identity, so a restart of an unchanged model does not rehash); config.json
        enters as its parsed keys, less those that do not change what the model computes. One
        INFO line says how long it took and what came from the digest cache.
        """
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        # Before hashing weights: a model we cannot run should fail fast and say why.
        try:
            _check_supported(config.get("model_type"))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        weight_files = sorted({f for pattern in _WEIGHT_PATTERNS for f in path.glob(pattern) if f.is_file()})
        if not weight_files:
            raise ValueError(f"no *.safetensors or *.bin weight files in model directory {path}")
        files = weight_files + [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        digests, report = file_digests(files)
        log.info("model %s fingerprinted: %s", path, report.describe())
        weights = hashlib.sha256()
        for f, digest in zip(files, digests, strict=True):
            weights.update(f"{f.name}\0{f.stat().st_size}\0{digest}\n".encode())
        try:
            return cls.from_hf_config(config, weights_id=weights.hexdigest())
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def tiny(cls, seed: int = 0) -> ModelShape:
        """Shape of the built-in seeded-random model; its fingerprint covers the config and seed."""
        config = {"model_type": "llama", "dtype": "float32", **TINY_LLAMA_CONFIG}
        return cls.from_hf_config(config, weights_id=f"kvtier-tiny-seed-{seed}")

    def block_bytes(self, block_size: int, dtype: str) -> int:
        """Bytes of one pool block (K and V of `block_size` tokens in every layer) stored as `dtype`,
        with a quantized dtype's scales (kvtier.kv_dtypes.token_head_bytes)."""
        per_token_head = kv_dtypes.token_head_bytes(kv_dtypes.lookup(dtype, "pool dtype").name, self.head_dim)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return self.num_layers * 2 * block_size * self.num_kv_heads * per_token_head

    def describe_mismatch(self, other: ModelShape) -> str | None:
        """One line naming each field that differs (`num_layers: 2 != 32`), or None if all match."""
        diffs = [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "model shape mismatch: " + "; ".join(diffs) if diffs else None


def _check_supported(model_type: object) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; kvtier runs {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(decoders with causal RoPE attention)"
        )
