"""Reading a model's generation_config.json into request defaults (kvtier.generation_config)."""

from __future__ import annotations

import json

import pytest

from kvtier.generation_config import describe, read_generation_defaults


def write(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_only_the_sampling_keys_the_file_sets_become_defaults(tmp_path):
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "bos_token_id": 1, "max_new_tokens": 64}
    defaults = read_generation_defaults(write(tmp_path, config))
    # top_k, min_p and repetition_penalty are absent from the file: no default for them (HF's
    # class default top_k=50 is not the model's choice).
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert describe(defaults) == "max_tokens=64 temperature=0.6 top_p=0.9"


def test_do_sample_false_means_greedy_whatever_the_temperature(tmp_path):
    config = {"do_sample": False, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3, "min_p": 0.05}
    defaults = read_generation_defaults(write(tmp_path, config))
    assert defaults == {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.3, "min_p": 0.05}
    assert isinstance(defaults["top_k"], int)


def test_no_directory_or_no_file_means_no_defaults(tmp_path):
    assert read_generation_defaults(None) == {}
    assert read_generation_defaults(tmp_path) == {}
    assert describe({}) == "none"


def test_a_broken_file_names_itself(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        read_generation_defaults(tmp_path)
