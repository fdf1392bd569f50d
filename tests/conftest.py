"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face model directory holding the built-in tiny Llama (seed 0) and its
    byte tokenizer: config.json, model.safetensors, tokenizer.json, as a downloaded model has."""
    from computesvc.model import build_byte_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(seed=0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path
