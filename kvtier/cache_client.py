"""Typed, batched client of the cache service: every caller's one face of it (the compute
replica, vLLM's connector, the router, the CLI, benchmarks and tests).

It takes and returns `kvtier.sequence_types`' values and raises `kvtier.cache_errors`' exceptions;
no caller reads a protobuf message or a gRPC status. One class serves both gRPC flavours: on a
sync channel a method returns its value, on an aio channel an awaitable of it:

    client = CacheClient.connect("unix:///tmp/kvtier-0/cache.sock")            # sync
    seqs = client.allocate([[1, 2, 3], AllocateItem([1, 2, 4], tenant_salt="tenant-b")])

    client = CacheClient.connect(address, aio=True)                              # asyncio
    seqs = await client.allocate([[1, 2, 3]])                                    # list[SequenceBlocks]

Requests carry the shared token as call metadata and the lease opened by `attach()`. Plain tuples
work for Extend and Commit items. This module and `kvtier.wire` are the client side's one place
that turns values into protobuf and back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from grpc.experimental import ChannelOptions

from kvtier import auth, telemetry
from kvtier.api import cache_pb2, cache_pb2_grpc
from kvtier.cache_errors import CacheCallError
from kvtier.cache_streams import EventBatchStream, EventStream, call_error
from kvtier.grpc_server import MAX_MESSAGE_BYTES
from kvtier.pool import PoolSpec
from kvtier.sequence_types import (
    AllocateItem,
    CacheSnapshot,
    CommitItem,
    ExtendItem,
    LeaseGrant,
    PrefixHit,
    ReleaseItem,
    SequenceBlocks,
    SwapResult,
)
from kvtier.wire import lease_grant, prefix_hits, sequence_blocks, stats_from_proto

log = logging.getLogger("kvtier.client")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted cache service is reached again within ~1 s however long it was away (gRPC's
    # default backoff grows to 120 s: 14 s to notice a cache back after a 66 s outage).
    # NOTE: not grpc.min_reconnect_backoff_ms: gRPC reads it as the minimum connect timeout (20 s
    # by default), so 100 ms there failed a new connection to a service that took longer to send
    # its HTTP/2 SETTINGS (a stall, a loaded machine): "connection attempt timed out before
    # receiving SETTINGS frame". Backoff starts at initial_reconnect_backoff_ms without it.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A heartbeat that failed is tried again this soon (seconds), until its lease would have run out.
HEARTBEAT_RETRY_S = 0.1


def allocate_fields(item: AllocateItem) -> dict:
    """The fields of an AllocateItem message that differ from its defaults (see the NOTE on
    filling requests)."""
    fields = {"token_ids": item.token_ids}
    if item.tenant_salt:
        fields["tenant_salt"] = item.tenant_salt
    if item.adapter_id:
        fields["adapter_id"] = item.adapter_id
    if item.num_lookahead_tokens:
        fields["num_lookahead_tokens"] = item.num_lookahead_tokens
    if item.request_id:
        fields["request_id"] = item.request_id
    if item.tenant:
        fields["tenant"] = item.tenant
    return fields


T = TypeVar("T")
Reply = T | Awaitable[T]  # the value on a sync channel, an awaitable of it on an aio one


async def _answer(call, convert: Callable[[object], T]) -> T:
    """An aio call's reply, converted; its failure as `call_error` says."""
    try:
        return convert(await call)
    except grpc.RpcError as e:
        raise call_error(e) from None


# Sync channels only: a unary-stream call (WatchEvents) is read on the thread that iterates it,
# not handed over message by message from the channel's spin thread. A block-index follower
# reads one message per block event; without it each cost a thread handoff (the follower's CPU
# per saved request ~30-50% lower with it, bench/cache_cpu.py --follower). cancel() from another
# thread still ends the iteration (tests/test_cache_service.py).
SYNC_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, (ChannelOptions.SingleThreadedUnaryStream, 1)]


def open_channel(address: str, *, aio: bool = False, tls_ca: str | None = None):
    """A channel to `address` (unix:///path, tcp://host:port or host:port), traced when tracing is on."""
    target = auth.grpc_target(address)
    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    if aio:
        return telemetry.aio_channel(target, options=CHANNEL_OPTIONS, credentials=creds)
    return telemetry.sync_channel(target, options=SYNC_CHANNEL_OPTIONS, credentials=creds)


class CacheClient:
    def __init__(self, channel, token: str, timeout_s: float = 30.0):
        self.channel = channel
        self.aio = isinstance(channel, grpc.aio.Channel)
        self.stub = cache_pb2_grpc.CacheServiceStub(channel)
        self.metadata = auth.bearer(token)
        self.timeout_s = timeout_s
        self.lease_id = ""
        self.lease_ttl_s = 0.0
        self.max_batch = 0
        self.pool: PoolSpec | None = None

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        token: str | None = None,
        *,
        aio: bool = False,
        tls_ca: str | None = None,
        timeout_s: float = 30.0,
    ) -> CacheClient:
        address = address or auth.default_cache_address()
        token = token if token is not None else auth.load_token()
        if token is None:
            raise RuntimeError(
                "no cache service token: set $KVTIER_TOKEN or $KVTIER_TOKEN_FILE, or run on the "
                f"cache service's host where it writes {auth.default_token_file()}"
            )
        return cls(open_channel(address, aio=aio, tls_ca=tls_ca), token, timeout_s)

    def close(self):
        return self.channel.close()

    def _call(self, method, request, convert: Callable[[object], T]) -> Reply[T]:
        """Send `request`; its reply through `convert`, or a `call_error`.

        NOTE: on an aio channel the stub's call starts here, before the caller awaits (the
        replica's lease renewal counts from then); `_answer` only waits for it.
        """
        # The requests this call serves, when the caller traces them (telemetry.for_requests).
        metadata = telemetry.request_metadata(self.metadata)
        if self.aio:
            return _answer(method(request, metadata=metadata, timeout=self.timeout_s), convert)
        try:
            return convert(method(request, metadata=metadata, timeout=self.timeout_s))
        except grpc.RpcError as e:
            raise call_error(e) from None

    # ------------------------------------------------------------ leases

    def attach(
        self, client_name: str, model_fingerprint: str = "", previous_lease_id: str = ""
    ) -> Reply[LeaseGrant]:
        """Open a lease and remember it and the pool spec (`lease_id`, `lease_ttl_s`, `max_batch`,
        `pool`). `previous_lease_id`: the lease this client lost, named only once no KV write
        under it is in flight (its fenced blocks are then released at once)."""
        request = cache_pb2.AttachRequest(
            client_name=client_name, model_fingerprint=model_fingerprint, previous_lease_id=previous_lease_id
        )
        return self._call(self.stub.Attach, request, self._adopt)

    def _adopt(self, reply: cache_pb2.AttachResponse) -> LeaseGrant:
        grant = lease_grant(reply)
        self.lease_id, self.lease_ttl_s, self.pool, self.max_batch = grant
        return grant

    def heartbeat(self) -> Reply[float]:
        """Renew the lease; the seconds it now has."""
        request = cache_pb2.HeartbeatRequest(lease_id=self.lease_id)
        return self._call(self.stub.Heartbeat, request, _lease_ttl_s)

    def start_heartbeat_thread(
        self,
        on_renewed: Callable[[float], None] | None = None,
        on_lost: Callable[[Exception], None] | None = None,
        *,
        close_when_done: bool = False,
    ) -> threading.Event:
        """Sync channels: renew the lease from a daemon thread, at once (which opens the channel
        while the service is known to answer) and then every third of its TTL, until the
        returned event is set or the lease is lost.

        ``on_renewed(sent_at)`` runs in the thread after each successful heartbeat (``sent_at`` on
        the ``time.monotonic`` clock). A heartbeat that failed, whatever its status, is tried
        again every ``HEARTBEAT_RETRY_S`` on the same channel while the lease may still be alive
        (a TTL since the last renewal sent): a service that stood still for less than that
        (SIGSTOP, a loaded machine) costs nothing, since it gives a stall back to every lease.
        ``on_lost(error)`` runs in the thread, and the thread ends, when the service says the
        lease is gone (NOT_FOUND) or the lease ran out with every retry failing.
        ``close_when_done`` closes this client's channel when the thread ends (a client made for
        the heartbeats alone).
        """
        stop = threading.Event()

        def beat():
            wait_s, renewed_at = 0.0, time.monotonic()
            try:
                while not stop.wait(wait_s):
                    sent_at = time.monotonic()
                    try:
                        self.heartbeat()
                    except CacheCallError as e:
                        error = f"heartbeat: {e}"
                        left_s = renewed_at + self.lease_ttl_s - time.monotonic()
                        if e.code == "NOT_FOUND" or left_s <= 0:
                            if on_lost is not None:
                                on_lost(ConnectionError(error))
                            return
                        log.warning("%s; retrying (the lease has %.2fs left)", error, left_s)
                        wait_s = min(HEARTBEAT_RETRY_S, left_s)
                        continue
                    wait_s, renewed_at = self.lease_ttl_s / 3, sent_at
                    if on_renewed is not None:
                        on_renewed(sent_at)
            finally:
                if close_when_done:
                    self.close()

        threading.Thread(target=beat, name="kvtier-heartbeat", daemon=True).start()
        return stop

    async def heartbeat_forever(self) -> None:
        """Aio channels: renew the lease every third of its TTL until cancelled."""
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            await self.heartbeat()

    # ------------------------------------------------------------ sequences

    # NOTE: requests are filled with ``items.add(**fields)``, passing only fields that differ from
    # their defaults: about half the cost of building item messages and handing over the list
    # (64 items: 51 vs 99 µs for Extend, 78 vs 237 µs for Allocate on the development machine),
    # and Extend and Commit run every decode step.

    def allocate(self, items: Iterable[AllocateItem | Sequence[int]]) -> Reply[list[SequenceBlocks]]:
        """One sequence per item: an AllocateItem, or a plain list of token ids (every other field
        at its default). Its blocks, one SequenceBlocks per item in order."""
        request = cache_pb2.AllocateRequest(lease_id=self.lease_id)
        add = request.items.add
        for item in items:
            if isinstance(item, AllocateItem):
                add(**allocate_fields(item))
            else:
                add(token_ids=item)
        return self._call(self.stub.Allocate, request, _sequences)

    def extend(
        self,
        items: Iterable[ExtendItem],
        commits: Iterable[CommitItem] = (),
        releases: Iterable[ReleaseItem] = (),
    ) -> Reply[list[SequenceBlocks]]:
        """Room for `num_tokens` more tokens per sequence, after `commits` (as `commit` takes
        them) and then `releases` (blocks a sliding window left behind) are applied: one call.
        The full block tables after it, one per item in order."""
        request = cache_pb2.ExtendRequest(lease_id=self.lease_id)
        add = request.items.add
        for sequence_id, num_tokens in items:
            add(sequence_id=sequence_id, num_tokens=num_tokens)
        _add_commits(request.commits, commits)
        for sequence_id, num_blocks in releases:
            request.releases.add(sequence_id=sequence_id, num_blocks=num_blocks)
        return self._call(self.stub.Extend, request, _sequences)

    def commit(self, items: Iterable[CommitItem]) -> Reply[int]:
        """Append each item's token ids to its sequence and record its computed tokens. The blocks
        newly published to the prefix index."""
        request = cache_pb2.CommitRequest(lease_id=self.lease_id)
        _add_commits(request.items, items)
        return self._call(self.stub.Commit, request, _num_blocks_published)

    def free(self, sequence_ids: Iterable[int], commits: Iterable[CommitItem] = ()) -> Reply[int]:
        """Drop sequences, after `commits` (a finished sequence's last tokens) are applied. The
        blocks whose reference count dropped to zero."""
        request = cache_pb2.FreeRequest(lease_id=self.lease_id, sequence_ids=sequence_ids)
        _add_commits(request.commits, commits)
        return self._call(self.stub.Free, request, _num_blocks_released)

    def swap_out(self, sequence_ids: Iterable[int], commits: Iterable[CommitItem] = ()) -> Reply[SwapResult]:
        req = cache_pb2.SwapOutRequest(lease_id=self.lease_id, sequence_ids=sequence_ids)
        _add_commits(req.commits, commits)
        return self._call(self.stub.SwapOut, req, _swapped_out)

    def swap_in(self, sequence_ids: Iterable[int]) -> Reply[SwapResult]:
        req = cache_pb2.SwapInRequest(lease_id=self.lease_id, sequence_ids=sequence_ids)
        return self._call(self.stub.SwapIn, req, _swapped_in)

    # ------------------------------------------------------------ observation

    def lookup_prefix(
        self, prompts: Iterable[Sequence[int]], *, tenant_salt: str = "", adapter_id: str = ""
    ) -> Reply[list[PrefixHit]]:
        """Leading tokens of each prompt cached, on the device and below it, hashed with
        `tenant_salt` (the salt kvtier.api_keys.tenant_salt bound to a tenant, as Allocate takes it)."""
        items = [
            cache_pb2.LookupPrefixItem(token_ids=t, tenant_salt=tenant_salt, adapter_id=adapter_id)
            for t in prompts
        ]
        return self._call(self.stub.LookupPrefix, cache_pb2.LookupPrefixRequest(items=items), prefix_hits)

    def get_stats(self) -> Reply[CacheSnapshot]:
        return self._call(self.stub.GetStats, cache_pb2.GetStatsRequest(), stats_from_proto)

    def watch_events(self, since_event_id: int = 0, timeout_s: float | None = None) -> EventStream:
        """The events after `since_event_id` as they happen, until cancel() or `timeout_s`
        (DEADLINE_EXCEEDED; None: no deadline, a follower's stream)."""
        req = cache_pb2.WatchEventsRequest(since_event_id=since_event_id)
        return EventStream(self.stub.WatchEvents(req, metadata=self.metadata, timeout=timeout_s))

    def watch_event_batches(
        self, since_event_id: int = 0, omit_token_ids: bool = False, timeout_s: float | None = None,
        start_with_held: bool = False, hashes_only: bool = False,
    ) -> EventBatchStream:  # fmt: skip
        """``watch_events``' events a list per message (those the service had ready when it sent
        it): for a follower of every block, far fewer messages. ``omit_token_ids``: BlockStored
        events come without their token ids (``[]``). ``start_with_held`` (``since_event_id`` 0):
        first the blocks held now on this node's media (``HeldBatch``es, up to one with ``end``),
        then the events after them: complete without the log's whole history. ``hashes_only``:
        each message's events as ``RunBatch``es of ``HashRun``s (hashes per medium and kind, no
        object per event; for a follower that keeps which hashes each medium holds)."""
        req = cache_pb2.WatchEventBatchesRequest(
            since_event_id=since_event_id, omit_token_ids=omit_token_ids, start_with_held=start_with_held,
            hashes_only=hashes_only,
        )  # fmt: skip
        call = self.stub.WatchEventBatches(req, metadata=self.metadata, timeout=timeout_s)
        return EventBatchStream(call, hashes_only)


# Each reply's value (the functions `_call` converts a reply with).
def _sequences(reply) -> list[SequenceBlocks]:
    return sequence_blocks(reply.sequences)


def _lease_ttl_s(reply: cache_pb2.HeartbeatResponse) -> float:
    return reply.lease_ttl_s


def _num_blocks_published(reply: cache_pb2.CommitResponse) -> int:
    return reply.num_blocks_published


def _num_blocks_released(reply: cache_pb2.FreeResponse) -> int:
    return reply.num_blocks_released


def _swapped_out(reply: cache_pb2.SwapOutResponse) -> SwapResult:
    return SwapResult(reply.num_blocks, reply.num_bytes, [])


def _swapped_in(reply: cache_pb2.SwapInResponse) -> SwapResult:
    return SwapResult(reply.num_blocks, reply.num_bytes, sequence_blocks(reply.sequences))


def _add_commits(field, commits: Iterable[CommitItem]) -> None:
    """Fill a repeated CommitItem field from CommitItems (or plain tuples of the same fields)."""
    add = field.add
    for sequence_id, token_ids, num_computed in commits:
        add(sequence_id=sequence_id, token_ids=token_ids, num_computed_tokens=num_computed)
