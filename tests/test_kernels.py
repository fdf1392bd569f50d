"""The paged kernels' torch path (the CPU default) against direct attention on contiguous K/V, the
dispatcher, and coexistence with transformers. The Triton kernels are checked against these
references in tests/test_kernels_triton.py, which the last test here runs under Triton's CPU
interpreter in a subprocess (TRITON_INTERPRET must be set before the kernels are compiled).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier import kernels
from kvtier.kernels.decode_attention import choose_num_splits
from kvtier.kernels.decode_plan import plan_decode
from kvtier.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads): MHA, GQA with a group of 3 (not a power of two), MQA.
HEAD_LAYOUTS = [(4, 4), (6, 2), (4, 1)]
HEAD_LAYOUT_IDS = ["mha", "gqa3", "mqa"]


# --- a paged batch in a real block-major pool ----------------------------------------------------


@dataclass
class PagedBatch:
    """Sequences stored in a block-major pool `[num_blocks, num_layers, 2, block_size, num_kv_heads,
    head_dim]`, read through the per-layer views the kernels take."""

    pool: torch.Tensor
    layer: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [num_seqs] int32

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]

    @property
    def block_size(self) -> int:
        return self.pool.shape[3]

    def contiguous_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence, [seq_len, num_kv_heads, head_dim], gathered block by block."""
        seq_len = int(self.seq_lens[seq])
        n = math.ceil(seq_len / self.block_size)
        blocks = [int(b) for b in self.block_tables[seq, :n]]
        k = torch.cat([self.k_cache[b] for b in blocks])[:seq_len] if n else self.k_cache[0, :0]
        v = torch.cat([self.v_cache[b] for b in blocks])[:seq_len] if n else self.v_cache[0, :0]
        return k, v


def make_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    shared_prefix_blocks: int = 1,
    num_layers: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """Blocks handed out in random order from a pool with spare blocks; sequences 0 and 1 share
    their first `shared_prefix_blocks` blocks (a prefix-cache hit) when both are long enough."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq + [1]) + 2
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        for j in range(n):
            tables[seq, j] = order.pop()
    if len(seq_lens) >= 2:  # only full blocks are shared, as the prefix cache does
        shared = min(shared_prefix_blocks, seq_lens[0] // block_size, seq_lens[1] // block_size)
        tables[1, :shared] = tables[0, :shared]
    pool_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=pool_gen, device=device)
    return PagedBatch(
        pool=pool.to(dtype),
        layer=num_layers - 1,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def poison_before_windows(batch, firsts: list[int]) -> None:
    """Point the table entries of each sequence's blocks wholly before position `firsts[i]` at a
    spare block filled with large values: attending it would change the output visibly."""
    used = set(batch.block_tables.flatten().tolist())
    poison = next(b for b in range(batch.pool.shape[0]) if b not in used)
    batch.pool[poison] = 50.0
    for seq, first in enumerate(firsts):
        batch.block_tables[seq, : max(0, first) // batch.block_size] = poison


def direct_decode(q: torch.Tensor, batch: PagedBatch, scale: float) -> torch.Tensor:
    """Decode attention by SDPA over each sequence's contiguous K/V, fp32. [num_seqs, heads, dim]."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for seq in range(q.shape[0]):
        k, v = batch.contiguous_kv(seq)
        if k.shape[0] == 0:
            continue
        out[seq] = F.scaled_dot_product_attention(
            q[seq, :, None].float()[None],  # [1, H, 1, D]
            k.float().transpose(0, 1)[None],  # [1, Hkv, L, D]
            v.float().transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
    return out


def direct_prefill(
    q: torch.Tensor, batch: PagedBatch, cu_query_lens: list[int], scale: float
) -> torch.Tensor:
    """Prefill attention by SDPA with an explicit causal mask over contiguous K/V, fp32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for seq in range(batch.seq_lens.shape[0]):
        start, end = cu_query_lens[seq], cu_query_lens[seq + 1]
        if end == start:
            continue
        k, v = batch.contiguous_kv(seq)
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1),  # [H, Q, D]
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Outputs are O(1); allow about two units in the last place of the output dtype."""
    return {
        torch.float32: {"atol": 2e-5, "rtol": 2e-5},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    }[dtype]


# --- torch references against direct attention -----------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_reference_matches_sdpa_on_contiguous_kv(dtype, heads, block_size, head_dim):
    num_heads, num_kv_heads = heads
    # 1 token, exactly a block, a block + 1, several blocks.
    seq_lens = [3 * block_size + 5, 2 * block_size, 1, block_size, block_size + 1]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, shared_prefix_blocks=2)
    assert not batch.k_cache.is_contiguous()  # per-layer views of the block-major pool
    assert torch.equal(batch.block_tables[0, :2], batch.block_tables[1, :2])  # a shared prefix
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5

    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale
    )

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), direct_decode(q, batch, scale), **tolerance(dtype))


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_over_shared_prefixes_reads_each_prefix_once_and_matches_sdpa(dtype, heads):
    num_heads, num_kv_heads = heads
    bs = 16
    # Sequences 0-2 share 3 blocks; 3 and 4 share 2, and 4's whole context is those 2 blocks;
    # 5 starts with 0's first block but holds only one block whole (too short to join); 6 shares
    # nothing; 7 is a padding row.
    seq_lens = [3 * bs + 9, 5 * bs, 3 * bs + 1, 2 * bs + 7, 2 * bs, bs + 3, 4 * bs + 2, 0]
    batch = make_paged_batch(seq_lens, num_kv_heads, 64, bs, dtype, shared_prefix_blocks=0)
    tables = batch.block_tables
    tables[1, :3] = tables[2, :3] = tables[0, :3]
    tables[4, :2] = tables[3, :2]
    tables[5, 0] = tables[0, 0]
    assert plan_decode(tables.tolist(), seq_lens, bs).shared is None  # spares too few reads to pay
    plan = plan_decode(tables.tolist(), seq_lens, bs, min_spared_blocks=1)
    assert plan.shared is not None and plan.shared.groups == 2
    assert sorted(plan.shared.seqs.tolist()) == [0, 1, 2, 3, 4]
    q = torch.randn(len(seq_lens), num_heads, 64).to(dtype)

    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.125, plan=plan
    )

    torch.testing.assert_close(out.float(), direct_decode(q, batch, 0.125), **tolerance(dtype))
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    # Without a plan the reference makes its own (here without groups): the same attention.
    alone = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.125)
    torch.testing.assert_close(alone.float(), out.float(), **tolerance(dtype))


def test_decode_reference_reads_long_contexts_of_unequal_lengths():
    seq_lens = [2100, 1500, 1024, 1025]
    batch = make_paged_batch(seq_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    q = torch.randn(4, 6, 64)
    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    torch.testing.assert_close(out, direct_decode(q, batch, 0.125), **tolerance(torch.float32))


def test_decode_of_one_token_returns_its_value_for_every_head_of_the_group():
    batch = make_paged_batch([1, 1], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    q = torch.randn(2, 6, 64)
    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    for seq in range(2):
        _, v = batch.contiguous_kv(seq)  # [1, 2, 64]
        torch.testing.assert_close(out[seq], v[0].repeat_interleave(3, dim=0))


def test_decode_with_huge_logits_stays_finite_and_exact():
    batch = make_paged_batch([40, 7], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    q = torch.randn(2, 4, 64) * 1e4  # logits ~1e5: exp would overflow without the running max
    out = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, direct_decode(q, batch, 1.0))


def test_decode_padding_row_with_zero_length_gives_zeros():
    batch = make_paged_batch([0, 20, 0], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    assert (batch.block_tables[0] == -1).all()  # a padding row's table is never dereferenced
    q = torch.randn(3, 2, 64)
    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    assert torch.equal(out[0], torch.zeros(2, 64)) and torch.equal(out[2], torch.zeros(2, 64))
    torch.testing.assert_close(out[1], direct_decode(q, batch, 0.125)[1])


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_reference_matches_causal_sdpa_over_prefix(dtype, heads, block_size, head_dim):
    num_heads, num_kv_heads = heads
    # (cached prefix, new tokens): no prefix; a one-token suffix after a full block; a suffix
    # that crosses blocks; a sequence with no new tokens in this step.
    shapes = [(0, block_size + 1), (block_size, 1), (2 * block_size + 3, 20), (5, 0)]
    seq_lens = [p + n for p, n in shapes]
    cu = [0]
    for _, n in shapes:
        cu.append(cu[-1] + n)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(cu[-1], num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5

    out = paged_prefill_attention_ref(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        torch.tensor(cu, dtype=torch.int32),
        batch.seq_lens,
        scale,
    )

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), direct_prefill(q, batch, cu, scale), **tolerance(dtype))


def test_cpu_attention_runs_sdpa_flash_kernel_not_its_math_path():
    """Both torch attention paths (every CPU prefill and decode) must reach SDPA's flash CPU
    kernel: given 3-d inputs SDPA silently takes its math path, which materialises the scores
    (a third of a long prefill's time before this was pinned; bench/README.md)."""
    from torch.profiler import ProfilerActivity, profile

    seq_lens = [40, 70]
    batch = make_paged_batch(seq_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    cu = torch.tensor([0, 40, 60], dtype=torch.int32)  # a whole prompt, and 20 tokens after 50 cached
    tables, lens = batch.block_tables, batch.seq_lens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged_prefill_attention_ref(
            torch.randn(60, 8, 64), batch.k_cache, batch.v_cache, tables, cu, lens, 0.125
        )
        paged_decode_attention_ref(torch.randn(2, 8, 64), batch.k_cache, batch.v_cache, tables, lens, 0.125)
    ops = {event.key for event in prof.key_averages()}
    calls = {event.key: event.count for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu"] == 3  # two prefill rows, one decode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_reference_fills_slots_and_skips_negative_ones(dtype):
    batch = make_paged_batch([20, 9], num_kv_heads=2, head_dim=80, block_size=16, dtype=dtype)
    before = batch.pool.clone()
    k, v = torch.randn(4, 2, 80).to(dtype), torch.randn(4, 2, 80).to(dtype)
    block = int(batch.block_tables[1, 0])
    slots = torch.tensor([block * 16 + 9, -1, block * 16 + 3, int(batch.block_tables[0, 1]) * 16 + 15])

    write_kv_ref(k, v, batch.k_cache, batch.v_cache, slots)

    assert torch.equal(batch.k_cache[block, 9], k[0]) and torch.equal(batch.v_cache[block, 3], v[2])
    assert torch.equal(batch.v_cache[int(batch.block_tables[0, 1]), 15], v[3])
    changed = (batch.pool != before).flatten(4).any(-1)  # [blocks, layers, K/V, offset]
    assert int(changed.sum()) == 6  # 3 slots x K and V, only in this layer: padding wrote nothing
    assert not changed[:, 0].any()


# --- dispatcher ------------------------------------------------------------------------------------


def test_cpu_tensors_go_to_torch_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.backend("cpu") == "torch"
    batch = make_paged_batch([17, 3], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    q = torch.randn(2, 4, 64)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert torch.equal(kernels.paged_decode_attention(*args), paged_decode_attention_ref(*args))


def test_backend_names_the_interpreter_when_it_is_requested(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.backend("cpu") == "triton-interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.backend("cpu") == "torch"


def test_dispatcher_rejects_inputs_it_cannot_serve():
    batch = make_paged_batch([5], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    kc, vc, bt, sl = batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens
    with pytest.raises(ValueError, match="block_tables must be a 2-d tensor of torch.int32"):
        kernels.paged_decode_attention(q, kc, vc, bt.long(), sl, 0.1)
    with pytest.raises(ValueError, match="q dtype torch.float32 differs"):
        kernels.paged_decode_attention(q.float(), kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        kernels.paged_decode_attention(q[:, :3], kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        kernels.write_kv(
            q[:1, :2].expand(2, 2, 64), q[:1, :2].expand(2, 2, 64), kc, vc, torch.zeros(1, dtype=torch.int32)
        )


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_seq_len", "num_sms", "expected"),
    [
        (64, 8, 4096, 132, 1),  # 512 programs already fill two waves
        (1, 8, 32768, 132, 33),  # ceil(264 / 8) splits of ~1k tokens
        (1, 8, 300, 132, 1),  # too short for two splits of MIN_SPLIT_TOKENS
        (2, 1, 1 << 20, 132, 64),  # capped at MAX_SPLITS
        (4, 2, 2048, 132, 8),  # bounded by length: 2048 // 256
    ],
)
def test_split_heuristic_splits_only_small_batches_with_long_contexts(
    num_seqs, num_kv_heads, max_seq_len, num_sms, expected
):
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) == expected


# --- Triton kernels compiled for a GPU, without one ---------------------------------------------


def compile_for_hopper(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int):
    """Compile a @triton.jit kernel for sm_90 with the ptxas bundled in the triton wheel; no
    device needed. Pointers are marked 16-byte aligned and strides (not the block table's)
    multiples of 16, as Triton's launcher specializes them for pool views of real models."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    aligned = [
        i for i, n in enumerate(fn.arg_names) if signature[n].startswith("*") or n.startswith("stride_k")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def spilled_bytes(compiled) -> int | None:
    """Bytes of register spill (stack) of a compiled kernel per cuobjdump, None if it is absent."""
    import shutil
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"STACK:(\d+)", usage)
    return int(match.group(1)) if match else None


def test_triton_kernels_compile_for_hopper_without_spills(monkeypatch):
    """The interpreter accepts what a GPU compile rejects (tl.dot operand sizes, dtypes) and says
    nothing of registers: compile the shipped launch configs for sm_90 on this CPU machine."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns while it is unset
    pytest.importorskip(
        "triton.backends.nvidia", reason="this triton build has no NVIDIA backend to compile for"
    )
    from kvtier.kernels import decode_attention, kv_write, prefill_attention

    def attention_types(dtype: str, names: list[str]) -> dict[str, str]:
        types = {n: f"*{dtype}" for n in names if n.endswith("_ptr")}
        types |= {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_query_lens_ptr": "*i32"}
        return types | {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}

    cases = []
    for dtype, torch_dtype, head_dim, partial in [
        ("fp16", torch.float16, 128, True),
        ("fp32", torch.float32, 80, False),
    ]:
        tile_n, warps, stages = decode_attention.launch_config(128, torch_dtype, interpret=False)
        constexprs = {"GROUP_PAD": 16, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16}
        constexprs |= {"TILE_N": tile_n, "WRITE_PARTIAL": partial, "DOT_IN_FP32": False, "QUANTIZED": False}
        fn = decode_attention._decode_kernel
        cases.append(
            (
                f"decode-{dtype}-d{head_dim}",
                fn,
                attention_types(dtype, fn.arg_names),
                constexprs,
                warps,
                stages,
            )
        )
    fn = prefill_attention._prefill_kernel
    constexprs = {
        "HEAD_DIM": 128,
        "HEAD_DIM_PAD": 128,
        "BLOCK_SIZE": 32,
        "BLOCK_M": 64,
        "TILE_N": 64,
        "DOT_IN_FP32": False,
        "QUANTIZED": False,
    }
    cases.append(("prefill-bf16", fn, attention_types("bf16", fn.arg_names), constexprs, 8, 3))
    # Quantized caches: one-byte K/V codes, float32 scales, bf16 / fp16 queries and outputs.
    quantized = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    cases.append(
        (
            "prefill-fp8",
            fn,
            attention_types("bf16", fn.arg_names) | quantized,
            constexprs | {"QUANTIZED": True},
            8,
            3,
        )
    )
    fn = decode_attention._decode_kernel
    tile_n, warps, stages = decode_attention.launch_config(128, torch.float16, interpret=False)
    constexprs = {"GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "TILE_N": tile_n}
    constexprs |= {"WRITE_PARTIAL": True, "DOT_IN_FP32": False, "QUANTIZED": True}
    types = attention_types("fp16", fn.arg_names) | quantized | {"k_ptr": "*i8", "v_ptr": "*i8"}
    cases.append(("decode-int8", fn, types, constexprs, warps, stages))
    fn = decode_attention._reduce_splits_kernel
    constexprs = {"HEAD_DIM": 80, "HEAD_DIM_PAD": 128, "SPLITS_PAD": 8}
    cases.append(
        (
            "reduce",
            fn,
            {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"},
            constexprs,
            4,
            1,
        )
    )
    fn = kv_write._write_kv_kernel
    constexprs = {"NUM_KV_HEADS": 6, "HEADS_PAD": 8, "HEAD_DIM": 80, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16}
    constexprs |= {"QUANTIZED": False, "QMAX": 1.0, "INTEGER": False}
    types = {n: "*fp16" for n in fn.arg_names if n.endswith("_ptr")} | {"slot_mapping_ptr": "*i64"}
    cases.append(("write_kv", fn, types, constexprs, 4, 1))
    for code, qmax, integer in (("fp8e4nv", 448.0, False), ("fp8e5", 57344.0, False), ("i8", 127.0, True)):
        quantized = {
            "k_cache_ptr": f"*{code}",
            "v_cache_ptr": f"*{code}",
            "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32",
        }
        quantizing = constexprs | {"QUANTIZED": True, "QMAX": qmax, "INTEGER": integer}
        cases.append((f"write_kv-{code}", fn, types | quantized, quantizing, 4, 1))

    for name, fn, types, constexprs, warps, stages in cases:
        compiled = compile_for_hopper(fn, types, constexprs, warps, stages)
        assert compiled.asm["cubin"], name
        spilled = spilled_bytes(compiled)
        print(f"{name}: compiled for sm_90, {spilled} bytes spilled")
        # A spilled tile costs kilobytes (fp32 at 64-token tiles spilled 424-7384 bytes).
        assert spilled is None or spilled < 256, f"{name} spills {spilled} bytes of registers"


# --- Triton kernels under the interpreter ----------------------------------------------------------


def test_triton_kernels_match_references_under_the_interpreter():
    """Runs tests/test_kernels_triton.py in a fresh interpreter with TRITON_INTERPRET=1: the
    variable is read when `@triton.jit` decorates, so it cannot be switched on in this process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    test_file = Path(__file__).with_name("test_kernels_triton.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-x"],
        env=env,
        cwd=test_file.parent.parent,
        capture_output=True,
        text=True,
        timeout=280,
    )
    tail = "\n".join(result.stdout.splitlines()[-15:])
    print(tail)
    assert result.returncode == 0, (
        f"interpreter run failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    )
    summary = re.search(r"(\d+) passed", result.stdout)
    assert summary and int(summary.group(1)) >= 20, tail
    assert not re.search(r"\d+ (failed|error)", result.stdout), tail
