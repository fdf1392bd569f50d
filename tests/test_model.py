"""The model runner over a paged pool computes what the Hugging Face model computes.

Reference: the same seeded model with transformers' own "eager" attention and no pool. The
runner's pool is a plain tensor; block ids are handed out in a shuffled order so a sequence's
blocks are scattered, as they are in a long-running cache service.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtier.cli.demo import blocks_per_gib
from kvtier.computesvc.model import (
    ModelRunner,
    PrefillInput,
    build_tiny_model,
    load_model,
)
from kvtier.computesvc.paged_attention import LeaseExpired, use_paged_attention
from kvtier.kernels.decode_plan import plan_decode
from kvtier.model_spec import TINY_LLAMA_CONFIG, ModelShape
from kvtier.tokenizer import build_byte_tokenizer

BLOCK_SIZE = 16
NUM_BLOCKS = 64
EOS = TINY_LLAMA_CONFIG["eos_token_id"]


class ShuffledBlocks:
    """Hands out pool block ids in a seeded random order (test-side stand-in for the block manager)."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def make_pool(
    model: torch.nn.Module, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """A pool filled with noise, so reading a slot nobody wrote shows up as wrong logits."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (num_blocks, c.num_hidden_layers, 2, block_size, c.num_key_value_heads, head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(model.dtype)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def prompt(length: int, salt: int = 0) -> list[int]:
    """bos + `length - 1` deterministic byte tokens."""
    g = torch.Generator().manual_seed(1000 + length + 7919 * salt)
    return [TINY_LLAMA_CONFIG["bos_token_id"], *torch.randint(0, 256, (length - 1,), generator=g).tolist()]


@pytest.fixture(scope="module")
def eager_model() -> torch.nn.Module:
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def paged_model() -> torch.nn.Module:
    model = build_tiny_model(seed=0)
    use_paged_attention(model)
    return model


def hf_greedy(model: torch.nn.Module, tokens: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([tokens], device=model.device), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(tokens) :].tolist()


def paged_greedy(
    runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, blocks: ShuffledBlocks
) -> list[list[int]]:
    """Prefill all prompts in one forward, then decode them together until eos or the limit."""
    tables = [blocks.take(blocks_for(len(p) + max_new_tokens)) for p in prompts]
    logits = runner.prefill([PrefillInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    outputs = [[tok] for tok in logits.argmax(-1).tolist()]
    for _ in range(max_new_tokens - 1):
        live = [i for i, out in enumerate(outputs) if out[-1] != EOS and len(out) < max_new_tokens]
        if not live:
            break
        logits = runner.decode(
            [outputs[i][-1] for i in live],
            [len(prompts[i]) + len(outputs[i]) - 1 for i in live],
            [tables[i] for i in live],
        )
        for i, tok in zip(live, logits.argmax(-1).tolist(), strict=True):
            outputs[i].append(tok)
    return outputs


def chunked_greedy(
    runner: ModelRunner, tokens: list[int], split: int, table: list[int], max_new_tokens: int
) -> list[int]:
    """Prefill `tokens` in two chunks (before and from `split`), then decode greedily."""
    runner.prefill([PrefillInput(tokens[:split], 0, table)])
    logits = runner.prefill([PrefillInput(tokens[split:], split, table)])
    out = [int(logits.argmax(-1))]
    for _ in range(max_new_tokens - 1):
        logits = runner.decode([out[-1]], [len(tokens) + len(out) - 1], [table])
        out.append(int(logits.argmax(-1)))
    return out


def test_decode_logits_match_eager_attention(eager_model, paged_model):
    tokens = prompt(21)
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    table = ShuffledBlocks(NUM_BLOCKS).take(2)
    with torch.no_grad():
        expected = eager_model(torch.tensor([tokens])).logits[0]

    prefill_logits = runner.prefill([PrefillInput(tokens[:20], 0, table)])
    decode_logits = runner.decode([tokens[20]], [20], [table])

    assert prefill_logits.dtype == decode_logits.dtype == torch.float32
    assert prefill_logits.shape == decode_logits.shape == (1, TINY_LLAMA_CONFIG["vocab_size"])
    torch.testing.assert_close(prefill_logits[0], expected[19], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode_logits[0], expected[20], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 16, 37])  # bos only, exactly one block, not a multiple of it
def test_greedy_matches_generate(eager_model, paged_model, length):
    tokens = prompt(length)
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    got = paged_greedy(runner, [tokens], 20, ShuffledBlocks(NUM_BLOCKS))
    assert got == [hf_greedy(eager_model, tokens, 20)]


def test_batch_at_different_lengths_decodes_together_like_generate(eager_model, paged_model):
    prompts = [prompt(n, salt=1) for n in (3, 16, 17, 40, 9)]
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    got = paged_greedy(runner, prompts, 12, ShuffledBlocks(NUM_BLOCKS, seed=3))
    assert got == [hf_greedy(eager_model, p, 12) for p in prompts]


def test_prefix_hit_prefills_only_the_suffix_and_matches_generate(eager_model, paged_model):
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    blocks = ShuffledBlocks(NUM_BLOCKS, seed=5)
    first = prompt(40, salt=2)
    first_table = blocks.take(blocks_for(40 + 8))
    runner.prefill([PrefillInput(first, 0, first_table)])
    # The second sequence shares the first's two full blocks (32 tokens), then diverges.
    cached = 2 * BLOCK_SIZE
    second = first[:cached] + prompt(11, salt=3)[1:]
    second_table = first_table[:2] + blocks.take(blocks_for(len(second) + 8) - 2)

    logits = runner.prefill([PrefillInput(second[cached:], cached, second_table)])
    out = [int(logits.argmax(-1))]
    for _ in range(7):
        logits = runner.decode([out[-1]], [len(second) + len(out) - 1], [second_table])
        out.append(int(logits.argmax(-1)))

    assert out == hf_greedy(eager_model, second, 8)


def test_sequences_over_one_shared_prefix_decode_together_like_generate(eager_model, paged_model):
    # Five prompts over the same four cached blocks decode in one batch: the torch path attends
    # the shared blocks once for all five (cascade) and each sequence's own blocks apart.
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    blocks = ShuffledBlocks(NUM_BLOCKS, seed=6)
    cached = 4 * BLOCK_SIZE
    prompts = [prompt(cached + 1, salt=8)[:cached] + prompt(n, salt=9 + n)[1:] for n in (2, 4, 12, 17, 20)]
    shared = blocks.take(4)
    tables = [shared + blocks.take(blocks_for(len(p) + 10) - 2) for p in prompts]
    runner.prefill([PrefillInput(prompts[0][:cached], 0, tables[0])])
    logits = runner.prefill(
        [PrefillInput(p[cached:], cached, t) for p, t in zip(prompts, tables, strict=True)]
    )
    outputs = [[tok] for tok in logits.argmax(-1).tolist()]
    lens = [len(p) + 1 for p in prompts]
    assert plan_decode(tables, lens, BLOCK_SIZE).shared is not None  # the step forms a group
    for _ in range(9):
        logits = runner.decode(
            [out[-1] for out in outputs],
            [len(p) + len(out) - 1 for p, out in zip(prompts, outputs, strict=True)],
            tables,
        )
        for out, tok in zip(outputs, logits.argmax(-1).tolist(), strict=True):
            out.append(tok)

    assert outputs == [hf_greedy(eager_model, p, 10) for p in prompts]


def test_transformers_forward_with_the_paged_hook_matches_generate(eager_model):
    # The path CUDA runs (transformers' forward, attention through the hook), checked on CPU.
    model = build_tiny_model(seed=0)
    use_paged_attention(model)
    runner = ModelRunner(model, make_pool(model), BLOCK_SIZE, own_forward=False)
    assert runner.own_forward is None and hasattr(model.model.layers[0].self_attn, "q_proj")
    prompts = [prompt(n, salt=4) for n in (5, 16, 33)]
    got = paged_greedy(runner, prompts, 12, ShuffledBlocks(NUM_BLOCKS, seed=2))
    assert got == [hf_greedy(eager_model, p, 12) for p in prompts]


def test_a_cpu_runner_runs_its_own_forward_over_fused_linears(paged_model):
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    attn, mlp = paged_model.model.layers[0].self_attn, paged_model.model.layers[0].mlp
    assert runner.own_forward is not None
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj")
    assert hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj")
    with pytest.raises(ValueError, match="fused"):
        ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE, own_forward=False)


def test_chunked_prefill_matches_generate(eager_model, paged_model):
    tokens = prompt(45, salt=4)
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    table = ShuffledBlocks(NUM_BLOCKS, seed=7).take(blocks_for(45 + 10))

    assert chunked_greedy(runner, tokens, 20, table, 10) == hf_greedy(eager_model, tokens, 10)


def test_writes_land_only_in_the_sequence_blocks_of_the_shared_pool(paged_model):
    pool = make_pool(paged_model)
    before = pool.clone()
    runner = ModelRunner(paged_model, pool, BLOCK_SIZE)
    table = [9, 3]
    runner.prefill([PrefillInput(prompt(20), 0, table)])

    changed = (pool != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 9]
    # Block 3 holds tokens 16..19 only: the rest of its slots keep their old contents.
    torch.testing.assert_close(pool[3, :, :, 4:], before[3, :, :, 4:], atol=0, rtol=0)


def test_the_lease_fence_reads_the_deadline_before_each_layer_write(paged_model):
    # A renewal that lands while a long step runs moves the deadline on: the fence reads it before
    # every layer's write, not once when the step starts; past it, no layer writes.
    pool = make_pool(paged_model)
    before = pool.clone()
    runner = ModelRunner(paged_model, pool, BLOCK_SIZE)
    reads = []

    def deadline() -> float:
        reads.append(len(reads))
        return time.monotonic() + 60.0 if len(reads) == 1 else time.monotonic() - 1.0

    runner.write_deadline = deadline
    with pytest.raises(LeaseExpired, match=r"lease deadline passed 1\.\d\ds before layer 1's KV write"):
        runner.prefill([PrefillInput(prompt(20), 0, [9, 3])])
    assert len(reads) == 2, "one read per layer until the fence stopped the step"
    written = pool != before
    assert written[:, 0].any() and not written[:, 1:].any(), (
        "layer 0 wrote, layer 1 (past the deadline) did not"
    )

    runner.write_deadline = lambda: time.monotonic() + 60.0  # renewed: the same step runs whole
    runner.prefill([PrefillInput(prompt(20), 0, [9, 3])])
    assert (pool != before)[:, 1:].any()


def test_runner_rejects_a_block_table_too_short_for_the_tokens(paged_model):
    runner = ModelRunner(paged_model, make_pool(paged_model), BLOCK_SIZE)
    with pytest.raises(ValueError, match="block_table has 1 blocks, 17 tokens need 2"):
        runner.prefill([PrefillInput(prompt(17), 0, [0])])
    with pytest.raises(ValueError, match=r"block ids \[64\] outside the pool \[0, 64\)"):
        runner.decode([5], [3], [[64]])


def test_runner_rejects_a_pool_of_another_shape(paged_model):
    pool = make_pool(paged_model, block_size=32)
    with pytest.raises(ValueError, match="pool shape"):
        ModelRunner(paged_model, pool, BLOCK_SIZE)


def test_runner_needs_the_paged_attention_implementation(eager_model):
    with pytest.raises(ValueError, match="use_paged_attention"):
        ModelRunner(eager_model, make_pool(eager_model), BLOCK_SIZE)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_family_decode_logits_match_eager(family):
    common = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_theta"}
    if family == "qwen2":  # q/k/v projections with bias
        config = Qwen2Config(**common, attn_implementation="eager")
        torch.manual_seed(0)
        eager = Qwen2ForCausalLM(config).eval()
    else:
        config = MistralConfig(**common, sliding_window=None, attn_implementation="eager")
        torch.manual_seed(0)
        eager = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for param in eager.parameters():  # default init is too flat to compare logits meaningfully
            param.normal_(0, 0.3)
    paged = type(eager)(copy.deepcopy(config)).eval()  # the attention choice lives in the config
    paged.load_state_dict(eager.state_dict())
    use_paged_attention(paged)
    tokens = prompt(19)
    runner = ModelRunner(paged, make_pool(paged), BLOCK_SIZE)
    table = [5, 2]

    runner.prefill([PrefillInput(tokens[:18], 0, table)])
    logits = runner.decode([tokens[18]], [18], [table])

    with torch.no_grad():
        expected = eager(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_greedy_on_cuda_with_triton_kernels_matches_generate():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the Triton path of the model runner is checked on GPU machines only")
    eager = build_tiny_model(seed=0).cuda()
    loaded = load_model(None, device="cuda")
    prompts = [prompt(n, salt=5) for n in (5, 16, 33)]
    runner = ModelRunner(loaded.model, make_pool(loaded.model).cuda(), BLOCK_SIZE)
    got = paged_greedy(runner, prompts, 16, ShuffledBlocks(NUM_BLOCKS))
    assert got == [hf_greedy(eager, p, 16) for p in prompts]


# --- ModelShape ---------------------------------------------------------------------------------


def test_shape_from_hf_config_defaults_head_dim_and_kv_heads():
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    shape = ModelShape.from_hf_config(config)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 32, 128)
    assert (shape.vocab_size, shape.max_model_len, shape.dtype) == (32000, 4096, "float16")
    assert shape.block_bytes(16, "float16") == 32 * 2 * 16 * 32 * 128 * 2
    gqa = ModelShape.from_hf_config({**config, "num_key_value_heads": 8, "head_dim": 64})
    assert (gqa.num_kv_heads, gqa.head_dim) == (8, 64)
    assert gqa.fingerprint != shape.fingerprint


def test_shape_serves_the_whole_context_of_a_sliding_window_model():
    config = {
        "model_type": "mistral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 258,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    # The kernels read each windowed layer's window only (tests/test_sliding_window.py): no cap.
    assert ModelShape.from_hf_config(config).max_model_len == 32768
    assert ModelShape.from_hf_config({**config, "sliding_window": None}).max_model_len == 32768


def test_demo_shows_blocks_per_gib_for_each_kv_dtype():
    mistral_7b = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    counts = blocks_per_gib(ModelShape.from_hf_config(mistral_7b), 16)
    # bf16: 32 layers x K/V x 16 tokens x 8 heads x 128 x 2 bytes = 2 MiB; one byte codes plus a
    # float32 scale per token-head: 132 bytes per head vector.
    assert counts["bfloat16"] == counts["float16"] == 512 and counts["float32"] == 256
    assert counts["fp8_e4m3"] == counts["fp8_e5m2"] == counts["int8"] == (1 << 30) // (32 * 2 * 16 * 8 * 132)
    kvtier = str(Path(sys.executable).parent / "kvtier")
    out = subprocess.run([kvtier, "demo", "--kv-dtypes"], capture_output=True, text=True, check=True).stdout
    tiny = blocks_per_gib(ModelShape.tiny(), 16)
    assert out.splitlines()[-1] == "kv dtypes: " + ", ".join(f"{n} {b} blocks/GiB" for n, b in tiny.items())


def test_tiny_shape_fingerprint_differs_by_seed_and_config():
    shape = ModelShape.tiny(0)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (2, 2, 16, 258)
    assert (shape.max_model_len, shape.dtype) == (1024, "float32")
    assert shape.block_bytes(16, "float32") == 2 * 2 * 16 * 2 * 16 * 4
    assert ModelShape.tiny(0) == shape
    assert ModelShape.tiny(1).fingerprint != shape.fingerprint
    bigger = ModelShape.from_hf_config(
        {"model_type": "llama", "dtype": "float32", **TINY_LLAMA_CONFIG, "vocab_size": 300}
    )
    assert bigger.fingerprint != shape.fingerprint


def test_describe_mismatch_names_each_differing_field():
    a = ModelShape.tiny(0)
    assert a.describe_mismatch(ModelShape.tiny(0)) is None
    message = a.describe_mismatch(ModelShape.tiny(1))
    assert "fingerprint" in message and "num_layers" not in message
    config = {"model_type": "llama", "dtype": "float32", **TINY_LLAMA_CONFIG, "num_hidden_layers": 3}
    message = a.describe_mismatch(ModelShape.from_hf_config(config))
    assert "num_layers: 2 != 3" in message and "fingerprint" in message and "head_dim" not in message


def test_shape_from_model_dir_reads_config_and_weights(tiny_model_dir, tmp_path):
    shape = ModelShape.from_model_dir(tiny_model_dir)
    tiny = ModelShape.tiny(0)
    assert (
        shape.describe_mismatch(tiny)
        == f"model shape mismatch: fingerprint: {shape.fingerprint!r} != {tiny.fingerprint!r}"
    )
    assert ModelShape.from_model_dir(tiny_model_dir) == shape
    # Other weights under the same config: another fingerprint.
    other = tmp_path / "other"
    build_tiny_model(seed=1).save_pretrained(other)
    assert ModelShape.from_model_dir(other).fingerprint != shape.fingerprint


def test_shape_from_model_dir_names_the_path_when_config_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no config.json in model directory {tmp_path}"):
        ModelShape.from_model_dir(tmp_path)


def test_load_model_refuses_an_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(
        ValueError, match=rf"{tmp_path}: model_type 'gpt2' is not supported; kvtier runs llama"
    ):
        load_model(tmp_path)


def test_load_model_from_a_saved_dir_offline_matches_the_tiny_model(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(str(tiny_model_dir))
    built = build_tiny_model(seed=0)

    assert loaded.model.config._attn_implementation == "kvtier_paged"
    assert loaded.model.dtype == torch.float32
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), built.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.shape == ModelShape.from_model_dir(tiny_model_dir)
    assert loaded.eos_token_ids == [EOS]
    ids = loaded.tokenizer.encode("héllo")
    assert ids == [256, *"héllo".encode()]
    assert loaded.tokenizer.decode([*ids, EOS], skip_special_tokens=True) == "héllo"
    assert loaded.tokenizer.decode([0xE2, 0x82]) == "\ufffd"

    runner = ModelRunner(loaded.model, make_pool(loaded.model), BLOCK_SIZE)
    assert paged_greedy(runner, [ids], 6, ShuffledBlocks(NUM_BLOCKS)) == [hf_greedy(built, ids, 6)]


def test_load_model_without_a_dir_builds_the_seeded_tiny_model():
    loaded = load_model(None, seed=3, dtype="bfloat16")
    assert loaded.shape == ModelShape.tiny(3)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.tokenizer.vocab_size == 258 and loaded.tokenizer.bos_token_id == 256
    assert loaded.eos_token_ids == [EOS]


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~5-12 s here
def test_tiny_model_and_fingerprints_are_identical_in_a_fresh_process(tiny_model_dir):
    script = f"""
import hashlib, torch
from kvtier.computesvc.model import build_tiny_model
from kvtier.model_spec import ModelShape
weights = b"".join(t.numpy().tobytes() for _, t in sorted(build_tiny_model(seed=0).state_dict().items()))
print(hashlib.sha256(weights).hexdigest(), ModelShape.tiny(0).fingerprint,
      ModelShape.from_model_dir({str(tiny_model_dir)!r}).fingerprint)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    weights = b"".join(t.numpy().tobytes() for _, t in sorted(build_tiny_model(seed=0).state_dict().items()))
    assert out == [
        hashlib.sha256(weights).hexdigest(),
        ModelShape.tiny(0).fingerprint,
        ModelShape.from_model_dir(Path(tiny_model_dir)).fingerprint,
    ]


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = build_byte_tokenizer()
    text = "naïve 🙂\n\ttabs  "
    ids = tokenizer.encode(text)
    assert ids == [256, *text.encode()]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
