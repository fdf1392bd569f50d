"""The one dtype table (kvtier/kv_dtypes.py) and the rules read from it."""

from __future__ import annotations

import pytest
import torch

from kvtier import kv_dtypes
from kvtier.model_spec import ModelShape


def test_every_entry_names_a_torch_dtype_of_its_size():
    for name, entry in kv_dtypes.TABLE.items():
        assert entry.torch_dtype().itemsize == entry.itemsize, name
        assert entry.needs_scales == (entry.qmax > 0), name
        if entry.needs_scales:
            stored = torch.tensor([entry.qmax]).to(entry.torch_dtype()).float().item()
            assert stored == entry.qmax, f"{name}: qmax {entry.qmax} does not round-trip ({stored})"


def test_aliases_and_unknown_names():
    assert kv_dtypes.lookup("fp8").name == "fp8_e4m3"
    assert kv_dtypes.torch_dtype("fp8") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="'float64' is not one of"):
        kv_dtypes.lookup("float64")
    with pytest.raises(ValueError, match="model dtype 'int8' is not one of"):
        kv_dtypes.model_dtype("int8")
    assert set(kv_dtypes.KV_CACHE_DTYPE_CHOICES) >= {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"}


def test_auto_and_the_weights_dtype():
    assert kv_dtypes.pool_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert kv_dtypes.pool_dtype("auto", "cpu-shm", "bfloat16") == "float32"
    assert kv_dtypes.pool_dtype("fp8", "cuda", "bfloat16") == "fp8_e4m3"
    # A model-dtype pool is read as it is, so the weights run in it; a quantized one does not
    # decide the weights' dtype.
    assert kv_dtypes.weights_dtype("float16", "cuda", "bfloat16") == "float16"
    assert kv_dtypes.weights_dtype("fp8_e4m3", "cuda", "bfloat16") == "bfloat16"
    assert kv_dtypes.weights_dtype("int8", "cpu-shm", "bfloat16") == "float32"


def test_block_bytes_count_the_scales():
    shape = ModelShape.tiny()  # 2 layers, 2 KV heads, head_dim 16
    assert shape.block_bytes(16, "bfloat16") == 2 * 2 * 16 * 2 * 16 * 2
    # one byte per element plus one float32 scale per (layer, K/V, token, KV head)
    assert shape.block_bytes(16, "fp8_e4m3") == 2 * 2 * 16 * 2 * (16 + 4)
    assert shape.block_bytes(16, "int8") == shape.block_bytes(16, "fp8_e5m2")
    with pytest.raises(ValueError, match="pool dtype 'float64'"):
        shape.block_bytes(16, "float64")
