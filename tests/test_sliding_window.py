"""Sliding-window attention: the kernels read only each query's window, and models with windowed
layers (all of them, Mistral-style, or some, Qwen2 with max_window_layers) decode greedily as
Hugging Face does at lengths beyond the window, through the paged runner.

Table entries of blocks wholly before a window may be placeholders (item 2 of issue 24 releases
those blocks): the kernel tests point them at a poisoned block that would show in the output
if it were attended.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from test_kernels import make_paged_batch, poison_before_windows
from test_model import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    ShuffledBlocks,
    chunked_greedy,
    hf_greedy,
    make_pool,
    paged_greedy,
    prompt,
)
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtier import kernels
from kvtier.computesvc.model import ModelRunner, seed_weights
from kvtier.computesvc.paged_attention import use_paged_attention
from kvtier.model_spec import TINY_LLAMA_CONFIG

WINDOW = 24  # tokens: 1.5 blocks, so windows start mid-block


def windowed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int):
    """fp32 SDPA of queries [Q, H, D] at positions q_pos over keys [L, Hkv, D] at 0..L-1, each
    query seeing positions q_pos - window + 1 .. q_pos. Returns [Q, H, D]."""
    k_pos = torch.arange(k.shape[0])
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [1, 5, WINDOW, 1000])
def test_decode_reads_only_the_window(window):
    lens = [70, 3, 33, 17, 0]
    batch = make_paged_batch(lens, 2, 16, 8, torch.float32)
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(3))
    expected = torch.zeros_like(q)
    for seq, n in enumerate(lens):
        if n:
            k, v = batch.contiguous_kv(seq)
            expected[seq] = windowed_sdpa(q[seq : seq + 1], k, v, torch.tensor([n - 1]), window)[0]
    poison_before_windows(batch, [n - window for n in lens])

    out = kernels.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 16**-0.5, window=window
    )

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, WINDOW])
def test_prefill_reads_only_the_window(window):
    shapes = [(40, 9), (0, 30), (13, 1)]  # (cached prefix, new tokens)
    batch = make_paged_batch([p + n for p, n in shapes], 2, 16, 8, torch.float32)
    cu = [0, *itertools.accumulate(n for _, n in shapes)]
    q = torch.randn(cu[-1], 6, 16, generator=torch.Generator().manual_seed(4))
    expected = torch.zeros_like(q)
    for seq, (prefix, new) in enumerate(shapes):
        k, v = batch.contiguous_kv(seq)
        q_pos = torch.arange(prefix, prefix + new)
        expected[cu[seq] : cu[seq + 1]] = windowed_sdpa(q[cu[seq] : cu[seq + 1]], k, v, q_pos, window)
    poison_before_windows(batch, [prefix - window + 1 for prefix, _ in shapes])

    out = kernels.paged_prefill_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        torch.tensor(cu, dtype=torch.int32),
        batch.seq_lens,
        16**-0.5,
        window=window,
    )

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_kernels_reject_a_window_that_is_not_a_positive_int(window):
    batch = make_paged_batch([5], 1, 16, 8, torch.float32)
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match=f"window must be None or an int >= 1 \\(tokens\\), got {window!r}"):
        kernels.paged_decode_attention(
            q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0, window=window
        )


# --- greedy parity with Hugging Face beyond the window -------------------------------------------


def windowed_model(family: str, window: int | None):
    """A seeded tiny model of `family` ("mistral": every layer windowed; "qwen2-mixed": layer 0
    full, layer 1 windowed) with eager attention; window None turns the window off."""
    common = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_theta"}
    if family == "mistral":
        config = MistralConfig(**common, sliding_window=window, attn_implementation="eager")
        model = MistralForCausalLM(config)
    else:
        config = Qwen2Config(
            **common,
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=1,
            attn_implementation="eager",
        )
        model = Qwen2ForCausalLM(config)
    model = seed_weights(model, seed=5).eval()
    model.generation_config.pad_token_id = config.eos_token_id
    return model


def paged_copy(eager: torch.nn.Module) -> torch.nn.Module:
    paged = type(eager)(copy.deepcopy(eager.config)).eval()  # the attention choice lives in the config
    paged.load_state_dict(eager.state_dict())
    use_paged_attention(paged)
    return paged


@pytest.fixture(scope="module", params=["mistral", "qwen2-mixed"])
def family(request) -> str:
    return request.param


def test_mixed_model_has_full_and_windowed_layers():
    config = windowed_model("qwen2-mixed", WINDOW).config
    assert config.layer_types == ["full_attention", "sliding_attention"]


def test_the_window_changes_what_the_model_computes(family):
    # Guards the parity tests below: were the window ignored, they would fail.
    tokens = torch.tensor([prompt(60, salt=9)])
    with torch.no_grad():
        windowed = windowed_model(family, WINDOW)(tokens).logits[0, -1]
        full = windowed_model(family, None)(tokens).logits[0, -1]
    assert (windowed - full).abs().max() > 1e-2


def test_greedy_beyond_the_window_matches_generate(family):
    eager = windowed_model(family, WINDOW)
    runner = ModelRunner(paged_copy(eager), make_pool(eager), BLOCK_SIZE)
    prompts = [prompt(45, salt=6), prompt(9, salt=6), prompt(30, salt=6)]
    got = paged_greedy(runner, prompts, 40, ShuffledBlocks(NUM_BLOCKS, seed=2))
    assert got == [hf_greedy(eager, p, 40) for p in prompts]


def test_chunked_prefill_beyond_the_window_matches_generate(family):
    eager = windowed_model(family, WINDOW)
    runner = ModelRunner(paged_copy(eager), make_pool(eager), BLOCK_SIZE)
    tokens = prompt(70, salt=8)
    table = ShuffledBlocks(NUM_BLOCKS, seed=3).take(-(-(70 + 12) // BLOCK_SIZE))

    assert chunked_greedy(runner, tokens, 33, table, 12) == hf_greedy(eager, tokens, 12)
