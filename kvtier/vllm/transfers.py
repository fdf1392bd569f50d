"""What the worker side moves: a hit to load into vLLM's blocks, new full blocks to save into the pool.

Plain data with no vLLM import, so the copies can be driven (and tested on a GPU) without vLLM;
``plan`` carries them in vLLM's per-step connector metadata. Units: tokens unless a name says
blocks; block ids are vLLM's (``vllm_block_ids``) or the pool's (``pool_block_ids``), in token order.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.pool import PoolSpec


def pool_name(spec: PoolSpec) -> str:
    """What names one pool allocation: its shared-memory segment, or its CUDA IPC handle."""
    return spec.shm_name or spec.cuda_ipc_handle.hex()


@dataclass
class LoadItem:
    """Copy a request's hit from pool blocks into its vLLM blocks, before this step's forward."""

    req_id: str
    pool_name: str  # the pool the hit is in (``pool_name``)
    pool_block_ids: list[int]
    vllm_block_ids: list[int]
    valid_until: float  # time.monotonic() deadline of the lease that pins the pool blocks; 0 = not pinned


@dataclass
class SaveItem:
    """A request's full prompt blocks computed by now, to be copied from vLLM's blocks into the pool
    blocks the scheduler side allocated for them (it publishes them once the worker reports them)."""

    req_id: str
    pool_name: str  # the pool the blocks are in (``pool_name``)
    pool_block_ids: list[int]
    vllm_block_ids: list[int]
    end_block: int  # the prompt's leading blocks in the pool once this is written
    write_by: float  # time.monotonic(): written only before this (the pool blocks' lease, less a margin)
