"""The per-step metadata the scheduler side hands the worker side (and the worker's answer).

Everything here is plain data (pickled by vLLM from the scheduler process to the workers).
Units: tokens unless a name says blocks; block ids are vLLM's (``vllm_block_ids``) or the pool's
(``pool_block_ids``), in token order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.vllm.transfers import LoadItem, SaveItem


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


@dataclass
class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    """The worker's answer for one step: the requests whose loads it is done with (copied or
    failed), so the scheduler side can free the pool sequences that pinned their hits, and each
    save of the step, in order: (request id, its ``end_block``, written or not), so it publishes
    the written blocks."""

    loads_done: set[str] = field(default_factory=set)
    saves_done: list[tuple[str, int, bool]] = field(default_factory=list)

    def aggregate(self, other: KvtierWorkerMeta) -> KvtierWorkerMeta:
        return KvtierWorkerMeta(self.loads_done | other.loads_done, self.saves_done + other.saves_done)
