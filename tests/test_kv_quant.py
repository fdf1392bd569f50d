"""Quantized KV (fp8_e4m3, fp8_e5m2, int8 with one float32 scale per token-head): the torch path.

The kernels on a quantized cache must compute exactly what they compute on its dequantized copy
(codes x scales, fp32), and writing must lose no more than the format's rounding. The Triton
kernels are held to the same torch path in tests/test_kernels_triton.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pytest
import torch
from bench_scripts import bench_script
from servers import ModuleLoop
from test_kernels import HEAD_LAYOUT_IDS, HEAD_LAYOUTS, PagedBatch, make_paged_batch

from kvtier import kernels
from kvtier.kernels.reference import quantize_ref

LOOP = ModuleLoop()

QUANTIZED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
# Worst relative error of one element against its row's absmax: half a unit in the last place at
# the top of the range (fp8: 3 or 2 mantissa bits; int8: half of 1/127).
ROW_ERROR = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3, torch.int8: 0.5 / 127}


@dataclass
class QuantizedBatch:
    """A paged batch whose pool holds codes and scales, and the same batch dequantized (fp32)."""

    codes: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads] float32
    dequantized: PagedBatch

    def caches(self) -> dict[str, torch.Tensor]:
        """The per-layer views the kernels take: k_cache, v_cache, k_scale, v_scale."""
        layer = self.dequantized.layer
        return {
            "k_cache": self.codes[:, layer, 0],
            "v_cache": self.codes[:, layer, 1],
            "k_scale": self.scales[:, layer, 0],
            "v_scale": self.scales[:, layer, 1],
        }


def quantize_batch(batch: PagedBatch, dtype: torch.dtype) -> QuantizedBatch:
    """`batch`'s pool quantized per token-head as write_kv stores it."""
    codes, scales = quantize_ref(batch.pool, dtype)
    dequantized = PagedBatch(
        codes.float() * scales[..., None], batch.layer, batch.block_tables, batch.seq_lens
    )
    return QuantizedBatch(codes, scales, dequantized)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_write_kv_quantizes_each_token_head_within_the_formats_rounding(dtype):
    batch = make_paged_batch([40, 9], 3, 80, 16, torch.float32)
    q = quantize_batch(batch, dtype)
    caches = q.caches()
    # Rows of very different magnitudes, one all zero, and one padding slot.
    k = torch.randn(5, 3, 80) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    v = torch.randn(5, 3, 80)
    k[2, 1] = 0
    slots = torch.tensor([0, 17, 33, -1, 47], dtype=torch.int32)
    slots = torch.where(slots >= 0, batch.block_tables[0, slots.clamp(min=0) // 16] * 16 + slots % 16, slots)

    kernels.write_kv(k, v, caches["k_cache"], caches["v_cache"], slots, **_scales(caches))

    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, 16)
        for new, cache, scale in ((k, "k_cache", "k_scale"), (v, "v_cache", "v_scale")):
            got = caches[cache][block, offset].float() * caches[scale][block, offset][:, None]
            bound = new[i].abs().amax(-1, keepdim=True) * ROW_ERROR[dtype] * 1.0001
            assert torch.all((got - new[i]).abs() <= bound), (dtype, i, cache)
    assert torch.equal(caches["k_cache"][slots[2] // 16, slots[2] % 16, 1].float(), torch.zeros(80))


def _scales(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"k_scale": caches["k_scale"], "v_scale": caches["v_scale"]}


@pytest.mark.parametrize(
    "dtype,heads,query_dtype",
    [
        (d, h, qd)
        for (d, h), qd in zip(
            itertools.product(QUANTIZED, HEAD_LAYOUTS), itertools.cycle([torch.float32, torch.bfloat16])
        )
    ],
    ids=lambda x: str(x) if not isinstance(x, tuple) else HEAD_LAYOUT_IDS[HEAD_LAYOUTS.index(x)],
)
def test_attention_on_a_quantized_cache_is_attention_on_its_dequantized_copy(dtype, heads, query_dtype):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch([37, 16, 1, 70], num_kv_heads, 64, 16, torch.float32, shared_prefix_blocks=1)
    q = quantize_batch(batch, dtype)
    caches, plain = q.caches(), q.dequantized
    scale = 64**-0.5
    tol = {"atol": 2e-5, "rtol": 2e-5} if query_dtype == torch.float32 else {"atol": 1.6e-2, "rtol": 1.6e-2}

    query = torch.randn(4, num_heads, 64).to(query_dtype)
    out = kernels.paged_decode_attention(
        query,
        caches["k_cache"],
        caches["v_cache"],
        batch.block_tables,
        batch.seq_lens,
        scale,
        **_scales(caches),
    )
    expected = kernels.paged_decode_attention(
        query.float(), plain.k_cache, plain.v_cache, batch.block_tables, batch.seq_lens, scale
    )
    assert out.dtype == query_dtype
    torch.testing.assert_close(out.float(), expected, **tol)

    cu = torch.tensor([0, 5, 21, 22, 22], dtype=torch.int32)  # 5, 16, 1 and 0 new tokens
    query = torch.randn(22, num_heads, 64).to(query_dtype)
    args = (batch.block_tables, cu, batch.seq_lens, scale)
    out = kernels.paged_prefill_attention(
        query, caches["k_cache"], caches["v_cache"], *args, **_scales(caches)
    )
    expected = kernels.paged_prefill_attention(query.float(), plain.k_cache, plain.v_cache, *args)
    torch.testing.assert_close(out.float(), expected, **tol)


def test_the_kernels_refuse_a_quantized_cache_without_its_scales_and_scales_on_a_plain_one():
    batch = make_paged_batch([20], 2, 64, 16, torch.float32)
    q = quantize_batch(batch, torch.int8)
    caches = q.caches()
    query = torch.randn(1, 4, 64)
    args = (batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="needs k_scale"):
        kernels.paged_decode_attention(query, caches["k_cache"], caches["v_cache"], *args)
    with pytest.raises(ValueError, match="takes no scales"):
        kernels.paged_decode_attention(query, batch.k_cache, batch.v_cache, *args, **_scales(caches))
    bad = {"k_scale": caches["k_scale"].double(), "v_scale": caches["v_scale"]}
    with pytest.raises(ValueError, match="k_scale must be float32"):
        kernels.paged_decode_attention(query, caches["k_cache"], caches["v_cache"], *args, **bad)


# --- the model over a quantized pool ------------------------------------------------------------


def test_quality_on_the_seeded_test_model_stays_within_bounds():
    """bench/kv_dtype.py's measurement at a test's size: perplexity of the English text, KL of the
    next-token distributions and greedy agreement of each quantized dtype against float32.
    Measured (256 tokens, 32 greedy): ppl +0.02 to +0.2%, KL <= 3e-4, fp8_e4m3 and int8 agree on
    every greedy token. The bounds leave room for other seeds, not for a broken scheme: a cache
    that dropped the scales or read the wrong token's scale moves ppl by tens of percent."""
    bench = bench_script("kv_dtype")

    model = bench.build_model("tiny-llama gqa 4/2 d16")
    with torch.inference_mode():
        results = {q.scheme: q for q in bench.measure(model, "tiny", 256, new_tokens=32, per_tensor=())}
    assert set(results) == {"float32", "fp8_e4m3", "fp8_e5m2", "int8"}
    for scheme in ("fp8_e4m3", "fp8_e5m2", "int8"):
        q = results[scheme]
        assert abs(q.perplexity_increase_pct) <= 1.0, q
        assert q.mean_kl <= 1e-3, q
    for scheme in ("fp8_e4m3", "int8"):
        assert results[scheme].greedy_agreement >= 0.5, results[scheme]
    assert results["int8"].mean_kl <= 1e-4, results["int8"]
    report = {
        "quality": [dataclasses.asdict(q) for q in results.values()],
        "capacity": {"tiny": bench.blocks_per_gib(model)},
    }
    line = bench.headline(report)
    assert line.startswith("headline: fp8_e4m3 ppl "), line
    assert "int8 ppl " in line and "3.20x blocks/GiB" in line, line


def test_the_runner_refuses_a_pool_it_cannot_read_naming_both_dtypes():
    from kvtier.computesvc.model import ModelRunner, build_tiny_model, use_paged_attention
    from kvtier.pool import pool_shape, private_pool

    model = build_tiny_model(0)
    use_paged_attention(model)
    shape = pool_shape(4, 2, 16, 2, 16)
    half = private_pool(shape, "bfloat16")
    with pytest.raises(ValueError, match="pool dtype bfloat16 cannot be read by a model running float32"):
        ModelRunner(model, half.tensor, 16)
    quantized = private_pool(shape, "int8")
    with pytest.raises(ValueError, match="int8 pool needs its float32 scales"):
        ModelRunner(model, quantized.tensor, 16)
    ModelRunner(model, quantized.tensor, 16, quantized.scales)  # a float32 model reads int8 codes


def test_the_host_area_swaps_a_quantized_block_with_its_scales():
    from kvtier.cachesvc.host_area import HostArea
    from kvtier.pool import ShmPool, pool_shape

    pool = ShmPool.create(pool_shape(4, 2, 16, 2, 16), "fp8_e4m3")
    try:
        codes, scales = quantize_ref(torch.randn(2, 2, 16, 2, 16), pool.tensor.dtype)
        pool.tensor[1], pool.scales[1] = codes, scales
        area = HostArea.for_pool(pool.rows, 1 << 20)  # what the cache service builds for swap
        slots, _ = area.reserve(1)
        area.store([1], slots)
        area.load(slots, [3])
        assert torch.equal(pool.tensor[3].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(pool.scales[3], scales)
    finally:
        pool.close()


def test_a_stack_with_an_int8_cache_serves_what_the_runner_computes_and_reports_its_dtype(tmp_path):
    """A cache service with --kv-cache-dtype int8 and a replica: the replica runs the float32
    model over the int8 pool, a repeat of the prompt reads the stored codes and scales back
    (a prefix hit), and both give the tokens an in-process runner over an int8 pool gives."""
    from servers import TOKEN, cache_stats, greedy_request, local_stack

    from kvtier.compute_client import ComputeClient
    from kvtier.model_spec import ModelShape

    bench = bench_script("kv_dtype")

    prompt = bench.text_tokens()[:40]
    expected = bench.greedy(bench.build_model("tiny-llama gqa 4/2 d16"), "int8", prompt, 12)

    async def complete_twice(address: str) -> list[list[int]]:
        client = ComputeClient([address], TOKEN)
        try:
            return [(await client.complete(greedy_request(prompt, 12))).token_ids for _ in range(2)]
        finally:
            await client.close()

    with local_stack(tmp_path, ["--num-blocks", "64", "--kv-cache-dtype", "int8"], replicas=1) as stack:
        first, repeat = LOOP.run(complete_twice(stack.replicas[0].address))
        stats = cache_stats(stack)
    assert first == expected and repeat == expected
    assert stats.prefix_hit_tokens >= 32  # the repeat read two full blocks of int8 codes and scales
    assert stats.kv_cache_dtype == "int8"
    assert stats.block_bytes == ModelShape.tiny().block_bytes(16, "int8")
