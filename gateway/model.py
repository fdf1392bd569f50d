"""What the gateway knows about the served model: its name, tokenizer, chat template and context.

The gateway tokenizes prompts itself (so it can check `prompt + max_tokens` against the context
before any replica works on a request) and sends token ids to the replicas. It loads only the
tokenizer and config.json of `--model`, never the weights; for the built-in tiny model it builds
the same byte tokenizer the replicas use.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.generation_config import GENERATION_CONFIG, describe, read_generation_defaults
from kvtier.model_spec import ModelShape
from kvtier.tokenizer import load_tokenizer, with_chat_template

log = logging.getLogger("kvtier.gateway")


@dataclass
class ServedModel:
    name: str
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int
    root: str | None = None
    # max_new_tokens of the model's generation_config.json: the default max_tokens (None = none).
    default_max_tokens: int | None = None
    # The model's fingerprint as the cache services key blocks with it (the router names blocks).
    fingerprint: str = ""

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, with the special tokens the replica's encode adds (bos)."""
        return list(self.tokenizer.encode(text))

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, kwargs: dict | None = None
    ) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
        )
        # The template writes the special tokens (bos) itself; encoding must not add them again.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def load_served_model(model_dir: str | None, name: str) -> ServedModel:
    """The tokenizer and context of `model_dir` (config.json + tokenizer files), or of the tiny model."""
    defaults = read_generation_defaults(model_dir)
    if defaults:
        # The replicas apply the sampling ones; the gateway needs max_tokens to check the context.
        log.info("sampling defaults from %s/%s: %s", model_dir, GENERATION_CONFIG, describe(defaults))
    if model_dir is None:
        shape = ModelShape.tiny()
    else:
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:  # the fingerprint covers the weights: the cache services key blocks with it
            shape = ModelShape.from_model_dir(model_dir)
        except ValueError as e:  # a tokenizer-and-config directory: serving works, routing cannot name blocks
            log.info("%s; the KV-aware router predicts no hits without the weights' fingerprint", e)
            shape = ModelShape.from_hf_config(json.loads(config_file.read_text()))
    tokenizer = load_tokenizer(model_dir)
    if with_chat_template(tokenizer):
        log.info("the tokenizer has no chat template; chat uses kvtier's simple one (<|role|> lines)")
    return ServedModel(
        name=name,
        tokenizer=tokenizer,
        max_model_len=shape.max_model_len,
        vocab_size=shape.vocab_size,
        root=str(Path(model_dir).resolve()) if model_dir else None,
        default_max_tokens=defaults.get("max_tokens"),
        fingerprint=shape.fingerprint,
    )
