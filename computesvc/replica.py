"""One compute replica's link to its node's cache service.

It attaches (retrying with backoff while the cache service is not up yet), checks that the
pool was made for this model, maps the pool, builds the model runner and the scheduler, keeps
the lease alive, and re-attaches when the cache service restarts (requests in flight then fail
with a retryable status; the replica itself carries on).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from kvtier.api_keys import ApiKeys
from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheCallError
from kvtier.computesvc.cache_port import CacheUnavailable
from kvtier.computesvc.config import ComputeConfig
from kvtier.computesvc.model import LoadedModel, ModelRunner, load_model
from kvtier.computesvc.observer import MetricsObserver, SchedulerObserver
from kvtier.computesvc.remote_cache import RemoteCache
from kvtier.computesvc.request import Request
from kvtier.computesvc.scheduler import Scheduler, SchedulerConfig
from kvtier.kv_dtypes import weights_dtype
from kvtier.model_spec import ModelShape
from kvtier.pool import PoolSpec, attach_pool

log = logging.getLogger("kvtier.compute")


class IncompatiblePool(RuntimeError):
    """The cache service's pool cannot serve this replica (another model or shape, or lower limits)."""


def check_pool_fits_model(spec: PoolSpec, shape: ModelShape) -> None:
    want = [shape.num_layers, 2, spec.block_size, shape.num_kv_heads, shape.head_dim]
    if list(spec.shape[1:]) != want:
        raise IncompatiblePool(
            f"the cache service's pool has shape {spec.shape} (blocks, layers, K/V, block_size, kv heads, "
            f"head_dim) but this model needs [*, {', '.join(map(str, want))}]: start the cache service "
            "with the same --model"
        )
    if spec.vocab_size and spec.vocab_size != shape.vocab_size:
        raise IncompatiblePool(f"pool vocab_size {spec.vocab_size} != model vocab_size {shape.vocab_size}")
    if spec.model_fingerprint and spec.model_fingerprint != shape.fingerprint:
        raise IncompatiblePool(
            f"pool model fingerprint {spec.model_fingerprint[:12]}… != this model's {shape.fingerprint[:12]}…"
        )


class Replica:
    def __init__(self, cfg: ComputeConfig, token: str, metrics=None):
        self.cfg = cfg
        self.token = token
        self.metrics = metrics
        self.shape = ModelShape.from_model_dir(cfg.model) if cfg.model else ModelShape.tiny(cfg.seed)
        self.loaded: LoadedModel | None = None
        self.client: CacheClient | None = None
        self.pool = None
        self.scheduler: Scheduler | None = None
        self.connected = asyncio.Event()
        # Told True when the replica (re-)attaches and False when it loses its cache service;
        # the service points it at its gRPC health status.
        self.on_attached_change: Callable[[bool], None] = lambda attached: None
        self._tasks: list[asyncio.Task] = []
        self._attach_sent_at = 0.0
        self._lease_valid_until = 0.0
        self._lost = asyncio.Event()  # set when the cache service is lost, cleared on re-attach
        self._retired: list = []  # pools of earlier attachments, closed, until they are unmapped
        self._unmapping: asyncio.Task | None = None

    # ------------------------------------------------------------ attach

    async def _attach(self, timeout_s: float, previous_lease_id: str = "") -> CacheClient:
        """Attach with exponential backoff until `timeout_s` passes; ConnectionError then.
        `previous_lease_id`: the lease this replica lost (it writes no more under it)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        while True:
            client = CacheClient.connect(
                self.cfg.cache, self.token, aio=True, tls_ca=self.cfg.tls_ca, timeout_s=10.0
            )
            try:
                self._attach_sent_at = time.monotonic()
                await client.attach(self.cfg.name, self.shape.fingerprint, previous_lease_id)
                return client
            except CacheCallError as e:
                await client.close()
                if e.code != "UNAVAILABLE":
                    if e.code == "FAILED_PRECONDITION":
                        raise IncompatiblePool(e.details) from None
                    raise ConnectionError(
                        f"cache service at {self.cfg.cache} refused Attach: {e.code}: {e.details}"
                    ) from None
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(
                        f"cannot reach the cache service at {self.cfg.cache} after {timeout_s:.0f}s "
                        f"({e.details}); is it running? (kvtier cache / python -m kvtier.cachesvc)"
                    ) from None
                log.warning("cache service at %s not reachable yet; retrying in %.1fs", self.cfg.cache, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def start(self) -> None:
        client = await self._attach(self.cfg.connect_timeout)
        try:
            check_pool_fits_model(client.pool, self.shape)
            if self.cfg.max_num_seqs > client.max_batch:
                raise IncompatiblePool(
                    f"--max-num-seqs {self.cfg.max_num_seqs} exceeds the cache service's --max-batch "
                    f"{client.max_batch}: one batched call would carry more sequences than it accepts"
                )
            device = self._device(client.pool)
            self.loaded = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: load_model(
                    self.cfg.model,
                    dtype=weights_dtype(client.pool.dtype, client.pool.backend, self.shape.dtype),
                    device=device,
                    seed=self.cfg.seed,
                    activation_reserve_bytes=self.cfg.activation_reserve_bytes(),
                ),
            )
        except BaseException:
            await client.close()
            raise
        self._adopt(client)
        self._tasks = [
            asyncio.ensure_future(self.scheduler.run_forever()),
            asyncio.ensure_future(self._keep_lease()),
        ]

    def _device(self, spec: PoolSpec) -> str:
        if spec.backend == "cuda":
            return "cuda"  # the pool's device: attach_pool picked it by UUID
        if self.cfg.device not in ("auto", "cpu"):
            raise IncompatiblePool(
                f"the pool is in host shared memory ({spec.backend}); run compute with --device cpu"
            )
        return "cpu"

    def _adopt(self, client: CacheClient) -> None:
        """Map the client's pool and point the scheduler at it."""
        self.client = client
        self._renewed(self._attach_sent_at)
        old, self.pool = self.pool, attach_pool(client.pool)
        runner = ModelRunner(self.loaded.model, self.pool.tensor, client.pool.block_size, self.pool.scales)
        runner.write_deadline = self._lease_deadline
        cache = RemoteCache(client, on_renewed=self._renewed)
        if self.scheduler is None:
            self.scheduler = Scheduler(
                runner,
                cache,
                self.loaded.tokenizer,
                self.loaded.eos_token_ids,
                SchedulerConfig(
                    max_num_seqs=self.cfg.max_num_seqs,
                    max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                    lookahead_blocks=self.cfg.lookahead_blocks,
                    admit_timeout_s=self.cfg.admit_timeout_s,
                    preemption_policy=self.cfg.preemption_policy,
                    tenant_quotas=ApiKeys.load(self.cfg.api_keys).quotas() if self.cfg.api_keys else {},
                ),
                observer=SchedulerObserver() if self.metrics is None else MetricsObserver(self.metrics),
            )
            self.scheduler.on_cache_lost = self._cache_lost
        else:
            self.scheduler.attach(runner, cache)
        if old is not None:
            self._retire(old)
        self._lost.clear()
        self.connected.set()
        self.on_attached_change(True)
        spec = client.pool
        log.info(
            "attached to %s: lease %s…, pool %s %s %s (%d blocks of %d tokens)",
            self.cfg.cache,
            client.lease_id[:8],
            spec.backend,
            spec.shm_name or spec.device_uuid,
            spec.dtype,
            spec.num_blocks,
            spec.block_size,
        )

    def _retire(self, pool) -> None:
        """Close the pool of an earlier attachment (after a re-attach) and see that it is unmapped.

        A dead cache service's pool must not stay mapped (on CUDA it pins the old allocation's
        device memory). Closing is safe at any time: the mapping goes only when no tensor view of it
        is left (kvtier.pool), so a step in flight keeps it until it ends. What keeps views longer
        is garbage: the traceback of a LeaseExpired raised mid-forward holds the forward's frames
        and their views of the pool, in reference cycles a collection pass frees.
        """
        pool.close()
        self._retired.append(pool)
        if self._unmapping is None or self._unmapping.done():
            self._unmapping = asyncio.ensure_future(self._collect_retired())

    async def _collect_retired(self, period_s: float = 0.5, give_up_s: float = 120.0) -> None:
        """Collect garbage until every retired pool is unmapped (a step in flight lets go of its
        views when it ends); warn if one is still mapped after `give_up_s`."""
        deadline = time.monotonic() + give_up_s
        while True:
            self._retired = [p for p in self._retired if p.mapped()]
            if not self._retired:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "%d pool(s) of an earlier cache service are still mapped after %.0fs: something holds "
                    "a tensor view of them",
                    len(self._retired),
                    give_up_s,
                )
                return
            gc.collect()
            if any(p.mapped() for p in self._retired):
                await asyncio.sleep(period_s)

    # ------------------------------------------------------------ lease and reconnect

    def _lease_deadline(self) -> float:
        return self._lease_valid_until

    def _renewed(self, sent_at: float) -> None:
        """The lease was renewed by a call sent at `sent_at` (a heartbeat, or any control call
        that succeeded). Called from the loop and from the lease keeper's thread.

        NOTE: counted from when the renewal was *sent*: the service's clock started later, so our
        deadline always falls before its expiry. A quarter TTL of margin covers the step in
        flight between checks. Two threads may race here; the later deadline normally wins, and
        losing a race only keeps a slightly earlier (still valid) deadline.
        """
        self._lease_valid_until = max(self._lease_valid_until, sent_at + 0.75 * self.client.lease_ttl_s)

    async def _keep_lease(self) -> None:
        """Renew the lease from a thread and channel of its own; re-attach when it is lost.

        NOTE: the replica's event loop can be busy for long stretches (a batch's sampling and
        detokenization, a prompt's tokenization, the garbage collector) and its cores are shared
        with the model's forward and other processes; a heartbeat scheduled on the loop then
        goes out late and the service expires a live replica's lease. Margins, with TTL the
        service's ``--lease-ttl``: a beat every TTL/3 with a deadline of TTL/2, one that ran past
        its deadline retried at once; KV writes only before ``sent + 0.75 TTL`` of the latest
        renewal (`_renewed`), read before each layer's write, so a renewal during a long step
        counts; every successful control call renews too.
        """
        loop = asyncio.get_running_loop()
        while True:
            client = self.client
            beats = CacheClient.connect(
                self.cfg.cache, self.token, tls_ca=self.cfg.tls_ca, timeout_s=client.lease_ttl_s / 2
            )
            beats.lease_id, beats.lease_ttl_s = client.lease_id, client.lease_ttl_s
            stop = beats.start_heartbeat_thread(
                self._renewed,
                lambda error, lease=client.lease_id: loop.call_soon_threadsafe(
                    self._heartbeat_lost, lease, error
                ),
                close_when_done=True,
            )
            try:
                await self._lost.wait()
            finally:
                stop.set()
            await self._reconnect()

    def _heartbeat_lost(self, lease_id: str, error: Exception) -> None:
        if self.client is None or self.client.lease_id != lease_id:
            # The heartbeat thread of a lease already given up (its last beat was in flight when
            # the replica re-attached): the replica holds a new lease, which is not lost.
            return
        self._cache_lost(CacheUnavailable(f"lost the cache service at {self.cfg.cache} ({error})"))

    def _cache_lost(self, error: Exception) -> None:
        # The requests this fails keep `error`; its traceback (a LeaseExpired's: the forward's
        # frames) would keep their views of the pool, and so its mapping, alive with them.
        error.__traceback__ = None
        if self.connected.is_set():
            log.error("lost the cache service (%s): failing in-flight requests and re-attaching", error)
            self.connected.clear()
            self._lost.set()
            self._lease_valid_until = 0.0  # no KV write under a lease we no longer hold
            self.on_attached_change(False)
            self.scheduler.fail_all(error)

    async def _reconnect(self) -> None:
        old = self.client
        # Fencing: once no step is running, no KV write under the old lease is in flight or can
        # start (its deadline is 0), so naming it lets the cache service free its fenced blocks
        # at once instead of after --fence-hold-s.
        await self.scheduler.out_of_step()
        while True:
            try:
                client = await self._attach(timeout_s=3600.0, previous_lease_id=old.lease_id)
                check_pool_fits_model(client.pool, self.shape)
                break
            except (ConnectionError, IncompatiblePool) as e:
                log.error("re-attach failed: %s", e)
                await asyncio.sleep(1.0)
        await old.close()
        self._adopt(client)

    def submit(self, request: Request) -> None:
        if not self.connected.is_set():
            raise CacheUnavailable(f"not attached to the cache service at {self.cfg.cache}; retry shortly")
        self.scheduler.add(request)

    async def stop(self) -> None:
        for task in [*self._tasks, *([self._unmapping] if self._unmapping else [])]:
            task.cancel()
        if self.client is not None:
            await self.client.close()
        if self.pool is not None:
            self.pool.close()
