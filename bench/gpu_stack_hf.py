"""The in-process side of bench/gpu_stack.py: Hugging Face `generate` (one prompt at a time for
parity, static batches and `generate_batch` for throughput) and the model runner's own Triton path
in float32. torch and transformers are imported inside each function, so `--help` stays light."""

from __future__ import annotations

import time
from pathlib import Path


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_model(model_dir: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    model.set_attn_implementation("sdpa")
    return model.to(device).eval().requires_grad_(False)


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`generate` one prompt at a time (no padding), exactly max_tokens tokens (EOS id -1: never)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_tokens)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            out.append(seq[0, len(p) :].tolist())
    return out


def hf_serve_static(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """`generate` on the whole batch at once (all prompts have one length: no padding)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_tokens)
    ids = torch.tensor(prompts, device=model.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), generation_config=gen)  # warm
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        sync()
        wall = time.perf_counter() - t
    n = int((out.shape[1] - ids.shape[1]) * out.shape[0])
    return {"wall_s": wall, "output_tokens": n, "output_tokens_per_s": n / wall, "batch": len(prompts)}


def hf_serve_continuous(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """transformers' continuous batching (`generate_batch`, its paged cache) on the same requests."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_tokens)
    model.generate_batch(prompts[:2], generation_config=gen)  # warm
    t = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=gen)
    wall = time.perf_counter() - t
    n = sum(len(o.generated_tokens) for o in outs.values())
    return {"wall_s": wall, "output_tokens": n, "output_tokens_per_s": n / wall}


def runner_greedy_fp32(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, device: str = "cuda"
) -> list[list[int]]:
    """The model runner's Triton path (in process) in float32: prefill, then one decode a token."""
    import torch

    from kvtier.computesvc.model import ModelRunner, PrefillInput, load_model

    loaded = load_model(model_dir, dtype="float32", device=device)  # on cuda: checks free memory first
    cfg = loaded.model.config
    bs = 16
    per_seq = -(-(max(len(p) for p in prompts) + max_tokens) // bs)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pool = torch.zeros(
        (per_seq * len(prompts) + 1, cfg.num_hidden_layers, 2, bs, cfg.num_key_value_heads, head_dim),
        dtype=torch.float32,
        device=device,
    )
    runner = ModelRunner(loaded.model, pool, bs)
    outs = []
    for i, p in enumerate(prompts):
        # Blocks in reverse order: the kernels must follow the table, not assume contiguity.
        table = list(range((i + 1) * per_seq, i * per_seq, -1))
        tok = int(runner.prefill([PrefillInput(p, 0, table)])[0].argmax())
        out = [tok]
        for pos in range(len(p), len(p) + max_tokens - 1):
            tok = int(runner.decode([tok], [pos], [table])[0].argmax())
            out.append(tok)
        outs.append(out)
    del runner, pool, loaded
    empty_cache()
    return outs
