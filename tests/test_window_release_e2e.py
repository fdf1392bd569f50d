"""A Mistral-style model (every layer windowed) served by the real stack past its window gives the
blocks its window left behind back to the cache (issue 24 item 3), and still decodes as Hugging
Face does; a later request with the same prompt hits the released-but-cached blocks.

Each stack is one cache service and one replica over a saved seeded model directory
(tests/test_sliding_window builds the models): the Mistral-style one (a roomy pool and a 4-block
one) and a Qwen2 with one full layer, which releases nothing. Which models release at all
(`computesvc.window`) is also checked without a stack.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from servers import TOKEN, ModuleLoop, child_env, greedy_request, stats_without_clock
from test_model import prompt
from test_sliding_window import WINDOW, windowed_model

from kvtier.cache_client import CacheClient
from kvtier.cache_errors import InvalidRequest
from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cli.stack import LocalStack
from kvtier.compute_client import ComputeClient
from kvtier.computesvc.window import blocks_behind, release_window
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.tokenizer import build_byte_tokenizer

BLOCK = 16  # tokens per block: the window (24) starts mid-block
LOOKAHEAD_BLOCKS = 1  # the scheduler's default
# The most blocks a decoding sequence holds once its window has moved: the window's positions
# straddle ceil(W / B) + 1 blocks, plus the lookahead block each Extend reserves.
MAX_HELD = -(-WINDOW // BLOCK) + 1 + LOOKAHEAD_BLOCKS

LOOP = ModuleLoop()


# ---------------------------------------------------------------- which models release


def test_only_a_model_windowed_in_every_layer_releases():
    from transformers import LlamaConfig, Qwen2Config

    assert release_window(windowed_model("mistral", WINDOW).config) == WINDOW
    assert release_window(windowed_model("mistral", None).config) is None
    # Qwen2 with one full layer keeps full context there: nothing may be released.
    assert release_window(windowed_model("qwen2-mixed", WINDOW).config) is None
    common = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_theta"}
    all_windowed = Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    assert release_window(all_windowed) == WINDOW
    assert release_window(LlamaConfig(**common)) is None


@pytest.mark.parametrize(
    ("num_computed", "expected"),
    [(0, 0), (23, 0), (38, 0), (39, 1), (54, 1), (55, 2), (100, 4)],
)
def test_blocks_behind_are_those_wholly_before_the_next_query_s_window(num_computed, expected):
    # The query at position p reads p - 23 .. p: block b (positions 16b .. 16b + 15) is behind
    # once 16b + 15 < p - 23.
    assert blocks_behind(num_computed, WINDOW, BLOCK) == expected


# ---------------------------------------------------------------- through the stack


@pytest.fixture(scope="module")
def eager():
    """The Mistral-style model, every layer windowed, in transformers' own eager attention; EOS
    cleared so generate runs exactly max_new_tokens, as ignore_eos does."""
    model = windowed_model("mistral", WINDOW)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model_dir(eager, tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-windowed")
    eager.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@contextmanager
def one_replica_stack(model_dir, run_dir, num_blocks: int):
    model = ["--model", str(model_dir)]
    with LocalStack(
        run_dir,
        cache_args=[*model, "--num-blocks", str(num_blocks), "--block-size", str(BLOCK), "--lease-ttl", "2"],
        compute_args=model,
        num_replicas=1,
        env=child_env(run_dir),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with one_replica_stack(model_dir, tmp_path_factory.mktemp("window-release"), 256) as s:
        yield s


@pytest.fixture(scope="module")
def cache(stack):
    client = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
    yield client
    client.close()


def generate(stack, token_ids: list[int], max_tokens: int):
    async def go():
        client = ComputeClient([stack.replicas[0].address], TOKEN)
        try:
            return await client.complete(greedy_request(token_ids, max_tokens))
        finally:
            await client.close()

    return LOOP.run(go())


def hf_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(token_ids) :].tolist()


@pytest.mark.slow
def test_greedy_past_the_window_matches_hf_and_released_blocks_stay_prefix_hits(stack, cache, eager):
    ids = prompt(45, salt=21)
    released_before = cache.get_stats().num_window_released_blocks

    done = generate(stack, ids, 60)  # 105 tokens: more than four windows

    assert done.token_ids == hf_greedy(eager, ids, 60)
    # Its last Extend came within a block of the end: the window had left at least this many
    # blocks behind by then, and the cache took them back.
    released = cache.get_stats().num_window_released_blocks - released_before
    assert released >= blocks_behind(45 + 60 - 2 * BLOCK, WINDOW, BLOCK) > 0
    # The prompt's first blocks were released mid-request and stayed cached: the same prompt
    # hits them (whole blocks below its last token).
    again = generate(stack, ids, 4)
    assert again.cached_prompt_tokens == (45 - 1) // BLOCK * BLOCK
    assert again.token_ids == done.token_ids[:4]


async def aenumerate(replies):
    k = 0
    async for reply in replies:
        yield k, reply
        k += 1


@pytest.mark.slow
def test_a_long_decode_holds_only_its_window_and_lookahead(stack, cache):
    """GetStats while one request decodes far past its window: its lease never holds more than
    the window's blocks and the lookahead (without releases it held 21)."""
    ids = prompt(40, salt=22)
    max_tokens = 300
    seen: list[tuple[int, int]] = []  # (tokens delivered so far, blocks the lease holds)

    async def go():
        client = ComputeClient([stack.replicas[0].address], TOKEN)
        delivered = 0
        try:
            async for k, reply in aenumerate(client.stream(greedy_request(ids, max_tokens))):
                delivered += len(reply.token_ids)
                if k % 5 == 0:  # a GetStats per reply would slow the reader behind the decode
                    leases = [lease for lease in cache.get_stats().leases if lease.num_sequences]
                    seen.extend((delivered, lease.num_blocks) for lease in leases)
        finally:
            await client.close()
        return delivered

    assert LOOP.run(go()) == max_tokens
    late = [blocks for delivered, blocks in seen if delivered >= 100]
    assert late, f"no GetStats caught the sequence live after 100 tokens: {seen}"
    assert max(blocks for _, blocks in seen) <= MAX_HELD, seen


@pytest.mark.slow
def test_a_sequence_far_longer_than_the_pool_decodes_in_a_pool_its_window_fits(model_dir, tmp_path):
    """4 blocks (64 tokens) serve a 340-token sequence: when an Extend finds the pool full, the
    replica first gives back what the window left behind (an Extend asking no room), then
    retries, instead of preempting a sequence that could never be readmitted."""
    with one_replica_stack(model_dir, tmp_path / "run", num_blocks=4) as tight:
        done = generate(tight, prompt(40, salt=23), 300)
        assert (len(done.token_ids), done.finish_reason) == (300, "length")


@pytest.mark.slow
def test_releases_on_the_wire_answer_placeholders_and_a_bad_one_is_invalid_argument(stack):
    """Extend's releases through the servicer: the table comes back with placeholders in the
    released positions; a release past the committed tokens is INVALID_ARGUMENT naming it and
    changes nothing (GetStats, clock aside)."""
    client = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
    try:
        client.attach("window-wire")
        ids = prompt(40, salt=24)
        (seq,) = client.allocate([ids])
        client.commit([(seq.sequence_id, [], 40)])  # the 40 prompt tokens' KV written
        table = list(seq.block_table)
        (after,) = client.extend([(seq.sequence_id, 0)], releases=[(seq.sequence_id, 2)])
        assert list(after.block_table) == [PLACEHOLDER_BLOCK] * 2 + table[2:]
        before = stats_without_clock(client.get_stats())
        with pytest.raises(InvalidRequest) as refused:
            client.extend([(seq.sequence_id, 0)], releases=[(seq.sequence_id, 3)])
        assert refused.value.code == "INVALID_ARGUMENT"
        assert (
            "releases[0].num_blocks = 3 covers 48 tokens but only 40 are committed" in refused.value.details
        )
        assert stats_without_clock(client.get_stats()) == before
        # More releases than --max-batch: refused before the servicer builds a list of them.
        with pytest.raises(InvalidRequest) as refused:
            client.extend([(seq.sequence_id, 0)], releases=[(seq.sequence_id, 1)] * (client.max_batch + 1))
        assert refused.value.code == "INVALID_ARGUMENT"
        assert f"len(releases) = {client.max_batch + 1} exceeds max_batch" in refused.value.details
        assert stats_without_clock(client.get_stats()) == before
        client.free([seq.sequence_id])
    finally:
        client.close()


@pytest.mark.slow
def test_a_mixed_model_releases_nothing_and_keeps_full_context(tmp_path):
    """Qwen2 with one full and one windowed layer: its full layer reads every position, so the
    replica releases nothing, and its output past the window is Hugging Face's."""
    mixed = windowed_model("qwen2-mixed", WINDOW)
    mixed.generation_config.eos_token_id = None
    path = tmp_path / "qwen2-mixed"
    mixed.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    ids = prompt(45, salt=25)
    with one_replica_stack(path, tmp_path / "run", num_blocks=64) as s:
        done = generate(s, ids, 60)
        client = CacheClient.connect(s.cache_address, TOKEN, timeout_s=10.0)
        try:
            assert client.get_stats().num_window_released_blocks == 0
        finally:
            client.close()
    assert done.token_ids == hf_greedy(mixed, ids, 60)
