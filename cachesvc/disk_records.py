"""The on-disk record of one KV block: what the disk tier writes, and the checks before it serves one.

One record is one file, named by the block's hash (``<sha256 hex>.kvb``)::

    head      20 bytes  magic b"KVTBLK03", meta length (u32 LE), payload length (u64 LE)
    meta      msgpack   {"model", "block_size", "dtype", "shape", "block_bytes", "parent", "key", "tenant"}
    payload   the block's bytes, as the pool holds them (``shape`` of ``dtype``, row-major)
    checksum  32 bytes  blake3 (256 bits) over head + meta + payload (``checksum``)

``key`` is the block's prefix-index key (its hash preimage, ``parent-or-extra || token ids as
LE int32``; see ``kvtier.block_hash``), so the token ids are ``key[32:]``; ``parent`` is the
previous block's hash, empty for a sequence's first block. ``tenant`` is whose block it is
(kvtier's tenant name, "" the default), so what the disk passes down to the shared tier, even
after a restart, is stored as that tenant's; it is a fixed ``TENANT_FIELD_BYTES`` bytes (the name's
UTF-8 length as u16 LE, the name, zeros), so every record of a layout has one of two sizes
(``disk_scan.record_sizes``). A record is served only if all of
these hold (``decode``): the length adds up (a torn or truncated write fails here), the
checksum matches (a flipped byte), the header is this pool's (model fingerprint, block size,
dtype, shape: another model's record never hits even if its key collided), the key is the one
asked for and ``sha256(key)`` is the name of the file (a record renamed or copied over another).

Version 02 checksums with blake3 (issue 31.6: blake2b's 0.1-0.3 ms per 128 KiB block was most of
the disk writer's time per record once records are made durable in groups; blake3 takes about an
eighth). Version 03 adds the tenant. An older record (01: blake2b; 02: no tenant) fails the
magic check and is dropped at the next start, as any record this service cannot serve is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import msgpack

from kvtier import kv_dtypes
from kvtier.block_hash import hash_preimage

MAGIC = b"KVTBLK03"
SUFFIX = ".kvb"
HEAD = struct.Struct("<8sIQ")
CHECKSUM_BYTES = 32
KEY_PREFIX_BYTES = 32  # the parent hash, or the extra key of a sequence's first block
MAX_META_BYTES = 64 * 1024  # a header larger than this is not ours (keys are 32 + 4 * block_size)
MAX_TENANT_BYTES = 256  # a tenant name's UTF-8 bytes (the cache service's bound on names, MAX_NAME_BYTES)
TENANT = struct.Struct("<H")  # the tenant field's length prefix
TENANT_FIELD_BYTES = TENANT.size + MAX_TENANT_BYTES


class BadRecord(ValueError):
    """A record that must not be served; the message says which check failed."""


@dataclass(frozen=True)
class RecordLayout:
    """What a record must say about itself to be served by this pool.

    ``shape`` is one pool block (``[num_layers, 2, block_size, num_kv_heads, head_dim]``),
    ``dtype`` the pool's dtype name (``kvtier.kv_dtypes``), ``block_bytes`` the bytes of one
    block as the pool holds it (``PoolSpec.block_bytes``: a quantized block's scales included).
    """

    model_fingerprint: str
    block_size: int
    dtype: str
    shape: tuple[int, ...]
    block_bytes: int

    def __post_init__(self) -> None:
        kv_dtypes.lookup(self.dtype, "record dtype")
        if self.block_size <= 0 or self.block_bytes <= 0 or not self.shape or min(self.shape) <= 0:
            raise ValueError(
                f"record block_size {self.block_size} / shape {self.shape} / block_bytes {self.block_bytes} "
                "must be positive"
            )

    def meta(self, key: bytes, parent: bytes, tenant: str = "") -> dict:
        return {
            "model": self.model_fingerprint,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "block_bytes": self.block_bytes,
            "parent": parent,
            "key": key,
            "tenant": tenant_field(tenant),
        }


def tenant_field(tenant: str) -> bytes:
    """``tenant`` as the record's fixed-size field; ValueError for a name over MAX_TENANT_BYTES."""
    name = tenant.encode()
    if len(name) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant name of {len(name)} bytes; a record holds at most {MAX_TENANT_BYTES}")
    return TENANT.pack(len(name)) + name.ljust(MAX_TENANT_BYTES, b"\0")


def _tenant_of(field: bytes) -> str:
    """The tenant a record's field names; ValueError unless it is one ``tenant_field`` makes."""
    if len(field) != TENANT_FIELD_BYTES:
        raise ValueError(f"tenant field of {len(field)} bytes, not {TENANT_FIELD_BYTES}")
    (n,) = TENANT.unpack_from(field)
    name = field[TENANT.size : TENANT.size + n]
    if n > MAX_TENANT_BYTES or field[TENANT.size + n :].count(0) != MAX_TENANT_BYTES - n:
        raise ValueError("tenant field is not a length, a name and zeros")
    return name.decode()  # strict: a UnicodeDecodeError is a ValueError


def file_name(key: bytes) -> str:
    """The record file of the block whose index key is ``key``: its hash in hex plus ``.kvb``."""
    return hash_preimage(key).hex() + SUFFIX


def check_key(layout: RecordLayout, key: bytes, parent: bytes | None) -> None:
    """ValueError unless ``key`` is a block key of this layout and ``parent`` agrees with it."""
    want = KEY_PREFIX_BYTES + 4 * layout.block_size
    if len(key) != want:
        raise ValueError(f"block key of {len(key)} bytes; a block of {layout.block_size} tokens has {want}")
    if parent and key[:KEY_PREFIX_BYTES] != parent:
        raise ValueError(f"parent hash {parent.hex()[:16]} is not the first 32 bytes of the key")


def encode(layout: RecordLayout, key: bytes, parent: bytes | None, payload, tenant: str = "") -> list[bytes]:
    """The record as buffers to write in order (head + meta, payload, checksum).

    ``payload`` is a bytes-like object of exactly ``layout.block_bytes`` bytes; it is not copied.
    ``tenant``: whose block it is ("" the default).
    """
    payload = memoryview(payload).cast("B")
    if payload.nbytes != layout.block_bytes:
        raise ValueError(f"payload of {payload.nbytes} bytes; this layout's block is {layout.block_bytes}")
    check_key(layout, key, parent)
    meta = msgpack.packb(layout.meta(key, parent or b"", tenant), use_bin_type=True)
    head = HEAD.pack(MAGIC, len(meta), payload.nbytes) + meta
    digest = checksum(head)
    digest.update(payload)
    return [head, payload, digest.digest()]


def checksum(data=b"") -> blake3.blake3:
    """A record's checksum over ``data`` so far: ``.update(more)``, then ``.digest()`` (CHECKSUM_BYTES)."""
    return blake3.blake3(data)


def record_bytes(layout: RecordLayout, key_len: int) -> int:
    """Size of a record file for a key of ``key_len`` bytes (for the disk budget)."""
    meta = msgpack.packb(layout.meta(bytes(key_len), bytes(KEY_PREFIX_BYTES)), use_bin_type=True)
    return HEAD.size + len(meta) + layout.block_bytes + CHECKSUM_BYTES


def decode(
    layout: RecordLayout, data: bytes | bytearray, name: str, key: bytes | None = None, *, with_tenant=False
):
    """``(key, payload)`` of the whole record ``data`` read from file ``name``, or BadRecord;
    ``with_tenant``: ``(key, payload, tenant)``.

    ``key``, if given, is the key the caller looks up; the record must carry exactly it.
    The checksum is checked before the header is trusted. The payload is a view into ``data``.
    """
    meta_len, payload_len, total = _lengths(data, len(data))
    body = memoryview(data)[: total - CHECKSUM_BYTES]
    if checksum(body).digest() != data[total - CHECKSUM_BYTES :]:
        raise BadRecord("checksum mismatch (the bytes changed after they were written)")
    record_key, tenant = _meta_key(layout, data, meta_len, payload_len, name, key)
    payload = body[HEAD.size + meta_len :]
    return (record_key, payload, tenant) if with_tenant else (record_key, payload)


def decode_head(layout: RecordLayout, head: bytes, size: int, name: str, *, with_tenant=False):
    """The key of the record whose first bytes are ``head`` and whose file has ``size`` bytes
    (``with_tenant``: ``(key, tenant)``), after every check but the checksum (a fast scan;
    ``decode`` checks it when the record is read); BadRecord otherwise. ``head`` holds at least
    ``head_bytes_needed(head)`` bytes."""
    meta_len, payload_len, _ = _lengths(head, size)
    key, tenant = _meta_key(layout, head, meta_len, payload_len, name, None)
    return (key, tenant) if with_tenant else key


def head_bytes_needed(head: bytes) -> int:
    """How many leading bytes of a record ``decode_head`` reads (from its first ``HEAD.size``)."""
    return HEAD.size + (HEAD.unpack_from(head)[1] if len(head) >= HEAD.size else 0)


def _lengths(data: bytes | bytearray, size: int) -> tuple[int, int, int]:
    """``(meta_len, payload_len, total)`` from the record's head, checked against its ``size``."""
    if size < HEAD.size + CHECKSUM_BYTES:
        raise BadRecord(f"{size} bytes, shorter than an empty record (torn write?)")
    magic, meta_len, payload_len = HEAD.unpack_from(data)
    if magic != MAGIC:
        older = magic[:6] == MAGIC[:6] and magic < MAGIC
        raise BadRecord(
            f"magic {magic!r} is not {MAGIC!r}" + (" (an earlier kvtier's format)" if older else "")
        )
    if meta_len > MAX_META_BYTES:
        raise BadRecord(f"meta length {meta_len} > {MAX_META_BYTES}")
    total = HEAD.size + meta_len + payload_len + CHECKSUM_BYTES
    if size != total:
        raise BadRecord(f"{size} bytes but its head says {total} (torn or truncated write)")
    return meta_len, payload_len, total


def _meta_key(
    layout: RecordLayout,
    data: bytes | bytearray,
    meta_len: int,
    payload_len: int,
    name: str,
    key: bytes | None,
) -> tuple[bytes, str]:
    """The record's key and tenant, after checking its meta is this layout's and its key the file's name."""
    try:
        meta = msgpack.unpackb(bytes(data[HEAD.size : HEAD.size + meta_len]), raw=False)
        record_key, parent = bytes(meta["key"]), bytes(meta["parent"])
        tenant = _tenant_of(bytes(meta["tenant"]))
        theirs = RecordLayout(
            meta["model"], meta["block_size"], meta["dtype"], tuple(meta["shape"]), meta["block_bytes"]
        )
    except (ValueError, KeyError, TypeError) as e:
        raise BadRecord(f"unreadable header: {e}") from None
    if theirs != layout:
        raise BadRecord(f"written for another pool ({_differs(theirs, layout)})")
    if payload_len != layout.block_bytes:
        raise BadRecord(f"payload of {payload_len} bytes; this layout's block is {layout.block_bytes}")
    try:
        check_key(layout, record_key, parent)
    except ValueError as e:
        raise BadRecord(str(e)) from None
    if key is not None and record_key != key:
        raise BadRecord("carries another block's key")
    if file_name(record_key) != name:
        raise BadRecord(f"its key hashes to {file_name(record_key)}, not its file name")
    return record_key, tenant


def _differs(theirs: RecordLayout, ours: RecordLayout) -> str:
    """Which layout fields differ, e.g. ``block_size 32 != 16``."""
    fields = ("model_fingerprint", "block_size", "dtype", "shape", "block_bytes")
    return ", ".join(
        f"{f} {getattr(theirs, f)!r} != {getattr(ours, f)!r}"
        for f in fields
        if getattr(theirs, f) != getattr(ours, f)
    )
