"""A block as an object in Mooncake Store: its name (the block's full identity) and its bytes
(a disk record, checked on read); ``cachesvc.shared_tier`` stores and loads them."""

from __future__ import annotations

import hashlib
import warnings

from kvtier.cachesvc.disk_records import (
    CHECKSUM_BYTES,
    KEY_PREFIX_BYTES,
    BadRecord,
    RecordLayout,
    checksum,
    decode,
    decode_head,
    encode,
    file_name,
)

OBJECT_PREFIX = "kvtier"


def object_name(layout: RecordLayout, key: bytes) -> str:
    """The store's name for the block whose prefix-index key is ``key`` in a pool of ``layout``."""
    digest = hashlib.sha256()
    for part in (
        layout.model_fingerprint,
        str(layout.block_size),
        layout.dtype,
        ",".join(map(str, layout.shape)),
        str(layout.block_bytes),
    ):
        digest.update(part.encode() + b"\0")
    digest.update(key)
    return f"{OBJECT_PREFIX}/{layout.model_fingerprint[:16]}/{digest.hexdigest()}"


def encode_object(layout: RecordLayout, key: bytes, payload) -> list[bytes]:
    """The object's parts (head + meta, payload, checksum), the payload copied (the pool row may
    be overwritten once the caller returns)."""
    head, body, checksum = encode(layout, key, key[:KEY_PREFIX_BYTES], payload)
    return [head, bytes(body), checksum]


def check_parts(layout: RecordLayout, key: bytes, scratch, head: int, row) -> None:
    """The checks of ``decode_object`` on an object landed in parts: its ``head`` bytes of header
    and meta and its checksum in ``scratch`` (uint8, ``head + 32``), its payload in ``row``."""
    body = memoryview(scratch)[:head]
    digest = checksum(body)
    digest.update(memoryview(row.numpy()))
    if digest.digest() != bytes(scratch[head:]):
        raise BadRecord("checksum mismatch (the bytes changed after they were written)")
    if decode_head(layout, bytes(body), head + layout.block_bytes + CHECKSUM_BYTES, file_name(key)) != key:
        raise BadRecord("carries another block's key")


def decode_object(layout: RecordLayout, key: bytes, data: bytes) -> memoryview:
    """The payload of object ``data`` fetched for ``key``, after every check; BadRecord otherwise."""
    return decode(layout, data, file_name(key), key)[1]


def row_bytes(row) -> memoryview:
    """One row (``[block_bytes]`` uint8 tensor) as a memoryview (a device row copied to the host)."""
    return memoryview((row.cpu() if row.is_cuda else row).numpy())


def copy_into(row, payload: memoryview) -> None:
    """Copy a checked payload into one row (a uint8 tensor, host or device)."""
    import numpy as np

    if not row.is_cuda:
        row.numpy()[:] = np.frombuffer(payload, np.uint8)
        return
    import torch

    with warnings.catch_warnings():  # the fetched object is read-only bytes; it is only read
        warnings.simplefilter("ignore", UserWarning)
        row.copy_(torch.frombuffer(payload, dtype=torch.uint8))
