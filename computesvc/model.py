"""The model side of compute: load a Llama-family model and run it over the paged KV pool.

The Hugging Face model runs unchanged except for its attention, which goes through
transformers' `AttentionInterface` to kvtier's paged kernels (computesvc.paged_attention): each
layer writes its new K/V straight into pool blocks and attends over the blocks of each
sequence. No transformers cache object ever holds KV.

Every forward is batch 1: the tokens of all sequences are packed into one row `[1, T]` with
explicit `position_ids`, so RoPE sees each token's true position. The paged metadata of the
forward (`PagedBatch`) travels as a model kwarg, which transformers hands to every attention
call, so concurrent runners never share hidden state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvtier import kv_dtypes
from kvtier.computesvc.cpu_forward import OwnForward, fuse_linears, is_fused
from kvtier.computesvc.cpu_linear import pack_linears
from kvtier.computesvc.paged_attention import ATTN_IMPLEMENTATION, PagedBatch, use_paged_attention
from kvtier.generation_config import GENERATION_CONFIG, describe, read_generation_defaults
from kvtier.kernels import DecodePlans, backend
from kvtier.memory_plan import check_replica_fits, model_needs
from kvtier.model_spec import TINY_LLAMA_CONFIG, ModelShape
from kvtier.tokenizer import load_tokenizer

log = logging.getLogger("kvtier.compute")

# NOTE: every forward of the process runs on this one thread. torch's OpenMP thread team belongs
# to the thread that calls into it: forwards handed to a pool of threads (run_in_executor(None))
# start a team on each, --threads workers apiece, which oversubscribe the cores the team was
# sized for (measured: 4 busy threads on 2 cores, decode 4x slower under Intel OpenMP).
FORWARD_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-forward")

# --- the built-in tiny model -------------------------------------------------------------------


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The built-in seeded-random Llama (`TINY_LLAMA_CONFIG`), on CPU, eval mode, eager attention.

    Weights are drawn from a generator seeded with `seed`, parameter by parameter in name order,
    so the same seed gives the same weights in any process. Their scale (std 1/sqrt(fan_in),
    unit embeddings) spreads the logits enough that greedy decoding has clear winners.
    """
    config = LlamaConfig(**TINY_LLAMA_CONFIG, attn_implementation="eager")
    model = seed_weights(LlamaForCausalLM(config), seed)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.eos_token_id
    return model.to(dtype).eval()


def seed_weights(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Draw every parameter of `model` from a generator seeded with `seed`, in name order: norms
    1 + N(0, 0.1), embeddings N(0, 1), the rest N(0, 1 / fan_in) (biases included). Returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith("embed_tokens.weight"):
                values = torch.randn(param.shape, generator=generator)
            else:
                values = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
            param.copy_(values)
    return model


# --- loading -----------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A model ready for `ModelRunner` (paged attention, eval, no grad) with its tokenizer.

    `shape.dtype` is the checkpoint's dtype; the dtype the weights run in (and the pool must
    have) is `model.dtype`. `eos_token_ids` merges the generation config's and the tokenizer's.
    `sampling_defaults` are the SamplingParams fields its generation_config.json sets (the
    defaults of requests that leave them unset; kvtier.generation_config).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    shape: ModelShape
    eos_token_ids: list[int]
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def load_model(
    model_dir: str | Path | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    activation_reserve_bytes: int | None = None,
) -> LoadedModel:
    """Load a local Llama/Qwen2/Mistral directory offline, or the tiny model when `model_dir` is None.

    dtype: "auto" (the checkpoint's dtype; float32 for the tiny model), "float32", "float16" or
    "bfloat16". seed: weights of the tiny model (ignored for a directory). Raises
    FileNotFoundError / ValueError naming the directory when it holds no supported model. On cuda,
    free device memory is checked first (`check_device_memory`): MemoryPlanError (a ValueError)
    with the numbers when the weights and the activation reserve do not fit.
    """
    if dtype != "auto" and dtype not in kv_dtypes.MODEL_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(kv_dtypes.MODEL_DTYPES)}, got {dtype!r}")
    if torch.device(device).type == "cuda":
        run_dtype = dtype
        if dtype == "auto":
            run_dtype = ModelShape.from_model_dir(model_dir).dtype if model_dir else "float32"
        check_device_memory(model_dir, run_dtype, device, activation_reserve_bytes)
    if model_dir is None:
        model = build_tiny_model(seed, kv_dtypes.torch_dtype("float32" if dtype == "auto" else dtype))
        shape = ModelShape.tiny(seed)
    else:
        # Reads config.json first: an unsupported model fails here, before any weight is read.
        shape = ModelShape.from_model_dir(model_dir)
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        torch_dtype = kv_dtypes.torch_dtype(shape.dtype if dtype == "auto" else dtype)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=torch_dtype, local_files_only=True
        )
    tokenizer: PreTrainedTokenizerBase = load_tokenizer(model_dir)
    model = model.to(device).eval().requires_grad_(False)
    use_paged_attention(model)
    defaults = read_generation_defaults(model_dir)
    if defaults:
        log.info("sampling defaults from %s/%s: %s", model_dir, GENERATION_CONFIG, describe(defaults))
    return LoadedModel(model, tokenizer, shape, _eos_token_ids(model, tokenizer), defaults)


def check_device_memory(
    model_dir: str | Path | None, dtype: str, device: str, activation_reserve_bytes: int | None = None
) -> None:
    """Before any weight is read: refuse (MemoryPlanError, with the numbers) unless the device's
    free memory holds the model's weights at `dtype` (from the checkpoint's safetensors headers)
    plus its activation reserve (estimated from the shape unless given; kvtier/memory_plan.py)."""
    weights, reserve = model_needs(model_dir, dtype, activation_reserve_bytes)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    figures = check_replica_fits(
        device=f"cuda:{index} ({torch.cuda.get_device_name(index)})",
        total_bytes=total,
        free_bytes=free,
        weights=weights,
        reserve=reserve,
    )
    log.info("device memory before loading: %s", figures)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # Chat models often end turns with a token the tokenizer does not call eos (Llama 3's
    # <|eot_id|>): the generation config lists those, as vLLM reads them.
    ids: list[int] = []
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


# --- the runner --------------------------------------------------------------------------------


def check_pool_readable(pool: torch.Tensor, kv_scales: torch.Tensor | None, model: PreTrainedModel) -> None:
    """Raise ValueError, naming the pool's dtype and the model's, unless this model's attention
    can read `pool`: a model dtype pool must be the model's own dtype on its device; a quantized
    one needs its scales and kernels that decode it on this device (kv_dtypes.unsupported_reason)."""
    entry = kv_dtypes.of_torch(pool.dtype)
    model_dtype = kv_dtypes.of_torch(model.dtype).name
    if pool.device != model.device:
        raise ValueError(f"pool is on {pool.device}, the model runs on {model.device}")
    if not entry.needs_scales:
        if pool.dtype != model.dtype:
            raise ValueError(
                f"pool dtype {entry.name} cannot be read by a model running {model_dtype}: a "
                f"{entry.name} pool is read as it is; run the model in {entry.name}"
            )
        return
    if kv_scales is None or kv_scales.shape != pool.shape[:5] or kv_scales.dtype != torch.float32:
        raise ValueError(f"a {entry.name} pool needs its float32 scales {list(pool.shape[:5])}")
    reason = kv_dtypes.unsupported_reason(entry.name, pool.device)
    if reason:
        raise ValueError(
            f"pool dtype {entry.name} cannot be read by this replica (model {model_dtype}): {reason}"
        )


@dataclass
class PrefillInput:
    """One sequence's share of a prefill forward.

    token_ids: the tokens to compute now (the uncached suffix, or one chunk of it).
    start_pos: position of token_ids[0] = tokens of this sequence already in the pool.
    block_table: pool block ids covering at least start_pos + len(token_ids) tokens.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


class ModelRunner:
    """Runs prefill and decode forwards of one model over a block-major KV pool.

    pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], on the model's
    device and in its dtype, or in a quantized dtype (kvtier.kv_dtypes) with `kv_scales`
    [num_blocks, num_layers, 2, block_size, num_kv_heads] float32 (kvtier.pool: the scales live
    in each block). Layer l reads and writes the views pool[:, l, 0] and pool[:, l, 1] (no
    copies), so what the runner writes is what the cache service sees. A float32 model on CPU
    has its linears swapped for prepacked oneDNN ones when the first runner is made
    (computesvc.cpu_linear; its state dict then no longer holds their weights). On CPU the
    runner runs its own forward (computesvc.cpu_forward), which fuses the model's q/k/v and
    gate/up linears: the model then runs only under ModelRunner. `own_forward=False` keeps
    transformers' forward with the paged attention hook, the path CUDA takes, on a model no
    runner fused.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pool: torch.Tensor,
        block_size: int,
        kv_scales: torch.Tensor | None = None,
        *,
        own_forward: bool = True,
    ):
        config = model.config
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"model attention is {config._attn_implementation!r}, not {ATTN_IMPLEMENTATION!r}: "
                "load it with load_model() or call use_paged_attention(model)"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        expected = (
            config.num_hidden_layers,
            2,
            block_size,
            config.num_key_value_heads or num_heads,
            head_dim,
        )
        if pool.dim() != 6 or tuple(pool.shape[1:]) != expected:
            raise ValueError(
                f"pool shape {tuple(pool.shape)} does not match the model: expected "
                f"[num_blocks, {', '.join(map(str, expected))}] (layers, K/V, block_size, kv heads, head_dim)"
            )
        check_pool_readable(pool, kv_scales, model)
        # On CPU the runner's own layer loop (q/k/v and gate/up fused in place, once per model),
        # then, in float32, every linear on a oneDNN-prepacked weight (in place, once per model).
        if not own_forward and is_fused(model):
            raise ValueError("this model's linears were fused for the runner's own forward: it runs no other")
        fused = own_forward and fuse_linears(model)
        pack_linears(model)
        self.own_forward = OwnForward(model) if fused else None
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.shape[0]
        self.vocab_size = config.vocab_size
        self.device = pool.device
        self.k_caches = [pool[:, layer, 0] for layer in range(config.num_hidden_layers)]
        self.v_caches = [pool[:, layer, 1] for layer in range(config.num_hidden_layers)]
        layers = range(config.num_hidden_layers)
        self.k_scales = None if kv_scales is None else [kv_scales[:, layer, 0] for layer in layers]
        self.v_scales = None if kv_scales is None else [kv_scales[:, layer, 1] for layer in layers]
        # Returns the monotonic time until which the blocks are surely ours (the replica's lease).
        self.write_deadline: Callable[[], float] = lambda: float("inf")
        self.executor = FORWARD_EXECUTOR  # where callers off the event loop run prefill and decode

    def prefill(self, seqs: list[PrefillInput], all_logits: bool = False) -> torch.Tensor:
        """One packed forward over the new tokens of all `seqs`; writes their K/V into the pool.

        A sequence may start mid-way (start_pos > 0: a prefix hit or a later chunk); its
        attention covers the cached prefix plus its new tokens, causally. Returns fp32 logits
        of each sequence's last new token, [num_seqs, vocab_size], or with `all_logits` of every
        new token, [num_new_tokens, vocab_size] (perplexity).
        """
        if not seqs:
            raise ValueError("prefill needs at least one sequence")
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_query_lens = [0]
        seq_lens: list[int] = []
        for i, seq in enumerate(seqs):
            if not seq.token_ids:
                raise ValueError(f"prefill sequence {i} has no tokens")
            if seq.start_pos < 0:
                raise ValueError(f"prefill sequence {i} has start_pos {seq.start_pos} < 0")
            end = seq.start_pos + len(seq.token_ids)
            self._check_block_table(i, seq.block_table, end)
            token_ids += seq.token_ids
            positions += range(seq.start_pos, end)
            slots += self._slots(seq.block_table, seq.start_pos, end)
            cu_query_lens.append(len(token_ids))
            seq_lens.append(end)
        tables = [seq.block_table for seq in seqs]
        max_query_len = max(len(seq.token_ids) for seq in seqs)
        batch = self._batch(slots, tables, seq_lens, cu_query_lens, max_query_len)
        last = torch.tensor(cu_query_lens[1:], device=self.device) - 1
        return self._forward(token_ids, positions, batch, logits_to_keep=0 if all_logits else last)

    def decode(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """One new token per sequence at `positions[i]` (0-based); writes its K/V into the pool.

        Sequence i attends over its positions 0..positions[i], all of which must be in the pool
        after this write. Returns fp32 logits [num_seqs, vocab_size].
        """
        if not token_ids or not len(token_ids) == len(positions) == len(block_tables):
            raise ValueError(
                f"decode needs equal, non-zero numbers of token_ids ({len(token_ids)}), "
                f"positions ({len(positions)}) and block_tables ({len(block_tables)})"
            )
        for i, (pos, table) in enumerate(zip(positions, block_tables, strict=True)):
            if pos < 0:
                raise ValueError(f"decode sequence {i} has position {pos} < 0")
            self._check_block_table(i, table, pos + 1)
        slots = [
            self._slots(table, pos, pos + 1)[0] for pos, table in zip(positions, block_tables, strict=True)
        ]
        lens = [p + 1 for p in positions]
        batch = self._batch(slots, block_tables, lens, None, max_query_len=1)
        if backend(self.device) == "torch":  # what every layer reads, worked out once for the step
            batch.decode_plans = DecodePlans(
                block_tables, lens, self.block_size, self.device, self.num_blocks
            )
        return self._forward(token_ids, positions, batch, logits_to_keep=0)

    def _check_block_table(self, i: int, table: list[int], num_tokens: int) -> None:
        needed = -(-num_tokens // self.block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {i}: block_table has {len(table)} blocks, {num_tokens} tokens need {needed} "
                f"(block_size {self.block_size})"
            )
        bad = [b for b in table[:needed] if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"sequence {i}: block ids {bad} outside the pool [0, {self.num_blocks})")

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Pool slots of positions start..end-1 of a sequence with this block table."""
        bs = self.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def _batch(
        self,
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
        cu_query_lens: list[int] | None,
        max_query_len: int,
    ) -> PagedBatch:
        # Entries past a sequence's last block are never read: pad with block 0.
        width = max(-(-n // self.block_size) for n in seq_lens)
        padded = [table[:width] + [0] * (width - min(len(table), width)) for table in tables]

        def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        return PagedBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=int32(padded),
            seq_lens=int32(seq_lens),
            cu_query_lens=None if cu_query_lens is None else int32(cu_query_lens),
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            k_scales=self.k_scales,
            v_scales=self.v_scales,
            max_seq_len=max(seq_lens),
            max_query_len=max_query_len,
            write_deadline=self.write_deadline,
        )

    def _forward(
        self,
        token_ids: list[int],
        positions: list[int],
        batch: PagedBatch,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            if self.own_forward is not None:
                return self.own_forward(input_ids, position_ids, batch, logits_to_keep).float()
            input_ids, position_ids = input_ids[None], position_ids[None]
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=logits_to_keep,
                kvtier_batch=batch,
            )
        return out.logits[0].float()
