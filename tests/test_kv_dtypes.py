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


def test_the_cache_service_refuses_a_dtype_the_device_cannot_do_naming_the_flag(monkeypatch, caplog):
    from kvtier.cachesvc.__main__ import main

    # An Ampere GPU: Triton's fp8 conversions need compute capability 8.9.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake A100")
    argv = ["--backend", "cuda", "--kv-cache-dtype", "fp8", "--listen", "unix:///nonexistent/x.sock"]
    with caplog.at_level("ERROR", logger="kvtier.cache"):
        assert main(argv) == 2
    assert "cannot start: --kv-cache-dtype fp8: fp8_e4m3 needs compute capability 8.9+" in caplog.text
    assert "Fake A100 has 8.0" in caplog.text

    # A CPU torch without float8 types.
    caplog.clear()
    monkeypatch.delattr(torch, "float8_e5m2")
    argv = ["--backend", "cpu-shm", "--kv-cache-dtype", "fp8_e5m2", "--listen", "unix:///nonexistent/x.sock"]
    with caplog.at_level("ERROR", logger="kvtier.cache"):
        assert main(argv) == 2
    assert "cannot start: --kv-cache-dtype fp8_e5m2: this torch" in caplog.text
    assert "has no torch.float8_e5m2" in caplog.text
