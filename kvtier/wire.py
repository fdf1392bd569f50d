"""Conversions between the shared plain types and their protobuf messages.

Domain code (the block manager, the sequence table, the scheduler, the pool backends) never
builds a protobuf; a servicer or a client converts at the wire with the functions here. The
replies' conversions serve ``kvtier.cache_client``, which hands its callers only
``kvtier.sequence_types``' values.
"""

from __future__ import annotations

from dataclasses import fields

from kvtier.api import cache_pb2
from kvtier.block_hash import BlockHash
from kvtier.pool import PoolSpec
from kvtier.sequence_types import (
    BlockRemoved,
    BlockStored,
    CacheEvent,
    CacheSnapshot,
    LeaseGrant,
    LeaseSnapshot,
    PrefixHit,
    SequenceBlocks,
    TenantSnapshot,
    TierSnapshot,
)


def pool_spec_to_proto(spec: PoolSpec) -> cache_pb2.PoolSpec:
    return cache_pb2.PoolSpec(
        backend=spec.backend,
        shm_name=spec.shm_name,
        cuda_ipc_handle=spec.cuda_ipc_handle,
        device_uuid=spec.device_uuid,
        dtype=spec.dtype,
        shape=spec.shape,
        strides=spec.strides,
        size_bytes=spec.size_bytes,
        block_size=spec.block_size,
        model_fingerprint=spec.model_fingerprint,
        vocab_size=spec.vocab_size,
        max_model_len=spec.max_model_len,
    )


def pool_spec_from_proto(msg: cache_pb2.PoolSpec) -> PoolSpec:
    return PoolSpec(
        backend=msg.backend,
        dtype=msg.dtype,
        shape=list(msg.shape),
        strides=list(msg.strides),
        size_bytes=msg.size_bytes,
        block_size=msg.block_size,
        shm_name=msg.shm_name,
        cuda_ipc_handle=bytes(msg.cuda_ipc_handle),
        device_uuid=msg.device_uuid,
        model_fingerprint=msg.model_fingerprint,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
    )


# ---------------------------------------------------------------- replies (the client's side)


def sequence_blocks(messages) -> list[SequenceBlocks]:
    """The SequenceBlocks of a reply's repeated ``sequences`` field, every field kept."""
    return [
        SequenceBlocks(m.sequence_id, list(m.block_table), m.num_cached_tokens, m.num_slots) for m in messages
    ]


def lease_grant(reply: cache_pb2.AttachResponse) -> LeaseGrant:
    return LeaseGrant(reply.lease_id, reply.lease_ttl_s, pool_spec_from_proto(reply.pool), reply.max_batch)


def prefix_hits(reply: cache_pb2.LookupPrefixResponse) -> list[PrefixHit]:
    """One PrefixHit per item of the request, the media below the device as the reply names them."""
    if reply.below:
        rows = [(row.medium, row.num_tokens) for row in reply.below]
    else:  # a cache from before the media table: host and disk in fields of their own
        rows = [(m, t) for m, t in (("host", reply.num_host_tokens), ("disk", reply.num_disk_tokens)) if t]
    return [PrefixHit(n, {m: t[k] for m, t in rows}) for k, n in enumerate(reply.num_cached_tokens)]


def _plain(message, cls):
    """A dataclass of ``cls`` from the message fields of the same names."""
    return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


def stats_from_proto(reply: cache_pb2.GetStatsResponse) -> CacheSnapshot:
    nested = {"leases": LeaseSnapshot, "tenants": TenantSnapshot, "tiers": TierSnapshot}
    values = {
        f.name: [_plain(m, nested[f.name]) for m in getattr(reply, f.name)]
        if f.name in nested
        else getattr(reply, f.name)
        for f in fields(CacheSnapshot)
    }
    return CacheSnapshot(**values)


def event_from_proto(message: cache_pb2.CacheEvent) -> CacheEvent | None:
    """The CacheEvent of a WatchEvents message; None for a kind this client does not know."""
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        e = message.block_stored
        stored = BlockStored(
            BlockHash(e.block_hash),
            BlockHash(e.parent_block_hash) if e.parent_block_hash else None,
            e.block_id,
            list(e.token_ids),
            e.medium or "device",  # "": a cache from before the tiers
        )
        return CacheEvent(message.event_id, stored)
    if kind == "block_removed":
        e = message.block_removed
        return CacheEvent(
            message.event_id, BlockRemoved(BlockHash(e.block_hash), e.block_id, e.medium or "device")
        )
    return None
