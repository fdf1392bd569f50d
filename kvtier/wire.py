"""Conversions between the shared plain types and their protobuf messages.

Domain code (the block manager, the sequence table, the scheduler, the pool backends) never
builds a protobuf; a servicer or a client converts at the wire with the functions here.
"""

from __future__ import annotations

from kvtier.api import cache_pb2
from kvtier.pool import PoolSpec


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
