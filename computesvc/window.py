"""Which blocks a sequence's attention will never read again: the sliding window's trail.

Only a model whose every attention layer has a sliding window (Mistral; Qwen2 with
`use_sliding_window` and `max_window_layers` 0) leaves blocks behind: a full-attention layer of
a mixed model (Qwen2's lower layers, Gemma-style alternation) reads every position, so such a
model keeps all its blocks. The window is what transformers hands each layer's attention
(`computesvc.paged_attention`), and the kernels read positions p - window + 1 .. p for the query
at position p (`kernels.paged_decode_attention`).
"""

from __future__ import annotations

from typing import Any


def release_window(config: Any) -> int | None:
    """The sliding window in tokens when every attention layer of the model `config` (a
    transformers config) has one, else None (no layer windowed, or some layer full)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    # Mixed models name each layer's kind (Qwen2: sliding from max_window_layers on); a config
    # without layer_types (Mistral) windows every layer with its one sliding_window.
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "sliding_attention" for kind in layer_types):
        return None
    return int(window)


def blocks_behind(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks wholly before the window of the next query (position `num_computed`, the
    first token not yet written) and so of every later one: positions below
    num_computed - window + 1. Units: tokens in, blocks out."""
    return max(0, num_computed - window + 1) // block_size
