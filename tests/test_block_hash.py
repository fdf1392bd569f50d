"""The block-hash chain external indexers reimplement: pinned by the test vector in docs/architecture.md."""

from __future__ import annotations

import hashlib
import struct

from kvtier.block_hash import extra_key, hash_full_blocks

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
