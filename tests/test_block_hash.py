"""The block-hash chain external indexers reimplement: pinned by the test vector in docs/architecture.md."""

from __future__ import annotations

import hashlib
import random
import struct

from kvtier.block_hash import (
    chain_preimages,
    extra_key,
    hash_full_blocks,
    iter_block_bytes,
    pack_nonnegative_ids,
    pack_token_ids,
)

# docs/architecture.md, "Block-hash specification": block_size 16, model "fp", no salt or adapter.
EXTRA = "c4b41964925b354c23ea58c3ad0c09f4790313ae1a891bb7d8a1e5463b16a7bf"
BLOCK_HASHES = [
    "9f9fecb16a889c89c0fd4770843ba10b400d8314e865d775dbb3ff14809e4820",
    "42857f8b24ced54053a75a77b040451c483b5eb4c27c8b628c44a49b3ffcb71a",
]


def test_block_hashes_match_the_documented_test_vector():
    extra = extra_key("fp")
    assert extra.hex() == EXTRA
    assert [h.hex() for h in hash_full_blocks(list(range(32)), 16, extra)] == BLOCK_HASHES


def test_the_documented_formula_written_out_with_hashlib_alone_agrees():
    # What an indexer in another codebase writes from the specification, without our code.
    extra = hashlib.sha256(b"kvtier-block-v1\0" + b"fp" + b"\0" + b"" + b"\0" + b"").digest()
    parent, hashes = extra, []
    for block in (range(0, 16), range(16, 32)):
        parent = hashlib.sha256(parent + struct.pack("<16i", *block)).digest()
        hashes.append(parent.hex())
    assert extra.hex() == EXTRA
    assert hashes == BLOCK_HASHES


def _reference_chain(token_ids: list[int], block_size: int, parent: bytes) -> tuple[list[bytes], list[bytes]]:
    """Preimages and hashes of every full block, from the specification with hashlib alone."""
    preimages, hashes = [], []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        preimages.append(parent + struct.pack(f"<{block_size}i", *token_ids[start : start + block_size]))
        parent = hashlib.sha256(preimages[-1]).digest()
        hashes.append(parent)
    return preimages, hashes


def test_the_fast_chain_walks_agree_with_the_formula_on_random_chains():
    # The blocks are cut from packed bytes by struct (iter_block_bytes): partial tails, every
    # count of already-known hashes and the max_blocks cap must give the formula's bytes.
    rng = random.Random(7)
    extra = extra_key("fp", "salt")
    for _ in range(300):
        block_size = rng.choice([1, 2, 16, 32])
        tokens = [rng.randrange(2**31) for _ in range(rng.randrange(0, 5 * block_size))]
        preimages, hashes = _reference_chain(tokens, block_size, extra)
        data = pack_token_ids(tokens)
        assert hash_full_blocks(tokens, block_size, extra) == hashes
        known = rng.randrange(0, len(hashes) + 2)
        chain = hashes[:known]
        assert chain_preimages(data, block_size, extra, chain, 0) == preimages
        assert chain == hashes, f"known {known} of {len(hashes)}: the missing hashes are appended"
        cap = rng.randrange(0, len(hashes) + 2)
        cut = [tokens_bytes for (tokens_bytes,) in iter_block_bytes(data, block_size, cap)]
        assert cut == [p[32:] for p in preimages[:cap]]


def test_pack_nonnegative_ids_is_pack_token_ids_or_refuses():
    ids = [0, 1, 50256, 2**31 - 1]
    assert pack_nonnegative_ids(ids) == pack_token_ids(ids)
    assert pack_nonnegative_ids([]) == b""
    for bad in ([3, -1], [2**32], [1, "7"], [1.0]):
        assert pack_nonnegative_ids(bad) is None, bad
