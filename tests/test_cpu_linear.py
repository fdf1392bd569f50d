"""A float32 model on CPU runs its linears on oneDNN-prepacked weights (computesvc.cpu_linear),
with the same logits as plain `F.linear` up to float rounding; other dtypes are left as they are.
Greedy parity with Hugging Face over the packed path is tests/test_model.py's (its runners pack)."""

from __future__ import annotations

import pytest
import torch

from kvtier.computesvc.cpu_linear import PackedLinear, pack_linears
from kvtier.computesvc.model import ModelRunner, PrefillInput, build_tiny_model
from kvtier.computesvc.paged_attention import use_paged_attention
from kvtier.model_spec import TINY_LLAMA_CONFIG

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN: linears stay plain"
)


def runner_for(model: torch.nn.Module) -> ModelRunner:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    pool = torch.zeros(8, cfg.num_hidden_layers, 2, 16, cfg.num_key_value_heads, head_dim, dtype=model.dtype)
    use_paged_attention(model)
    return ModelRunner(model, pool, 16)


def test_a_float32_cpu_runner_packs_every_linear_and_keeps_the_logits():
    plain = build_tiny_model(seed=0)
    tokens = [TINY_LLAMA_CONFIG["bos_token_id"], *range(20)]
    with torch.no_grad():
        expected = plain(torch.tensor([tokens])).logits[0, -1]

    runner = runner_for(build_tiny_model(seed=0))
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    logits = runner.prefill([PrefillInput(tokens, 0, [0, 1])])[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # A second runner over the same model (a replica re-attaching) finds nothing left to pack.
    assert pack_linears(runner.model) == 0


def test_a_bfloat16_model_keeps_its_plain_linears():
    model = build_tiny_model(seed=0, dtype=torch.bfloat16)
    runner_for(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert any(type(m) is torch.nn.Linear for m in model.modules())
