"""What a CacheService request may cost before it is parsed: per-method byte limits, and a scan of
the raw bytes of large token-list requests.

Both run in the CallGuard (``kvtier.call_guard``) on the raw request, before protobuf parses it:
parsing a packed token list builds an 8-byte integer per token id (a 5 MB list of one-byte ids:
40 MB and a few hundred milliseconds of the event loop), so a request whose items could never be
accepted is refused on a walk over its bytes instead.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.api import cache_pb2
from kvtier.cachesvc.validation import MAX_NAME_BYTES, MAX_SALT_BYTES

SERVICE = "/kvtier.v1.CacheService/"
# Calls that carry token lists (max_batch items of up to max_model_len tokens each).
TOKEN_RPCS = {
    "Allocate": (cache_pb2.AllocateRequest, cache_pb2.AllocateItem),
    "Commit": (cache_pb2.CommitRequest, cache_pb2.CommitItem),
    "LookupPrefix": (cache_pb2.LookupPrefixRequest, cache_pb2.LookupPrefixItem),
}
# Calls that carry up to max_batch sequence ids (varints of up to 10 bytes each).
# Calls that may carry commits (their `commits` field: CommitItems with token lists).
COMMIT_CARRIERS = {
    "Extend": cache_pb2.ExtendRequest,
    "Free": cache_pb2.FreeRequest,
    "SwapOut": cache_pb2.SwapOutRequest,
}
# Calls with a few bounded fields.
SMALL_RPCS = ("Attach", "Heartbeat", "GetStats", "WatchEvents", "WatchEventBatches")
SMALL_REQUEST_BYTES = 4096
# Requests at least this large are scanned before they are parsed; smaller ones parse in
# about a millisecond.
SCAN_FROM_BYTES = 256 << 10


def varint_bytes(value: int) -> int:
    """Bytes of ``value`` as a protobuf varint."""
    return max(1, (value.bit_length() + 6) // 7)


def request_limits(
    max_batch: int, max_model_len: int, vocab_size: int, max_token_request_bytes: int | None = None
) -> dict[str, int]:
    """The largest request each CacheService method takes, in serialized bytes (full method name
    -> bytes), for ``start_server(max_request_bytes=...)``.

    A call carrying token lists may hold max_batch items of max_model_len tokens, each token id a
    varint below vocab_size (one byte more each if a client does not pack them), plus each
    item's strings at their limits; ``max_token_request_bytes`` (--max-request-bytes) replaces
    that figure.
    """
    per_token = varint_bytes(vocab_size - 1) + 1
    # Per item: tags and lengths, sequence id / lookahead / computed tokens (10-byte varints at
    # most), a salt and three names (adapter_id, request_id, tenant).
    per_item = max_model_len * per_token + MAX_SALT_BYTES + 3 * MAX_NAME_BYTES + 64
    tokens = max_token_request_bytes or max_batch * per_item + SMALL_REQUEST_BYTES
    limits = {SERVICE + name: tokens for name in TOKEN_RPCS}
    limits[SERVICE + "SwapIn"] = max_batch * 11 + SMALL_REQUEST_BYTES
    # Extend, Free and SwapOut may carry commits (token lists): Commit's limit.
    limits.update({SERVICE + name: tokens for name in COMMIT_CARRIERS})
    limits.update({SERVICE + name: SMALL_REQUEST_BYTES for name in SMALL_RPCS})
    return limits


def request_scans(
    max_batch: int, max_model_len: int, scan_from_bytes: int = SCAN_FROM_BYTES
) -> dict[str, Callable[[bytes], str | None]]:
    """Full method name -> a check of a token-list request's raw bytes, for
    ``start_server(raw_checks=...)``: what is wrong with it (INVALID_ARGUMENT), or None. Requests
    under `scan_from_bytes` pass unscanned."""
    lists = [
        (name, request_type, item_type, "items") for name, (request_type, item_type) in TOKEN_RPCS.items()
    ]
    lists += [
        (name, request_type, cache_pb2.CommitItem, "commits")
        for name, request_type in COMMIT_CARRIERS.items()
    ]
    scans = {}
    for name, request_type, item_type, field in lists:
        items_field = request_type.DESCRIPTOR.fields_by_name[field].number
        tokens_field = item_type.DESCRIPTOR.fields_by_name["token_ids"].number
        scan = _token_list_scan(items_field, tokens_field, max_batch, max_model_len, scan_from_bytes, field)
        scans[SERVICE + name] = scan
    return scans


_HIGH_BYTES = bytes(range(0x80, 0x100))  # a varint's continuation bytes; each other byte ends one


def _token_list_scan(
    items_field: int,
    tokens_field: int,
    max_batch: int,
    max_model_len: int,
    scan_from: int,
    label: str = "items",
):
    items_key = items_field << 3 | 2  # a length-delimited field

    def scan(raw: bytes) -> str | None:
        """Counts items and each item's packed token ids without parsing; anything else (an
        unpacked or malformed list) is left to the parser, whose work its size already bounds."""
        if len(raw) < scan_from:
            return None
        view = memoryview(raw)
        num_items = 0
        for key, start, end in _fields(view, 0, len(view)):
            if key != items_key:
                continue
            if num_items == max_batch:
                return f"len({label}) exceeds max_batch {max_batch}"
            num_tokens = _packed_count(view, start, end, tokens_field, max_model_len)
            if num_tokens > max_model_len:
                return (
                    f"{label}[{num_items}]: len(token_ids) is at least {num_tokens}, over max_model_len "
                    f"{max_model_len}"
                )
            num_items += 1
        return None

    return scan


def _packed_count(view: memoryview, start: int, end: int, field: int, max_model_len: int) -> int:
    """Token ids in the packed ``field`` of the item in ``view[start:end]`` (0 if unpacked); past
    max_model_len, a lower bound that is over it."""
    key = field << 3 | 2
    count = 0
    for k, s, e in _fields(view, start, end):
        if k != key:
            continue
        if e - s > max_model_len * 10:  # more bytes than max_model_len varints can take
            return count - (-(e - s) // 10)
        if e - s > max_model_len:  # at least one byte per varint: count the last bytes
            count += len(view[s:e].tobytes().translate(None, _HIGH_BYTES))
        else:
            count += e - s
    return count


def _fields(view: memoryview, pos: int, end: int):
    """``(key, start, end)`` of each field in ``view[pos:end]`` (value bytes for a length-delimited
    field, empty otherwise); stops at the first malformed byte, leaving it to the parser."""
    while pos < end:
        key, pos = _varint(view, pos, end)
        if key < 0:
            return
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _varint(view, pos, end)
            if pos < 0:
                return
            yield key, pos, pos
        elif wire_type == 2:
            size, pos = _varint(view, pos, end)
            if size < 0 or pos + size > end:
                return
            yield key, pos, pos + size
            pos += size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            yield key, pos, pos
        else:
            return


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """``(value, position after it)``, or ``(-1, -1)`` if none ends before ``end``."""
    value = shift = 0
    while pos < end and shift < 64:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, -1
