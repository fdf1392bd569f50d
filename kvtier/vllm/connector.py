"""``KvtierConnector``: vLLM's KV connector over kvtier's cache service.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"cache_address": "unix:///run/kvtier/cache.sock"}}'

vLLM makes one instance per role: the scheduler's (``kvtier.vllm.saving`` for an engine that saves,
``kvtier.vllm.lookups`` for one that only loads: which leading blocks the cache holds, and per
step which blocks to load and save) and each worker's (``kvtier.vllm.worker``: the copies between
the pool and vLLM's KV cache). Each holds its own lease
on the cache service. This class only routes vLLM's calls to them; the settings are
``kvtier.vllm.config``'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.model_executor.models.utils import extract_layer_index

from kvtier.vllm import LOGGER
from kvtier.vllm.block_layout import BlockCopier, probe_layout
from kvtier.vllm.cache_link import CacheLink
from kvtier.vllm.config import ConnectorConfig
from kvtier.vllm.engine_check import IncompatiblePool, check_engine_fits_pool, engine_kv, pool_kv
from kvtier.vllm.lookups import Lookups
from kvtier.vllm.plan import KvtierMetadata, KvtierWorkerMeta
from kvtier.vllm.saving import SavingSide
from kvtier.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)

__all__ = ["IncompatiblePool", "KvtierConnector", "KvtierMetadata", "KvtierWorkerMeta"]


class KvtierConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.parallel_config.world_size > 1:
            raise IncompatiblePool(
                "kvtier connector: one worker per engine only (tensor and pipeline parallel size 1): the pool "
                f"holds every KV head of a layer; this engine has world_size {vllm_config.parallel_config.world_size}"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.lookups: Lookups | SavingSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvtier connector: kv_load_failure_policy is %r: a hit that cannot be loaded (its lease "
                    "lapsed, the cache restarted) fails the request instead of being recomputed; set "
                    '"kv_load_failure_policy": "recompute"',
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            if self._kv_transfer_config.is_kv_producer and not getattr(vllm_config, "shutdown_timeout", 1):
                log.info(
                    "kvtier connector: vLLM's --shutdown-timeout is 0 (abort: its engine core is killed at once): "
                    "saves written in the engine's last save_batch_ms (%g ms) are then not published (their "
                    "blocks go with the engine's lease) and this side's counts are not logged; "
                    "--shutdown-timeout 5 lets them out",
                    self.cfg.save_batch_ms,
                )
            self.link = CacheLink(self.cfg, "scheduler")
            self.link.check = self._check_scheduler_pool
            client = self.link.start()
            self._first_pool = pool_kv(client.pool)
            max_model_len = min(client.pool.max_model_len or 1 << 62, vllm_config.model_config.max_model_len)
            self.lookups = scheduler_side(
                self._kv_transfer_config, self.cfg, self.link, self.block_size, max_model_len
            )
        else:
            self.link = CacheLink(self.cfg, "worker")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost request

    # ============================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach, refuse a pool that does not match this engine, learn vLLM's block layout."""
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise IncompatiblePool(
                f"kvtier connector: models with one KV cache group only (full attention in every layer); "
                f"this one has {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        names = sorted(kv_caches, key=extract_layer_index)
        engine = engine_kv(self._vllm_config, spec, len(names))
        model = self._vllm_config.model_config.model
        self.link.check = lambda pool: check_engine_fits_pool(engine, pool, self.cfg.cache_address, model)
        client = self.link.start()
        layers = self._vllm_config.compilation_config.static_forward_context
        geometry = (spec.block_size, spec.num_kv_heads, spec.head_size)
        gathers = [probe_layout(layers[name], kv_caches[name], *geometry) for name in names]
        copier = BlockCopier([kv_caches[name] for name in names], gathers, (2, *geometry))
        self.worker = WorkerSide(copier)
        self.worker.map_pool(client)
        self.link.on_attached.append(self.worker.map_pool)
        log.info(
            "kvtier connector: %d layers, block layout %s, %s, pool %s",
            len(names),
            "as kvtier's"
            if all(g is None for g in copier.gathers)
            else "permuted (learned from the backend)",
            "one view spans the layers (one allocation)" if copier.layer_stride else "a copy per layer",
            client.pool.shm_name or client.pool.device_uuid,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and meta.loads:
            self.worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, copied in start_load_kv before the step's forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves are whole blocks, taken once the step has computed every layer (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and meta.saves:
            self.worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves are synchronous (done in the step): vLLM's blocks are never held

    def build_connector_worker_meta(self) -> KvtierWorkerMeta | None:
        if self.worker is None:
            return None
        loads, saves = self.worker.take_finished_loads(), self.worker.take_saves_done()
        return KvtierWorkerMeta(loads, saves) if loads or saves else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.lookups is not None:
            self.lookups.close()
        self.link.close()

    # ============================================================ scheduler side

    def _check_scheduler_pool(self, spec) -> None:
        """A pool after a re-attach must be the kind the worker checked at startup (the same model)."""
        pool = pool_kv(spec)
        first = getattr(self, "_first_pool", None)
        if pool.block_size != self.block_size:
            raise IncompatiblePool(
                f"kvtier connector: vLLM's block size {self.block_size} != the pool's {pool.block_size} "
                f"(start the cache service with --block-size {self.block_size})"
            )
        if first is not None and pool != first:
            raise IncompatiblePool(
                f"kvtier connector: the cache service came back with another pool: {pool} != {first}"
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.lookups.num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.lookups.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.lookups.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        return self.lookups.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMeta):
            self.lookups.update_connector_output(meta.loads_done, meta.saves_done)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the request's blocks at once: saves were written in the steps that ran it."""
        self.lookups.request_finished(request)
        return False, None


def scheduler_side(role, cfg: ConnectorConfig, link: CacheLink, block_size: int, max_model_len: int):
    """The scheduler side for vLLM's ``kv_role`` (``role``: its KVTransferConfig)."""
    wait_s = cfg.lookup_wait_ms / 1e3
    if not role.is_kv_producer:  # kv_consumer: loads only
        return Lookups(link, block_size, max_model_len, wait_s, block_index=cfg.block_index)
    return SavingSide(link, block_size, max_model_len, wait_s, loads=role.is_kv_consumer, block_index=cfg.block_index,
                      max_reserved_share=cfg.max_reserved_share, batch_s=cfg.save_batch_ms / 1e3)  # fmt: skip
