"""The Triton kernels against their torch references.

Runs on a CUDA device at realistic shapes, or on CPU under Triton's interpreter at tiny shapes
(`TRITON_INTERPRET=1`, which tests/test_kernels.py sets in a subprocess: the interpreter costs
milliseconds per op per loop step, so the CPU grid covers each dtype, head layout, block size and
head dim without taking their full product). Elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "Triton kernels need a CUDA device or TRITON_INTERPRET=1 (tests/test_kernels.py runs this "
        "file under the interpreter in a subprocess)",
        allow_module_level=True,
    )

from test_kernels import (  # noqa: E402
    DTYPES,
    HEAD_LAYOUT_IDS,
    HEAD_LAYOUTS,
    make_paged_batch,
    poison_before_windows,
)

from kvtier import kernels  # noqa: E402
from kvtier.kernels.reference import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)

DEVICE = "cpu" if INTERPRET else "cuda"
BLOCK_SIZES = [16, 32]
HEAD_DIMS = [64, 80, 128]
# On CUDA, model-sized head layouts: MHA, a group of 7 (Qwen2-7B's 28/4), MQA with 32 heads.
HEADS, HEAD_IDS = (
    (HEAD_LAYOUTS, HEAD_LAYOUT_IDS) if INTERPRET else ([(16, 16), (28, 4), (32, 1)], ["mha", "gqa7", "mqa"])
)


def covering_grid() -> list[tuple[torch.dtype, tuple[int, int], int, int]]:
    """(dtype, heads, block_size, head_dim) cases that cover every value of each axis in every
    dtype without the full product (each distinct shape is a Triton compile on CUDA, and costs
    milliseconds per op per loop step in the interpreter). CUDA: dtype x heads x head dim, block
    size alternating (27 cases). Interpreter: dtype x heads, block size and head dim rotating (9)."""
    cases = []
    if not INTERPRET:
        for i, (dtype, heads, head_dim) in enumerate(itertools.product(DTYPES, HEADS, HEAD_DIMS)):
            cases.append((dtype, heads, BLOCK_SIZES[i % 2], head_dim))
        return cases
    for i, (dtype, heads) in enumerate(itertools.product(DTYPES, HEADS)):
        cases.append((dtype, heads, BLOCK_SIZES[i % 2], HEAD_DIMS[(i + i // 3) % 3]))
    return cases


def case_id(case) -> str:
    dtype, heads, block_size, head_dim = case
    return f"{str(dtype).removeprefix('torch.')}-{HEAD_IDS[HEADS.index(heads)]}-bs{block_size}-d{head_dim}"


CASES = covering_grid()


def triton_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32 is exact to rounding; fp16/bf16 kernels round softmax weights to the input dtype
    before the P @ V product (as flash attention does), and the interpreter truncates
    fp32->bf16 instead of rounding: a few units in the last place."""
    return {
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    }[dtype]


def decode_lengths(block_size: int) -> list[int]:
    """Ragged: 1 token, exactly a block, a block + 1, and a context long enough to split."""
    if INTERPRET:
        return [3 * block_size + 7, 1, block_size, block_size + 1]
    return [5000, 1, block_size, block_size + 1, 777, 2 * block_size, 4096, 33]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_decode_matches_reference_with_and_without_splits(case):
    dtype, (num_heads, num_kv_heads), block_size, head_dim = case
    lens = decode_lengths(block_size)
    batch = make_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype, DEVICE, shared_prefix_blocks=2)
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    expected = paged_decode_attention_ref(*args).float()

    for num_splits in (None, 3):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(
            out.float(), expected, **triton_tolerance(dtype), msg=lambda m, n=num_splits: f"splits={n}: {m}"
        )


@pytest.mark.skipif(
    INTERPRET, reason="the heuristic splits only contexts of 512+ tokens: too slow to interpret"
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_decode_splits_long_contexts_on_its_own(dtype):
    from kvtier.kernels.decode_attention import _num_sms, choose_num_splits

    lens = [16384, 9000, 1]
    batch = make_paged_batch(lens, 8, 128, 16, dtype, DEVICE)
    assert choose_num_splits(len(lens), 8, max(lens), _num_sms(torch.device(DEVICE))) > 1
    q = torch.randn(len(lens), 32, 128, device=DEVICE).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5)
    torch.testing.assert_close(
        kernels.paged_decode_attention(*args).float(),
        paged_decode_attention_ref(*args).float(),
        **triton_tolerance(dtype),
    )


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_decode_edge_cases_one_token_huge_logits_and_padding_rows(num_splits):
    lens = [1, 40, 0, 23]
    batch = make_paged_batch(lens, 2, 64, 16, torch.float32, DEVICE)
    q = torch.randn(len(lens), 4, 64, device=DEVICE) * 1e4  # logits ~1e5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0)

    out = kernels.paged_decode_attention(*args, num_splits=num_splits)

    assert torch.isfinite(out).all()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # seq_len 0: zeros, not NaN
    _, v = batch.contiguous_kv(0)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, dim=0))  # one token: its value
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)


def prefill_shapes(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) per sequence."""
    if INTERPRET:
        return [(0, block_size + 1), (block_size, 1), (2 * block_size + 3, 20), (5, 0)]
    return [(0, 300), (block_size, 1), (1000, 129), (5, 0), (4096, 64), (0, 1)]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_prefill_matches_reference_over_cached_prefix(case):
    dtype, (num_heads, num_kv_heads), block_size, head_dim = case
    shapes = prefill_shapes(block_size)
    batch = make_paged_batch([p + n for p, n in shapes], num_kv_heads, head_dim, block_size, dtype, DEVICE)
    cu = torch.tensor(
        [0] + list(itertools.accumulate(n for _, n in shapes)), dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=DEVICE).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, head_dim**-0.5)

    out = kernels.paged_prefill_attention(*args)

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(
        out.float(), paged_prefill_attention_ref(*args).float(), **triton_tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_triton_write_kv_matches_reference_and_skips_padding(dtype, head_dim):
    batch = make_paged_batch([40, 9], 3, head_dim, 16, dtype, DEVICE)
    expected = batch.pool.clone()
    k = torch.randn(6, 3, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(6, 3, head_dim, device=DEVICE).to(dtype)
    slots = torch.tensor([0, -1, 17, 33, -5, 47], dtype=torch.int32, device=DEVICE)
    slots = torch.where(slots >= 0, batch.block_tables[0, slots.clamp(min=0) // 16] * 16 + slots % 16, slots)

    kernels.write_kv(k, v, batch.k_cache, batch.v_cache, slots)
    write_kv_ref(k, v, expected[:, batch.layer, 0], expected[:, batch.layer, 1], slots)

    assert torch.equal(batch.pool, expected)


def test_dispatcher_routes_to_triton_and_keeps_its_names():
    assert kernels.backend(DEVICE) == ("triton-interpreter" if INTERPRET else "triton")
    batch = make_paged_batch([3], 1, 64, 16, torch.float32, DEVICE)
    k = torch.ones(1, 1, 64, device=DEVICE)
    slot = batch.block_tables[0, :1] * 16 + 2
    kernels.write_kv(k, k, batch.k_cache, batch.v_cache, slot)
    assert torch.equal(batch.k_cache[int(slot) // 16, 2], k[0])
    # The kernel submodules are imported by now; they must not shadow the exported functions.
    assert "kvtier.kernels.kv_write" in sys.modules and "kvtier.kernels.decode_attention" in sys.modules
    assert kernels.write_kv.__module__ == "kvtier.kernels"
    assert kernels.paged_decode_attention.__module__ == "kvtier.kernels"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_kernels_with_a_sliding_window_match_the_references(dtype):
    # Table entries wholly before each window point at a poisoned block: neither path reads them.
    window, (num_heads, num_kv_heads), head_dim = 20, (6, 2), 64
    lens = decode_lengths(16)
    batch = make_paged_batch(lens, num_kv_heads, head_dim, 16, dtype, DEVICE)
    poison_before_windows(batch, [n - window for n in lens])
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5)
    expected = paged_decode_attention_ref(*args, window=window).float()
    for num_splits in (None, 3):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits, window=window)
        torch.testing.assert_close(out.float(), expected, **triton_tolerance(dtype))

    shapes = prefill_shapes(16)
    batch = make_paged_batch([p + n for p, n in shapes], num_kv_heads, head_dim, 16, dtype, DEVICE)
    poison_before_windows(batch, [p - window + 1 for p, _ in shapes])
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in shapes)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=DEVICE).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, head_dim**-0.5)
    out = kernels.paged_prefill_attention(*args, window=window)
    expected = paged_prefill_attention_ref(*args, window=window).float()
    torch.testing.assert_close(out.float(), expected, **triton_tolerance(dtype))


# --- quantized KV (fp8_e4m3, fp8_e5m2, int8 with per-token-head scales) --------------------------

QUANT_CASES = [
    (torch.float8_e4m3fn, torch.bfloat16, (6, 2), 80),
    (torch.float8_e5m2, torch.float16, (4, 1), 64),
    (torch.int8, torch.float32 if INTERPRET else torch.float16, (4, 4), 64),
]


def quant_id(case) -> str:
    dtype, query_dtype, heads, head_dim = case
    return (
        f"{str(dtype).removeprefix('torch.')}-q{str(query_dtype).removeprefix('torch.')}-{heads}-d{head_dim}"
    )


@pytest.mark.parametrize("case", QUANT_CASES, ids=quant_id)
def test_triton_kernels_on_a_quantized_cache_match_the_torch_path(case):
    from test_kv_quant import quantize_batch

    dtype, query_dtype, (num_heads, num_kv_heads), head_dim = case
    block_size = 16
    shapes = prefill_shapes(block_size)
    lens = [p + n for p, n in shapes]
    batch = make_paged_batch(lens, num_kv_heads, head_dim, block_size, torch.float32, DEVICE)
    quant = quantize_batch(batch, dtype)
    caches = quant.caches()
    scales = {"k_scale": caches["k_scale"], "v_scale": caches["v_scale"]}
    scale = head_dim**-0.5
    tol = triton_tolerance(query_dtype)

    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(query_dtype)
    args = (q, caches["k_cache"], caches["v_cache"], batch.block_tables, batch.seq_lens, scale)
    expected = paged_decode_attention_ref(*args, **scales).float()
    for num_splits in (None, 2):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits, **scales)
        assert out.dtype == query_dtype
        torch.testing.assert_close(out.float(), expected, **tol)

    cu = torch.tensor(
        [0] + list(itertools.accumulate(n for _, n in shapes)), dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=DEVICE).to(query_dtype)
    args = (q, caches["k_cache"], caches["v_cache"], batch.block_tables, cu, batch.seq_lens, scale)
    out = kernels.paged_prefill_attention(*args, **scales)
    torch.testing.assert_close(out.float(), paged_prefill_attention_ref(*args, **scales).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
def test_triton_write_kv_quantizes_as_the_reference_does(dtype):
    from test_kv_quant import quantize_batch

    batch = make_paged_batch([40, 9], 3, 80, 16, torch.float32, DEVICE)
    got, expected = quantize_batch(batch, dtype), quantize_batch(batch, dtype)
    k = (torch.randn(6, 3, 80, device=DEVICE) * 3).to(torch.bfloat16)
    v = torch.randn(6, 3, 80, device=DEVICE).to(torch.bfloat16)
    k[3, 2] = 0  # an all-zero row: scale 0
    slots = torch.tensor([0, -1, 17, 33, -5, 47], dtype=torch.int32, device=DEVICE)
    slots = torch.where(slots >= 0, batch.block_tables[0, slots.clamp(min=0) // 16] * 16 + slots % 16, slots)

    g, e = got.caches(), expected.caches()
    kernels.write_kv(k, v, g["k_cache"], g["v_cache"], slots, k_scale=g["k_scale"], v_scale=g["v_scale"])
    write_kv_ref(k, v, e["k_cache"], e["v_cache"], slots, e["k_scale"], e["v_scale"])

    torch.testing.assert_close(got.scales, expected.scales, atol=0, rtol=1e-6)
    # Codes agree exactly but where x / scale lands within rounding of a tie (division order).
    mismatch = (got.codes.float() - expected.codes.float()).abs() > 0
    assert mismatch.float().mean() < 1e-3, f"{int(mismatch.sum())} codes differ"
