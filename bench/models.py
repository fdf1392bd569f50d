"""Random byte-vocabulary Llama checkpoints for benchmarks: real HF directories, no download.

The tiny test model is too small for prefill to cost anything on a CPU; these are big enough
that prefix caching and batching show, and load through the same `--model DIR` path a user's
checkpoint does.
"""

from __future__ import annotations

from pathlib import Path


def random_llama_dir(
    path: Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_positions: int,
    seed: int = 0,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Save a seeded-random Llama (intermediate 2 x hidden unless given; the byte vocabulary unless
    `vocab_size` is larger: ids past the bytes decode to nothing) and the byte tokenizer to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.model_spec import TINY_LLAMA_CONFIG
    from kvtier.tokenizer import build_byte_tokenizer

    config = LlamaConfig(
        **{
            **TINY_LLAMA_CONFIG,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": max_positions,
            **({"vocab_size": vocab_size} if vocab_size else {}),
        }
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path
