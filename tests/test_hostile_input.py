"""Hostile input costs the cache service nothing: oversized requests are refused on their raw bytes
and leave no memory behind, unread WatchEvents streams hold no copy of the event log and are
capped, long strings are refused, and a stream of refused calls does not starve a heartbeat.

Real `python -m kvtier.cachesvc` processes over a Unix socket; the service's memory is its resident set
(VmRSS in /proc/<pid>/status). Bounds (tiny model: vocab 258, max_model_len 1024; max_batch 1024):

- Allocate / Commit / LookupPrefix take at most ~4.9 MB (cachesvc.wire_limits.request_limits),
  grpc refuses anything larger unread; a refused call grows the RSS by less than 50 MiB, however
  many are sent.
- 100 WatchEvents streams on a log of ~19,000 events, none read past its first event: 64 open
  (the default --max-watch-streams), 36 refused, and they cost less than 48 MiB together (each
  stream used to copy the whole log, ~30 MB here).
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from servers import TOKEN, cache_service, wait_until

from kvtier.api import cache_pb2, cache_pb2_grpc
from kvtier.auth import bearer
from kvtier.block_hash import pack_token_ids
from kvtier.cache_client import CacheClient, open_channel
from kvtier.cache_errors import CacheCallError
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.events import REMOVED, STORED, EventLog
from kvtier.cachesvc.leases import LeaseTable
from kvtier.cachesvc.node import CacheNode
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.cachesvc.servicer import CacheServicer
from kvtier.cachesvc.wire_limits import request_limits, request_scans
from kvtier.grpc_server import start_server
from kvtier.sequence_types import BlockStored, CacheEvent

MIB = 1 << 20
VOCAB, MAX_LEN, MAX_BATCH = 258, 1024, 1024  # the tiny model's, and --max-batch's default
LIMIT = request_limits(MAX_BATCH, MAX_LEN, VOCAB)["/kvtier.v1.CacheService/LookupPrefix"]
LEASE_TTL_S = 1.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def settled_rss_mib(pid: int) -> float:
    """The RSS once it stops moving (two readings 0.2 s apart within 1 MiB), so a reading is not
    taken while the service is still working through what the test sent."""
    last = [rss_mib(pid)]

    def steady():
        time.sleep(0.2)  # the interval between two readings, not a wait for readiness
        now = rss_mib(pid)
        done = abs(now - last[0]) < 1.0
        last[0] = now
        return done

    wait_until(steady, 30, "the service's RSS to settle")
    return last[0]


def lookup_request(num_tokens: int) -> cache_pb2.LookupPrefixRequest:
    """One item of `num_tokens` one-byte token ids: the most tokens a byte can carry."""
    return cache_pb2.LookupPrefixRequest(items=[cache_pb2.LookupPrefixItem(token_ids=[1] * num_tokens)])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with cache_service(tmp_path_factory.mktemp("hostile"), "--num-blocks", "128", "--swap-space", "0") as svc:
        yield svc


@pytest.fixture(scope="module")
def stub(service):
    channel = open_channel(service.address)
    yield cache_pb2_grpc.CacheServiceStub(channel)
    channel.close()


def refused(call, request, metadata) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(request, metadata=metadata, timeout=60)
    return e.value


def test_a_20_mib_lookup_prefix_is_refused_with_or_without_a_token_and_leaves_no_memory(service, stub):
    pid = service.proc.pid
    huge = lookup_request(20 * MIB)
    at_limit = lookup_request(LIMIT - 16)
    assert huge.ByteSize() > 20 * MIB and LIMIT - 16 < at_limit.ByteSize() <= LIMIT
    stub.GetStats(cache_pb2.GetStatsRequest(), metadata=bearer(TOKEN), timeout=10)
    before = settled_rss_mib(pid)
    for _ in range(2):
        # Over every method's limit: grpc refuses it before any of our code runs.
        for metadata in (bearer(TOKEN), ()):
            e = refused(stub.LookupPrefix, huge, metadata)
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        # Just under the limit: with the token, refused on a scan of its bytes (5 M tokens are
        # never built); without, refused before the scan.
        e = refused(stub.LookupPrefix, at_limit, bearer(TOKEN))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert "items[0]: len(token_ids) is at least" in e.details() and "max_model_len 1024" in e.details()
        e = refused(stub.LookupPrefix, at_limit, ())
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
    after = settled_rss_mib(pid)
    print(
        f"LookupPrefix 20 MiB and {at_limit.ByteSize()} B, x2 each way: RSS {before:.0f} -> {after:.0f} MiB"
    )
    assert after - before < 50, f"RSS grew {after - before:.0f} MiB ({before:.0f} -> {after:.0f})"
    # The service still answers, correctly.
    assert list(
        stub.LookupPrefix(lookup_request(32), metadata=bearer(TOKEN), timeout=10).num_cached_tokens
    ) == [0]


def test_over_long_strings_are_refused_and_get_stats_keeps_working_for_everyone(service, stub):
    client = CacheClient.connect(service.address, TOKEN, timeout_s=30.0)
    client.attach("honest")
    beating = client.start_heartbeat_thread()  # the lease must outlive the 48 MiB upload
    try:
        leases_before = len(client.get_stats().leases)
        cases = [
            # 48 MiB: over every limit, grpc refuses it unread.
            ("x" * (48 * MIB), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
            # Over Attach's own limit (4 KiB), under grpc's: refused by the guard, unparsed.
            ("x" * 8000, grpc.StatusCode.RESOURCE_EXHAUSTED, "Attach: the request is 8003 bytes"),
            # Under Attach's limit, over a client name's: refused naming the field.
            (
                "x" * 3000,
                grpc.StatusCode.INVALID_ARGUMENT,
                "client_name is 3000 bytes, over the limit of 256",
            ),
            ("é" * 200, grpc.StatusCode.INVALID_ARGUMENT, "client_name is 400 bytes"),
        ]
        for name, code, details in cases:
            e = refused(stub.Attach, cache_pb2.AttachRequest(client_name=name), bearer(TOKEN))
            assert e.code() == code and details in e.details(), (code, e.code(), e.details())
        e = refused(stub.Heartbeat, cache_pb2.HeartbeatRequest(lease_id="f" * 65), bearer(TOKEN))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_id is 65 bytes" in e.details()
        salted = cache_pb2.AllocateItem(token_ids=[1, 2, 3], tenant_salt="s" * 1025)
        request = cache_pb2.AllocateRequest(lease_id=client.lease_id, items=[salted])
        e = refused(stub.Allocate, request, bearer(TOKEN))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert "items[0].tenant_salt is 1025 bytes, over the limit of 1024" in e.details()
        # The longest accepted name still attaches, and GetStats answers everyone, small.
        client.attach("n" * 256)
        stats = client.get_stats()
        assert len(stats.leases) == leases_before + 1
        assert max(len(lease.client_name) for lease in stats.leases) == 256
        # Small on the wire (this file's subject: read through the stub, as bytes).
        reply = stub.GetStats(cache_pb2.GetStatsRequest(), metadata=bearer(TOKEN), timeout=10)
        assert reply.ByteSize() < 64 * 1024
    finally:
        beating.set()
        client.close()


def test_a_heartbeating_lease_survives_a_stream_of_large_refused_calls(service, stub):
    client = CacheClient.connect(service.address, TOKEN, timeout_s=LEASE_TTL_S / 2)
    client.attach("heartbeating")
    assert client.lease_ttl_s == LEASE_TTL_S
    seq = client.allocate([[3, 4, 5]])[0]
    renewals: list[float] = []
    lost: list[Exception] = []
    stop = client.start_heartbeat_thread(on_renewed=renewals.append, on_lost=lost.append)
    # Sent as ready bytes: serializing 5 MB per call would hold this process's GIL, and the
    # heartbeat thread runs in this process.
    at_limit = lookup_request(LIMIT - 16).SerializeToString()
    over_count = cache_pb2.LookupPrefixRequest(
        items=[cache_pb2.LookupPrefixItem(token_ids=[1] * 4) for _ in range(MAX_BATCH + 1)]
    ).SerializeToString()
    channel = open_channel(service.address)
    lookup = channel.unary_unary(
        "/kvtier.v1.CacheService/LookupPrefix", request_serializer=None, response_deserializer=None
    )
    stop_flood = threading.Event()
    sent, answers = [0], set()

    def flood():
        while not stop_flood.is_set():
            for request in (at_limit, over_count):
                try:
                    lookup(request, metadata=bearer(TOKEN), timeout=60)
                    answers.add("OK")
                except grpc.RpcError as e:
                    answers.add(e.code().name)
                sent[0] += 1

    floods = [threading.Thread(target=flood) for _ in range(2)]
    try:
        for t in floods:
            t.start()
        # Three TTLs of refused calls; every heartbeat in them must land.
        first = len(renewals)
        wait_until(lambda: len(renewals) >= first + 9 or lost, 60, "9 heartbeats during the flood")
    finally:
        stop_flood.set()
        for t in floods:
            t.join()
        stop.set()
        channel.close()
    assert not lost, f"the lease was lost during the flood: {lost[0]!r}"
    assert sent[0] >= 10, f"only {sent[0]} large calls were sent"
    assert answers == {"INVALID_ARGUMENT"}, answers
    # The lease lived through it: it is still listed, and its sequence is still there.
    assert client.lease_id[:8] in [lease.lease_id for lease in client.get_stats().leases]
    assert client.free([seq.sequence_id]) == 1  # blocks released
    client.close()


def fill_event_log(client: CacheClient, rounds: int) -> int:
    """Commit a new 1024-token prompt per round (64 BlockStored each; past the pool's 128 blocks
    each round also evicts: BlockRemoved); returns the events logged."""
    for r in range(rounds):
        prompt = [r % 256, r // 256 + 1, *((i * 7 + r) % 256 for i in range(MAX_LEN - 2))]
        seq = client.allocate([prompt])[0]
        client.commit([(seq.sequence_id, [], MAX_LEN)])
        client.free([seq.sequence_id])
    return rounds


def test_100_unread_watch_streams_are_capped_and_hold_no_copy_of_the_log(service):
    client = CacheClient.connect(service.address, TOKEN, timeout_s=30.0)
    client.attach("filler")
    fill_event_log(client, 150)
    assert _first_events(client, 1)[0].event_id == 1
    pid = service.proc.pid
    before = settled_rss_mib(pid)
    streams = [client.watch_events(0) for _ in range(100)]
    opened, refusals = [], []
    for s in streams:
        try:
            event = next(s)
            assert event.event_id == 1
            opened.append(s)
        except CacheCallError as e:
            refusals.append(e)
    after = settled_rss_mib(pid)
    print(f"100 WatchEvents(0) streams, {len(opened)} open: RSS {before:.0f} -> {after:.0f} MiB")
    assert len(opened) == 64 and len(refusals) == 36
    assert {e.code for e in refusals} == {"RESOURCE_EXHAUSTED"}
    assert "--max-watch-streams 64" in refusals[0].details
    assert after - before < 48, f"64 unread streams cost {after - before:.0f} MiB"
    # Closing streams frees their places.
    for s in opened:
        s.cancel()
    wait_until(lambda: _can_watch(client), 30, "a new stream once the others closed")
    # The log is whole for a stream that reads on: ids 1.. without a gap, BlockStored first.
    events = _first_events(client, 5000)
    assert [e.event_id for e in events] == list(range(1, 5001))
    assert isinstance(events[0].event, BlockStored) and len(events[0].event.token_ids) == 16
    client.close()


def _first_events(client: CacheClient, n: int) -> list[CacheEvent]:
    stream = client.watch_events(0)
    try:
        return [next(stream) for _ in range(n)]
    finally:
        stream.cancel()


def _can_watch(client: CacheClient) -> bool:
    try:
        _first_events(client, 1)
        return True
    except CacheCallError as e:
        assert e.code == "RESOURCE_EXHAUSTED", e.details
        return False


# ---------------------------------------------------------------- in-process checks


def test_reading_the_log_in_chunks_gives_what_one_read_gives():
    log = EventLog(block_size=2, capacity=40)
    block = pack_token_ids([1, 2])
    for r in range(30):
        hashes = tuple(bytes([r, k]) * 16 for k in range(r % 4 + 1))
        ids = tuple(range(len(hashes)))
        record = (STORED, hashes, ids, block * len(hashes), None) if r % 3 else (REMOVED, hashes, ids)
        log.extend([record])
    whole = log.since(0)
    assert [i for i, _ in whole] == list(range(whole[0][0], log.last_event_id + 1))
    for chunk in (1, 3, 7):
        start, read = whole[0][0] - 1, []
        while part := log.since(start, chunk):
            assert len(part) <= chunk
            read += part
            start = part[-1][0]
        assert read == whole, chunk


def test_a_refused_call_leaves_no_cycle_that_holds_its_request():
    """Before the fix, the abort of a refused call was chained to the refusal and kept in a local
    of the frame its traceback held: a cycle that kept the request (bytes, parsed message and the
    lists built from it) alive until a garbage-collector pass."""
    sequences = SequenceTable(
        BlockManager(64, 16), None, model_fingerprint="fp", vocab_size=VOCAB, max_model_len=MAX_LEN
    )
    servicer = CacheServicer(CacheNode(sequences, LeaseTable(10.0)), pool_spec=None)
    under_limit = lookup_request(300_000)
    # Small enough to be parsed unscanned (under 256 KiB): refused by the servicer...
    over_count = cache_pb2.LookupPrefixRequest(
        items=[cache_pb2.LookupPrefixItem(token_ids=[1] * 100) for _ in range(MAX_BATCH + 1)]
    )
    # ... and by the domain, after the servicer built 200,000 token lists (the last id is over the vocabulary).
    items = [cache_pb2.LookupPrefixItem(token_ids=[1] * 200) for _ in range(MAX_BATCH - 1)]
    out_of_vocab = cache_pb2.LookupPrefixRequest(
        items=[*items, cache_pb2.LookupPrefixItem(token_ids=[1, VOCAB])]
    )

    async def run() -> list[str]:
        server, _health, address = await start_server(
            "kvtier.v1.CacheService",
            lambda g: cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, g),
            "127.0.0.1:0",
            TOKEN,
            max_request_bytes=request_limits(MAX_BATCH, MAX_LEN, VOCAB),
            raw_checks=request_scans(MAX_BATCH, MAX_LEN),
        )
        held: list[str] = []
        codes: list[grpc.StatusCode] = []
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = cache_pb2_grpc.CacheServiceStub(channel)
                cases = [
                    (under_limit, ()),  # UNAUTHENTICATED in the guard
                    (under_limit, bearer(TOKEN)),  # INVALID_ARGUMENT from the raw scan
                    (over_count, bearer(TOKEN)),  # INVALID_ARGUMENT from the servicer, after parsing
                    (out_of_vocab, bearer(TOKEN)),  # INVALID_ARGUMENT from the domain
                ]
                for request, metadata in cases:
                    gc.collect()
                    gc.disable()
                    try:
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            await stub.LookupPrefix(request, metadata=metadata, timeout=30)
                        codes.append(e.value.code())
                        await asyncio.sleep(0.1)  # let grpc finish the call on the server side
                        gc.set_debug(gc.DEBUG_SAVEALL)
                        gc.collect()
                        held += [_large_locals(o) for o in gc.garbage if type(o).__name__ == "frame"]
                    finally:
                        gc.set_debug(0)
                        gc.garbage.clear()
                        gc.enable()
        finally:
            await server.stop(grace=None)
        return [h for h in held if h], codes

    held, codes = asyncio.run(run())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] + [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert not held, f"frames in garbage cycles still hold large request data: {held}"


def _large_locals(frame) -> str:
    """The names of `frame`'s locals that are large request data (bytes, strings, messages, lists)."""
    big = [name for name, value in frame.f_locals.items() if _size(value) > 100_000]
    return f"{frame.f_code.co_name}: {', '.join(big)}" if big else ""


def _size(value) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(_size(v) for v in value)
    if hasattr(value, "ByteSize"):
        return value.ByteSize()
    return 0


def test_a_stream_whose_reader_falls_behind_the_log_ends_with_out_of_range_and_can_resume():
    sequences = SequenceTable(
        BlockManager(64, 16), None, model_fingerprint="fp", vocab_size=VOCAB, max_model_len=MAX_LEN
    )
    node = CacheNode(sequences, LeaseTable(10.0))
    node.events = EventLog(block_size=16, capacity=32)
    servicer = CacheServicer(node, pool_spec=None)

    def stored(n: int):
        hashes = tuple(bytes([k % 256]) * 32 for k in range(n))
        return (STORED, hashes, tuple(range(n)), pack_token_ids([1] * 16) * n, None)

    async def run():
        server, _health, address = await start_server(
            "kvtier.v1.CacheService",
            lambda g: cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, g),
            "127.0.0.1:0",
            TOKEN,
        )
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = cache_pb2_grpc.CacheServiceStub(channel)
                node.events.extend([stored(10)])
                stream = stub.WatchEvents(cache_pb2.WatchEventsRequest(), metadata=bearer(TOKEN), timeout=30)
                seen = [(await stream.read()).event_id for _ in range(10)]
                # 100 events arrive while the reader is at 10; the log keeps only the newest 32+.
                node.events.extend([stored(50), stored(50)])
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stream.read()
                # Resuming from what the log still holds works.
                resumed = stub.WatchEvents(
                    cache_pb2.WatchEventsRequest(since_event_id=60), metadata=bearer(TOKEN), timeout=30
                )
                first = (await resumed.read()).event_id
                resumed.cancel()
                return seen, e.value, first
        finally:
            await server.stop(grace=None)

    seen, error, first = asyncio.run(run())
    assert seen == list(range(1, 11))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE, error.details()
    assert "since_event_id 10 is older than the oldest kept event 61" in error.details()
    assert "resynchronize with LookupPrefix and watch from 0" in error.details()
    assert first == 61
    assert servicer.num_watch_streams == 0


def test_the_raw_scan_agrees_with_the_parsed_request_and_leaves_malformed_bytes_to_the_parser():
    rng = random.Random(16)
    max_batch, max_len = 4, 16
    scans = request_scans(max_batch, max_len, scan_from_bytes=0)
    kinds = {
        "Allocate": (cache_pb2.AllocateRequest, cache_pb2.AllocateItem, "items"),
        "Commit": (cache_pb2.CommitRequest, cache_pb2.CommitItem, "items"),
        "LookupPrefix": (cache_pb2.LookupPrefixRequest, cache_pb2.LookupPrefixItem, "items"),
        # Calls that carry commits: their `commits` field is scanned as Commit's items.
        "Extend": (cache_pb2.ExtendRequest, cache_pb2.CommitItem, "commits"),
        "Free": (cache_pb2.FreeRequest, cache_pb2.CommitItem, "commits"),
        "SwapOut": (cache_pb2.SwapOutRequest, cache_pb2.CommitItem, "commits"),
    }
    refusals = 0
    for _ in range(300):
        name = rng.choice(list(kinds))
        request_type, item_type, field = kinds[name]
        lengths = [
            rng.choice([0, 1, max_len, max_len + 1, rng.randrange(40)]) for _ in range(rng.randrange(7))
        ]
        # Ids of 1 to 3 varint bytes, and strings around the token list, as real requests have.
        items = [
            item_type(
                token_ids=[rng.choice([1, 300, 70_000]) for _ in range(n)], **_other_fields(item_type, rng)
            )
            for n in lengths
        ]
        extra = {"lease_id": "lease"} if name != "LookupPrefix" else {}
        raw = request_type(**{field: items}, **extra).SerializeToString()
        wrong = scans[f"/kvtier.v1.CacheService/{name}"](raw)
        over = [k for k, n in enumerate(lengths[:max_batch]) if n > max_len]
        if len(lengths) > max_batch and not over:
            assert wrong == f"len({field}) exceeds max_batch {max_batch}", (lengths, wrong)
        elif over:
            assert wrong is not None and wrong.startswith(
                f"{field}[{over[0]}]: len(token_ids) is at least"
            ), (
                lengths,
                wrong,
            )
        else:
            assert wrong is None, (lengths, wrong)
        refusals += wrong is not None
        # Cut short anywhere, the bytes are left to the parser: the scan raises nothing and
        # refuses only what the whole request is refused for, found before the cut.
        cut = raw[: rng.randrange(len(raw) + 1)]
        assert scans[f"/kvtier.v1.CacheService/{name}"](cut) in (None, wrong)
    assert 50 < refusals < 250


def _other_fields(item_type, rng: random.Random) -> dict:
    fields = item_type.DESCRIPTOR.fields_by_name
    out = {}
    if "tenant_salt" in fields:
        out["tenant_salt"] = "s" * rng.randrange(3)
    if "sequence_id" in fields:
        out["sequence_id"] = rng.choice([1, 2**40])
    if "num_computed_tokens" in fields:
        out["num_computed_tokens"] = rng.randrange(100)
    return out
