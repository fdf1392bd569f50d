"""What a quantized KV cache costs in quality and buys in capacity, in one run.

For each model (the seeded test model and seeded models of the parity tests' shapes: GQA, MQA,
head_dim 80 and 96, a Qwen2 with q/k/v biases) and each --kv-cache-dtype, against the model's
own dtype (float32 here, what `auto` gives a CPU pool), on the English text in bench/text/:

- perplexity of the text (teacher-forced, prefilled in chunks of 512 so later chunks read the
  earlier ones' K/V from the pool, as serving does) and its increase over the model's dtype;
- mean KL(model dtype || quantized) of the next-token distributions over the same positions;
- greedy agreement: of 128 greedy tokens after a prompt, the share before the first difference;
- blocks per GiB (block_size 16, scales included) and decode tokens/s of the model runner
  (8 sequences, CPU torch path).

The shipped scheme is one float32 scale per (layer, K/V, token, KV head), computed when the KV
is written. For comparison, per-tensor scaling (one static scale per layer and K/V, calibrated
as the absmax over this very text, i.e. at its best) fake-quantizes K/V in the same forward.

The models are random: their perplexity of English is near the vocabulary size, and what
matters is how much each dtype moves it.

    .venv/bin/python bench/kv_dtype.py              # every model, prompts of 512, 2048 and 4096 tokens
    .venv/bin/python bench/kv_dtype.py --quick      # the seeded test model at 512 tokens
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtier import kv_dtypes  # noqa: E402
from kvtier.computesvc.model import ModelRunner, PrefillInput, build_tiny_model, seed_weights  # noqa: E402
from kvtier.computesvc.paged_attention import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    paged_attention_forward,
    use_paged_attention,
)
from kvtier.model_spec import TINY_LLAMA_CONFIG, ModelShape  # noqa: E402
from kvtier.pool import pool_shape, private_pool  # noqa: E402

TEXT = Path(__file__).resolve().parent / "text" / "english.txt"
BLOCK_SIZE = 16
CHUNK = 512
GIB = 1 << 30
SHIPPED = ("fp8_e4m3", "fp8_e5m2", "int8")
PER_TENSOR = ("int8", "fp8_e4m3")


def _shape(hidden: int, heads: int, kv_heads: int) -> dict[str, int]:
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads}


# Parity-test shapes (tests/test_model.py families), sized so a 4k-token prefill takes seconds.
MODELS = {
    "tiny-llama gqa 4/2 d16": None,
    "llama gqa 8/2 d64": (LlamaConfig, _shape(512, 8, 2)),
    "llama mqa 8/1 d64": (LlamaConfig, _shape(512, 8, 1)),
    "llama d80 4/2": (LlamaConfig, _shape(320, 4, 2)),
    "qwen2 bias d96 4/2": (Qwen2Config, _shape(384, 4, 2)),
    "llama gqa 8/2 d64 K-outliers": (LlamaConfig, _shape(512, 8, 2)),
}
# Trained LLMs' keys carry a few channels an order of magnitude larger than the rest; random
# weights have none, so the "K-outliers" model scales these K channels of every KV head by 10.
OUTLIER_CHANNELS = (3, 17)
OUTLIER_GAIN = 10.0


def text_tokens() -> list[int]:
    """bos + the bytes of the English text (the byte tokenizer's ids)."""
    return [TINY_LLAMA_CONFIG["bos_token_id"], *TEXT.read_bytes()]


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The named seeded model (float32, eval, paged attention)."""
    if MODELS[name] is None:
        model = build_tiny_model(seed)
    else:
        config_cls, shape = MODELS[name]
        base = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_theta"}
        sizes = {"num_hidden_layers": 4, "intermediate_size": 2 * shape["hidden_size"]}
        base |= {**shape, **sizes, "max_position_embeddings": 8192}
        config = config_cls(**base, attn_implementation="eager")
        model_cls = LlamaForCausalLM if config_cls is LlamaConfig else Qwen2ForCausalLM
        model = seed_weights(model_cls(config), seed).eval()
        if name.endswith("K-outliers"):
            head_dim = config.hidden_size // config.num_attention_heads
            rows = [h * head_dim + c for h in range(config.num_key_value_heads) for c in OUTLIER_CHANNELS]
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.k_proj.weight[rows] *= OUTLIER_GAIN
    use_paged_attention(model)
    return model


def max_len(model: torch.nn.Module) -> int:
    return model.config.max_position_embeddings


# --------------------------------------------------------------------------- per-tensor scaling


@contextmanager
def per_tensor_kv(dtype: str, amax: dict[tuple[int, int], float] | None) -> Iterator[dict]:
    """Within the block, every layer's new K and V are fake-quantized to `dtype` with one static
    scale per (layer, K/V): amax[(layer, 0 or 1)] / qmax. With amax None, K/V pass unchanged and
    the absmax seen per (layer, K/V) is recorded into the yielded dict (calibration)."""
    seen: dict[tuple[int, int], float] = {}
    entry = kv_dtypes.lookup(dtype)

    def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
        scaled = x.float() / scale
        if not entry.torch_dtype().is_floating_point:
            scaled = torch.floor(scaled + 0.5)
        codes = scaled.clamp(-entry.qmax, entry.qmax).to(entry.torch_dtype())
        return (codes.float() * scale).to(x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        layer = module.layer_idx
        if amax is None:
            for i, t in enumerate((key, value)):
                seen[layer, i] = max(seen.get((layer, i), 0.0), float(t.abs().max()))
        else:
            key = fake_quant(key, amax[layer, 0] / entry.qmax)
            value = fake_quant(value, amax[layer, 1] / entry.qmax)
        return paged_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    try:
        yield seen
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


# --------------------------------------------------------------------------- measurements


def runner_for(model: torch.nn.Module, dtype: str, num_tokens: int, num_seqs: int = 1) -> ModelRunner:
    """A runner over a private pool of `dtype` holding `num_seqs` sequences of `num_tokens`."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    blocks = num_seqs * -(-num_tokens // BLOCK_SIZE)
    views = private_pool(
        pool_shape(blocks, c.num_hidden_layers, BLOCK_SIZE, c.num_key_value_heads, head_dim), dtype
    )
    return ModelRunner(model, views.tensor, BLOCK_SIZE, views.scales)


def teacher_forced_logprobs(model: torch.nn.Module, dtype: str, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of `tokens`, [len(tokens), vocab], prefilled in
    chunks of CHUNK tokens through a pool of `dtype` (float32 for the per-tensor runs)."""
    runner = runner_for(model, dtype, len(tokens))
    table = list(range(runner.num_blocks))
    out = [
        runner.prefill([PrefillInput(tokens[start : start + CHUNK], start, table)], all_logits=True)
        for start in range(0, len(tokens), CHUNK)
    ]
    return torch.log_softmax(torch.cat(out), dim=-1)


def greedy(model: torch.nn.Module, dtype: str, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` (prefilled in chunks), through a pool of `dtype`."""
    runner = runner_for(model, dtype, len(prompt) + new_tokens)
    table = list(range(runner.num_blocks))
    for start in range(0, len(prompt), CHUNK):
        logits = runner.prefill([PrefillInput(prompt[start : start + CHUNK], start, table)])
    out = [int(logits.argmax(-1)[0])]
    while len(out) < new_tokens:
        logits = runner.decode([out[-1]], [len(prompt) + len(out) - 1], [table])
        out.append(int(logits.argmax(-1)[0]))
    return out


@dataclass
class Quality:
    """One (model, KV scheme, prompt length) against the model's own dtype."""

    model: str
    scheme: str  # "float32", "fp8_e4m3", ..., or "per-tensor int8"
    tokens: int
    perplexity: float
    perplexity_increase_pct: float
    mean_kl: float
    greedy_agreement: float  # share of the greedy tokens before the first difference


def measure(
    model: torch.nn.Module,
    name: str,
    length: int,
    new_tokens: int = 128,
    shipped: tuple[str, ...] = SHIPPED,
    per_tensor: tuple[str, ...] = PER_TENSOR,
) -> list[Quality]:
    """The model's dtype, then each of `shipped`, then per-tensor scaling to each of `per_tensor`,
    on the first `length` tokens of the text and `new_tokens` greedy tokens."""
    tokens = text_tokens()[:length]
    targets = torch.tensor(tokens[1:])
    prompt = tokens[: length - new_tokens] if length + new_tokens > max_len(model) else tokens

    def score(scheme: str, logprobs: torch.Tensor, continuation: list[int]) -> Quality:
        nll = -logprobs[:-1].gather(1, targets[:, None]).mean().item()
        ppl = math.exp(nll)
        kl = (ref_lp.exp() * (ref_lp - logprobs)).sum(-1).mean().item()
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(ref_greedy, continuation, strict=True)) if a != b), new_tokens
        )
        return Quality(
            name,
            scheme,
            length,
            ppl,
            100 * (ppl / ref_ppl - 1) if ref_ppl else 0.0,
            kl,
            first_diff / new_tokens,
        )

    ref_lp, ref_ppl = teacher_forced_logprobs(model, "float32", tokens), 0.0
    ref_greedy = greedy(model, "float32", prompt, new_tokens)
    results = [score("float32", ref_lp, ref_greedy)]
    ref_ppl = results[0].perplexity
    for dtype in shipped:
        results.append(
            score(
                dtype, teacher_forced_logprobs(model, dtype, tokens), greedy(model, dtype, prompt, new_tokens)
            )
        )
    if not per_tensor:
        return results
    with per_tensor_kv("int8", None) as amax:
        teacher_forced_logprobs(model, "float32", tokens)
    for dtype in per_tensor:
        with per_tensor_kv(dtype, amax):
            lp = teacher_forced_logprobs(model, "float32", tokens)
            results.append(score(f"per-tensor {dtype}", lp, greedy(model, "float32", prompt, new_tokens)))
    return results


def blocks_per_gib(model: torch.nn.Module) -> dict[str, int]:
    """Pool blocks of BLOCK_SIZE tokens one GiB holds, per dtype (scales included)."""
    shape = ModelShape.from_hf_config(model.config.to_dict())
    return {d: GIB // shape.block_bytes(BLOCK_SIZE, d) for d in ("float32", "bfloat16", *SHIPPED)}


def decode_tokens_per_s(
    model: torch.nn.Module, dtype: str, context: int = 512, seqs: int = 8, steps: int = 16
) -> float:
    """Decode throughput of the model runner over a `dtype` pool: `seqs` sequences of `context`
    tokens each, `steps` steps after one warm-up step (CPU torch path). One sample: `main` takes
    the best of several, interleaved across dtypes, as the machine's speed drifts."""
    runner = runner_for(model, dtype, context + steps + 1, seqs)
    per_seq = runner.num_blocks // seqs
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    tokens = text_tokens()[:context]
    runner.prefill([PrefillInput(tokens, 0, t) for t in tables])
    last = [tokens[-1]] * seqs
    start = None
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        last = runner.decode(last, [context + step] * seqs, tables).argmax(-1).tolist()
    return seqs * steps / (time.perf_counter() - start)


# --------------------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the seeded test model at 512 tokens only")
    ap.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 2048, 4096], help="prompt lengths (tokens)"
    )
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--json", type=Path, help="also write every figure to this file")
    ap.add_argument(
        "--speed-rounds", type=int, default=3, help="decode tok/s: best of this many rounds (0: skip)"
    )
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens compared per prompt")
    args = ap.parse_args(argv)
    models = [next(iter(MODELS))] if args.quick else args.models
    lengths = [512] if args.quick else args.lengths
    torch.manual_seed(0)
    report: dict = {"quality": [], "capacity": {}, "decode_tokens_per_s": {}}
    for name in models:
        model = build_model(name)
        fits = [n for n in lengths if n <= max_len(model)] or [max_len(model)]
        for length in fits:
            for q in measure(model, name, length, args.new_tokens):
                report["quality"].append(asdict(q))
                print(
                    f"{q.model:24} {q.tokens:5} {q.scheme:20} ppl {q.perplexity:9.3f} ({q.perplexity_increase_pct:+7.3f}%)"
                    f"  KL {q.mean_kl:.2e}  greedy agreement {q.greedy_agreement:5.1%}",
                    flush=True,
                )
        report["capacity"][name] = blocks_per_gib(model)
        print(f"{name:24} blocks/GiB {report['capacity'][name]}", flush=True)
        if args.speed_rounds < 1:
            continue
        speeds = dict.fromkeys(("float32", *SHIPPED), 0.0)
        with torch.inference_mode():
            for _ in range(args.speed_rounds):
                for d in speeds:
                    speeds[d] = max(speeds[d], decode_tokens_per_s(model, d))
        report["decode_tokens_per_s"][name] = speeds
        print(f"{name:24} decode tok/s {', '.join(f'{d} {v:.0f}' for d, v in speeds.items())}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(headline(report), flush=True)
    return 0


def headline(report: dict) -> str:
    """The last line: each shipped dtype's worst perplexity increase over the model's own dtype
    (every model and length measured) and its blocks per GiB against float32's."""
    parts = []
    for dtype in SHIPPED:
        rows = [q for q in report["quality"] if q["scheme"] == dtype]
        if not rows:
            continue
        worst = max(q["perplexity_increase_pct"] for q in rows)
        gain = [
            c[dtype] / c["float32"] for c in report["capacity"].values() if dtype in c and c.get("float32")
        ]
        parts.append(f"{dtype} ppl {worst:+.3f}% at worst, {min(gain, default=float('nan')):.2f}x blocks/GiB")
    return "headline: " + "; ".join(parts) + " (against the model's own float32 KV)"


if __name__ == "__main__":
    sys.exit(main())
