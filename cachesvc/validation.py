"""Phase-1 checks of batched sequence calls: batch size, ownership, duplicates, token ids, keys.

Every function here reads state and raises a CacheError naming the offending item
(``items[3].token_ids[17] = 70000 is out of range [0, 50257)``); none changes anything, so a
call that fails here leaves the cache as it was (see ``cachesvc.sequences``). Each condition is
written once, next to its message: a check is the error it raises. What a check reads is in its
arguments (the table's sequences dict and bounds), never a table object.
"""

from __future__ import annotations

import numpy as np

from kvtier.block_hash import InvalidHashInput, extra_key, pack_nonnegative_ids, pack_token_ids
from kvtier.cachesvc.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvtier.cachesvc.records import DEVICE, Sequence
from kvtier.sequence_types import CommitItem, PrefixQuery, ReleaseItem

# Cached extra keys per (tenant_salt, adapter_id); cleared when it grows past this many entries
# (one salt per request would otherwise grow it without bound).
_MAX_EXTRA_KEYS = 4096


# Most UTF-8 bytes of a request's strings: they are hashed, kept with a sequence or lease, logged
# and reported by GetStats, so one request's strings must not cost the service (or every GetStats
# reader) more than this. Lease ids are 32 hex digits.
MAX_SALT_BYTES = 1024  # tenant_salt: room for a high-entropy salt in any encoding
MAX_NAME_BYTES = 256  # client_name, adapter_id, request_id
MAX_LEASE_ID_BYTES = 64


def check_batch(n: int, max_batch: int, field: str = "items") -> None:
    if n > max_batch:
        raise InvalidArgument(f"len({field}) = {n} exceeds max_batch {max_batch}")


def check_text(where: str, value: str, limit: int) -> None:
    """InvalidArgument if ``value`` is over ``limit`` bytes of UTF-8."""
    # A str of n characters is at most 4n bytes: most values need no encoding to pass.
    if len(value) * 4 > limit and (size := len(value.encode())) > limit:
        raise InvalidArgument(f"{where} is {size} bytes, over the limit of {limit} bytes")


def check_item_sizes(
    k: int, num_tokens: int, max_model_len: int, tenant_salt: str, adapter_id: str, request_id: str = ""
) -> None:
    """Bounds of item ``k`` of a call carrying token lists, checked on the wire message before
    any list is built from it: ``num_tokens`` (len of its token ids) and its strings."""
    check_length(k, num_tokens, max_model_len)
    if len(tenant_salt) > MAX_SALT_BYTES // 4:
        check_text(f"items[{k}].tenant_salt", tenant_salt, MAX_SALT_BYTES)
    if len(adapter_id) > MAX_NAME_BYTES // 4:
        check_text(f"items[{k}].adapter_id", adapter_id, MAX_NAME_BYTES)
    if len(request_id) > MAX_NAME_BYTES // 4:
        check_text(f"items[{k}].request_id", request_id, MAX_NAME_BYTES)


def check_length(k: int, num_tokens: int, max_model_len: int) -> None:
    """InvalidArgument if item ``k``'s ``num_tokens`` token ids exceed ``max_model_len``."""
    if num_tokens > max_model_len:
        raise InvalidArgument(
            f"items[{k}]: len(token_ids) = {num_tokens} exceeds max_model_len {max_model_len}"
        )


def owned(
    sequences: dict[int, Sequence],
    lease_id: str,
    k: int,
    sequence_id: int,
    on_device: bool | None = True,
    field: str = "items",
) -> Sequence:
    """The sequence of item ``k`` (of the request's ``field``), checked for existence, ownership
    and (unless ``on_device`` is None) whether its blocks are on the device tier (True) or on a
    lower tier (False)."""
    # NOTE: no keyword-only parameters: CPython 3.11 does not specialize calls to a function
    # that has any, and this runs for every item of Extend, Commit and Free.
    seq = sequences.get(sequence_id)
    if seq is None:
        raise NotFound(f"{field}[{k}].sequence_id = {sequence_id} is not a live sequence")
    if seq.lease_id != lease_id:
        raise PermissionDenied(f"{field}[{k}].sequence_id = {sequence_id} belongs to another lease")
    if on_device is not None and (seq.location == DEVICE) != on_device:
        if on_device:
            raise FailedPrecondition(
                f"{field}[{k}].sequence_id = {sequence_id} is swapped out to the {seq.location} tier; SwapIn it first"
            )
        raise FailedPrecondition(f"{field}[{k}].sequence_id = {sequence_id} is already on the device")
    return seq


def check_unique(sequence_ids: list[int], field: str = "items") -> None:
    if len(sequence_ids) > 1 and len(set(sequence_ids)) != len(sequence_ids):
        seen: set[int] = set()
        for k, sid in enumerate(sequence_ids):
            if sid in seen:
                raise InvalidArgument(f"{field}[{k}].sequence_id = {sid} appears more than once in the batch")
            seen.add(sid)


def pack_checked(where: str, token_ids: list[int], vocab_size: int) -> bytes:
    """Token ids as LE int32 bytes, after checking each is an int in [0, vocab_size)."""
    # NOTE: packed as uint32 (a negative or non-int id fails the packing, so only the max is
    # left to check); the max of a long list in one vectorized call over the packed ids, of a
    # short one with the builtin, which costs less than numpy's call overhead. np.maximum.reduce,
    # not ndarray.max: the method goes through a Python wrapper first (a tenth of this check at
    # 1k tokens). A failure re-walks the ids to name the first bad one.
    data = pack_nonnegative_ids(token_ids)
    bound = vocab_size if vocab_size < 2**31 else 2**31  # where uint32 bytes stop being int32's
    if data is None or (
        token_ids
        and (
            max(token_ids)
            if len(token_ids) <= 64
            else int(np.maximum.reduce(np.frombuffer(data, dtype=np.uint32)))
        )
        >= bound
    ):
        _raise_bad_token(where, token_ids, vocab_size)
    return data


def _raise_bad_token(where: str, token_ids: list[int], vocab_size: int) -> None:
    """InvalidArgument naming the first id that is not an int32 (as ``pack_token_ids`` names it),
    else the first outside [0, vocab_size)."""
    try:
        pack_token_ids(token_ids)
    except InvalidHashInput as e:
        raise InvalidArgument(f"{where}.{e}") from None
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{where}.token_ids[{i}] = {t} is out of range [0, {vocab_size})")
    raise AssertionError(f"{where}: pack_nonnegative_ids refused ids that are all in range")


class ExtraKeys:
    """``extra_key`` of one model per (tenant_salt, adapter_id), computed once per pair."""

    def __init__(self, model_fingerprint: str) -> None:
        self.model_fingerprint = model_fingerprint
        self._keys: dict[tuple[str, str], bytes] = {}
        self._salts: dict[bytes, str] = {}  # extra key -> its tenant_salt, for the KV events

    def get(self, where: str, tenant_salt: str, adapter_id: str) -> bytes:
        """The 32-byte extra key; InvalidArgument naming ``where`` if a field holds a NUL."""
        key = (tenant_salt, adapter_id)
        extra = self._keys.get(key)
        if extra is None:
            try:
                extra = extra_key(self.model_fingerprint, tenant_salt, adapter_id)
            except InvalidHashInput as e:
                raise InvalidArgument(f"{where}.{e}") from None
            if len(self._keys) >= _MAX_EXTRA_KEYS:
                self._keys.clear()
                self._salts.clear()
            self._keys[key] = extra
            self._salts[extra] = tenant_salt
        return extra

    def salt_of(self, extra: bytes) -> str | None:
        """The tenant_salt an extra key was made with ("" for none); None for a key not made here
        since the last clearing (or for any other bytes, such as a block hash)."""
        return self._salts.get(extra)


def key_queries(
    items: list[PrefixQuery], extra_keys: ExtraKeys, vocab_size: int, max_model_len: int, max_batch: int
) -> list[tuple[bytes, bytes]]:
    """LookupPrefix's items as ``(prompt bytes, extra key)``, after checking each: the batch
    size, then per item its length, token ids and key fields."""
    check_batch(len(items), max_batch)
    keyed: list[tuple[bytes, bytes]] = []
    for k, (tokens, tenant_salt, adapter_id) in enumerate(items):
        check_length(k, len(tokens), max_model_len)
        where = f"items[{k}]"
        data = pack_checked(where, tokens, vocab_size)
        keyed.append((data, extra_keys.get(where, tenant_salt, adapter_id)))
    return keyed


# ---------------------------------------------------------------- Commit
# It runs every decode step (carried by Extend, Free, SwapOut): it returns the items' sequences so
# the caller walks them once. Extend's checks are cachesvc.allocation.plan_extend.


def commit_sequences(
    sequences: dict[int, Sequence],
    block_size: int,
    max_model_len: int,
    vocab_size: int,
    max_batch: int,
    lease_id: str,
    items: list[CommitItem],
) -> list[Sequence]:
    """The sequences of Commit ``items``, in order, after checking each: the tokens after
    appending fit the block table and ``max_model_len``, ``num_computed_tokens`` never decreases
    nor exceeds them, and every new token id is in [0, vocab_size). The table's bounds come
    first so it can bind them once (functools.partial)."""
    if len(items) > max_batch:
        check_batch(len(items), max_batch)
    seqs = []
    for k, (sid, new_tokens, num_computed) in enumerate(items):
        seq = owned(sequences, lease_id, k, sid)
        n = len(seq.token_ids) + len(new_tokens)
        slots = len(seq.block_table) * block_size
        if n > slots:
            raise InvalidArgument(
                f"items[{k}]: {len(seq.token_ids)} tokens + {len(new_tokens)} new = {n} exceed the "
                f"sequence's {slots} slots; Extend it first"
            )
        if n > max_model_len:
            raise InvalidArgument(f"items[{k}]: {n} tokens exceed max_model_len {max_model_len}")
        if not seq.num_computed_tokens <= num_computed <= n:
            raise InvalidArgument(
                f"items[{k}].num_computed_tokens = {num_computed} is not in "
                f"[{seq.num_computed_tokens} (already computed), {n} (tokens)]"
            )
        # A decode step commits a token or a few: a Python loop beats packing for those.
        if len(new_tokens) > 32:
            pack_checked(f"items[{k}]", new_tokens, vocab_size)
        else:
            for t in new_tokens:
                if type(t) is not int or not 0 <= t < vocab_size:
                    pack_checked(f"items[{k}]", new_tokens, vocab_size)
                    break
        seqs.append(seq)
    if len(items) > 1:
        check_unique([item[0] for item in items])
    return seqs


# ---------------------------------------------------------------- Extend's releases
# Blocks a sliding window left behind (cachesvc.releases applies them): rare, once per block a
# window moves past, so each is checked on its own.


def release_sequences(
    sequences: dict[int, Sequence],
    block_size: int,
    max_batch: int,
    lease_id: str,
    items: list[ReleaseItem],
    commits: list[CommitItem] = (),
) -> list[tuple[Sequence, int]]:
    """``(sequence, num_blocks)`` of each release item that releases more than its sequence has
    released already, after checking every item: a device sequence of the lease, 0 <=
    ``num_blocks`` <= its table, and only blocks wholly inside its computed tokens (after the
    call's ``commits``, checked already) released. The table's bounds come first (partial)."""
    check_batch(len(items), max_batch, "releases")
    computed = {sid: n for sid, _, n in commits} if commits else {}
    out = []
    for k, (sid, num_blocks) in enumerate(items):
        seq = owned(sequences, lease_id, k, sid, field="releases")
        if not 0 <= num_blocks <= len(seq.block_table):
            raise InvalidArgument(
                f"releases[{k}].num_blocks = {num_blocks} is not in [0, {len(seq.block_table)} "
                f"(the sequence's blocks)]"
            )
        num_computed = computed.get(sid, seq.num_computed_tokens)
        if num_blocks * block_size > num_computed:
            raise InvalidArgument(
                f"releases[{k}].num_blocks = {num_blocks} covers {num_blocks * block_size} tokens but only "
                f"{num_computed} are committed: only blocks whose KV is written may be released"
            )
        if num_blocks > seq.num_released_blocks:
            out.append((seq, num_blocks))
    check_unique([sid for sid, _ in items], "releases")
    return out
