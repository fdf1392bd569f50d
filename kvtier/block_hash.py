"""Block hashes: the names of full KV blocks, chained over every token before them.

One module for every process that names blocks: the cache service's prefix index, its tests and
benchmarks, and a router that keeps a global prefix index from ``WatchEvents``. No gRPC and
nothing of the cache service here.

Specification
-------------
A full block (``block_size`` tokens) is named by a hash chained over every token before it:

    extra      = sha256(b"kvtier-block-v1\\0" + b"\\0".join(utf8(model_fingerprint), utf8(cache_salt), utf8(adapter_id)))
    block_hash = sha256(parent || token ids of the block as little-endian int32)

``parent`` is the previous block's hash, or ``extra`` for the first block of a sequence: the
model, tenant salt and adapter enter once, at the root of the chain, and every later hash
inherits them. Both are 32 bytes, so one preimage is 32 + 4 * block_size bytes (96 at block
size 16, two SHA-256 compressions). The formula depends on nothing in the process (no
``PYTHONHASHSEED``, no random seed), so a global prefix index elsewhere, fed by the
``BlockStored`` / ``BlockRemoved`` events, computes the same hashes from the same token ids.
Different salts, adapters or models never share a block because their chains start apart.

``parent || token bytes`` is a block's *preimage*. The cache service keys its prefix index by
preimages rather than digests, so walking a cached prefix costs a dict lookup per block and
SHA-256 runs only for blocks named for the first time (see ``cachesvc.block_manager``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""32-byte sha256 digest naming a full block and, through the chain, its whole prefix."""

_HASH_DOMAIN = b"kvtier-block-v1\0"
_sha256 = hashlib.sha256


class InvalidHashInput(ValueError):
    """A token id or key field that cannot be hashed (not an int32, a NUL in a field).

    The message names the offending value; the cache service reports it as INVALID_ARGUMENT.
    """


def extra_key(model_fingerprint: str, cache_salt: str = "", adapter_id: str = "") -> bytes:
    """The 32-byte key mixed into every block hash: model, tenant salt and adapter identity.

    Fields are joined by NUL bytes, so a field may not contain one (it would make two
    different triples collide); that raises InvalidHashInput.
    """
    fields = (model_fingerprint, cache_salt, adapter_id)
    for name, value in zip(("model_fingerprint", "cache_salt", "adapter_id"), fields, strict=True):
        if "\0" in value:
            raise InvalidHashInput(f"{name} = {value!r} contains a NUL character, which is not allowed")
    return _sha256(_HASH_DOMAIN + b"\0".join(f.encode("utf-8") for f in fields)).digest()


# Token count -> the bound ``pack`` of a compiled ``struct.Struct("<{count}i")`` (``I`` for
# uint32); block bytes -> the ``iter_unpack`` of ``struct.Struct("<{count}s")``. Each is cleared
# when it holds this many (every prompt length up to max_model_len could otherwise stay compiled).
_MAX_PACKERS = 4096
_int32_packers: dict[int, Callable[..., bytes]] = {}
_uint32_packers: dict[int, Callable[..., bytes]] = {}
_block_cutters: dict[int, Callable[[memoryview], Iterator[tuple[bytes]]]] = {}


def _compile(cache: dict[int, Callable], code: str, count: int, method: str = "pack") -> Callable:
    """Compile ``struct.Struct("<{count}{code}")``, keep its ``method`` in ``cache`` and return it."""
    if len(cache) >= _MAX_PACKERS:
        cache.clear()
    compiled = cache[count] = getattr(struct.Struct(f"<{count}{code}"), method)
    return compiled


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes per token), the form block hashes cover.

    Raises InvalidHashInput if an id does not fit in int32 or is not an int.
    """
    # NOTE: struct with an explicit "<" is both the fastest list -> bytes conversion we measured
    # (about 2x array('i') and numpy) and independent of the host's byte order. A compiled
    # Struct per length packs 1024 ids in ~80% of struct.pack's time (no format string built
    # and looked up per call): this runs for every prompt and commit.
    n = len(token_ids)
    pack = _int32_packers.get(n) or _compile(_int32_packers, "i", n)
    try:
        return pack(*token_ids)
    except struct.error as e:
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or not -(2**31) <= t < 2**31:
                raise InvalidHashInput(f"token_ids[{i}] = {t!r} is not an int32") from e
        raise InvalidHashInput(f"token_ids cannot be packed as int32: {e}") from e


def pack_nonnegative_ids(token_ids: Sequence[int]) -> bytes | None:
    """``pack_token_ids`` of ids known to be below a bound under 2**31 (a vocabulary), or None.

    Packed as uint32, which are the same bytes for every id in [0, 2**31): a negative id (or one
    that is not an int, or over 2**32 - 1) fails the packing and returns None, so a caller
    checking ids against its bound needs only their max. An id in [2**31, 2**32) packs into
    bytes that are NOT its int32 form: the caller's bound must reject it.
    """
    n = len(token_ids)
    pack = _uint32_packers.get(n) or _compile(_uint32_packers, "I", n)
    try:
        return pack(*token_ids)
    except struct.error:
        return None


def iter_block_bytes(data: bytes, block_size: int, max_blocks: int) -> Iterator[tuple[bytes]]:
    """The leading full blocks of ``pack_token_ids`` bytes, at most ``max_blocks``, in order, each
    as a 1-tuple ``(its 4 * block_size bytes,)``; a trailing partial block is never one.

    NOTE: struct's iter_unpack cuts the blocks in C, about half the cost of a slice per block in
    Python: this walks every block hashed or looked up.
    """
    step = 4 * block_size
    cut = _block_cutters.get(step) or _compile(_block_cutters, "s", step, "iter_unpack")
    return cut(memoryview(data)[: min(max_blocks, len(data) // step) * step])


def unpack_block(data: bytes, block_size: int, index: int) -> list[int]:
    """Token ids of block ``index`` of ``pack_token_ids`` bytes (``block_size`` tokens a block)."""
    return list(struct.unpack_from(f"<{block_size}i", data, 4 * block_size * index))


def hash_preimage(preimage: bytes) -> BlockHash:
    """The hash named by a block's preimage (``parent || token bytes``)."""
    return BlockHash(_sha256(preimage).digest())


def hash_block(parent: BlockHash | None, token_ids: Sequence[int] | bytes, extra: bytes) -> BlockHash:
    """Hash of one block: sha256((parent, or extra for the first block) || token ids as LE int32).

    ``token_ids`` may be a sequence of ints or the bytes of ``pack_token_ids``.
    """
    data = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
    return hash_preimage((parent or extra) + data)


def chain_preimages(
    data: bytes, block_size: int, parent: bytes, hashes: list[BlockHash], first: int
) -> list[bytes]:
    """Walk the chain over every FULL block of ``data``; return each block's preimage, in order.

    ``data`` is ``pack_token_ids`` bytes (4 per token, ``block_size`` tokens per block) starting
    at block ``first`` of a sequence, ``parent`` the hash before that block (the extra key at
    block 0); a trailing partial block is ignored. ``hashes`` holds the sequence's
    known chain: block ``first + i`` takes ``hashes[first + i]`` where it exists, else its hash
    is computed and appended (so ``len(hashes) >= first`` is required). Blocks already named are
    not hashed again.
    """
    blocks = iter_block_bytes(data, block_size, len(data))
    num_known = max(len(hashes) - first, 0)
    preimages: list[bytes] = []
    keep = preimages.append
    if num_known:  # blocks whose hash is known: their preimages only
        # The hashes come first in the zip: it stops on them without taking a block past them.
        for block_hash, (tokens,) in zip(hashes[first : first + num_known], blocks, strict=False):
            keep(parent + tokens)
            parent = block_hash
    append_hash = hashes.append
    sha256 = _sha256
    # NOTE: the token list is converted to bytes once; each block is cut from it. The cost per
    # new block is dominated by one sha256 call (OpenSSL's per-call setup), not by Python.
    for (tokens,) in blocks:
        preimage = parent + tokens
        keep(preimage)
        parent = sha256(preimage).digest()
        append_hash(parent)
    return preimages


def hash_full_blocks(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    extra: bytes,
    start_parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block is ignored).

    ``token_ids`` is a sequence of ints or ``pack_token_ids`` bytes, starting at a block
    boundary; ``start_parent`` is the hash of the block just before it (None at token 0).
    Returns ``len(token_ids) // block_size`` hashes, in token order.
    """
    data = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
    parent = start_parent or extra
    hashes: list[BlockHash] = []
    append = hashes.append
    sha256 = _sha256
    # NOTE: the chain of chain_preimages without keeping the preimages: this is what a router
    # runs per prompt, and a list append per block costs a tenth of the hash here.
    for (tokens,) in iter_block_bytes(data, block_size, len(data)):
        parent = sha256(parent + tokens).digest()
        append(parent)
    return hashes
