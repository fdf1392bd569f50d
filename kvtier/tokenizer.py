"""Tokenizers both sides load: the built-in byte tokenizer and a model directory's own, with a chat
template for tokenizers that have none.

The gateway tokenizes prompts and renders chats; a replica tokenizes text prompts and detokenizes
its output. Neither needs the model's weights for that, so this module stays apart from
computesvc.model (which pulls in torch's model code and kvtier's kernels). transformers is
imported when a tokenizer is made, not when this module is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.model_spec import TINY_LLAMA_CONFIG

# For tokenizers without a chat template (the built-in byte tokenizer, random benchmark models):
# the tools as JSON when given, each message on its own line after a role tag, then the
# assistant's tag to answer after.
SIMPLE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A real Hugging Face tokenizer whose tokens are bytes: id b is byte b, bos 256, eos 257.

    It is a byte-level BPE with no merges, so `save_pretrained` writes a `tokenizer.json` that
    `AutoTokenizer.from_pretrained` loads offline like any other model's. `encode` prepends bos;
    `decode` replaces invalid UTF-8 with U+FFFD. Returns a transformers PreTrainedTokenizerFast.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab |= {"<s>": TINY_LLAMA_CONFIG["bos_token_id"], "</s>": TINY_LLAMA_CONFIG["eos_token_id"]}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", TINY_LLAMA_CONFIG["bos_token_id"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def load_tokenizer(model_dir: str | Path | None) -> Any:
    """The tokenizer of `model_dir` (offline), or the byte tokenizer when it is None; a
    transformers PreTrainedTokenizerBase."""
    if model_dir is None:
        return build_byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def with_chat_template(tokenizer: Any) -> bool:
    """Give `tokenizer` SIMPLE_CHAT_TEMPLATE when it has no chat template; True when it had none."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return True
