"""The cache service as a real subprocess, driven over its Unix socket by real clients.

Clients that must be independent of the test process run as spawned subprocesses
(tests/clients/writer.py); the test process itself is a second, independent client.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import REPO, TOKEN, cache_service, child_env, stats_without_clock, tls_cache_service, wait_until

from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.cache_errors import CacheCallError, CacheUnavailable
from kvtier.cache_streams import runs_of
from kvtier.pool import attach_pool
from kvtier.sequence_types import BlockRemoved, BlockStored, CacheEvent, HeldBatch, RunBatch
from kvtier.status import LEASE_EXPIRED

BLOCK = 16
PROMPT = list(range(1, 38))  # 37 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cache")
    with cache_service(run_dir, "--num-blocks", "64", "--swap-space", "0.001", "--max-batch", "8") as svc:
        yield svc


@pytest.fixture
def client(service):
    c = CacheClient.connect(service.address, TOKEN)
    c.attach("pytest")
    stop = c.start_heartbeat_thread()
    yield c
    try:
        if _own_sequences(c):
            c.free([s.sequence_id for s in _own_sequences(c)])
    finally:
        stop.set()
        c.close()


def _own_sequences(c: CacheClient):
    # Sequences are tracked by the service; the test only frees what it allocated via this list.
    return getattr(c, "_test_seqs", [])


def _alloc(c: CacheClient, items):
    seqs = list(c.allocate(items))
    c._test_seqs = [*getattr(c, "_test_seqs", []), *seqs]
    return seqs


def _under_lease(c: CacheClient, lease_id: str, call):
    """``call()`` sent under another lease id than ``c``'s own."""
    own, c.lease_id = c.lease_id, lease_id
    try:
        return call()
    finally:
        c.lease_id = own


def _spawn_writer(service, prompt, fill, *extra):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests/clients/writer.py"),
            "--address",
            service.address,
            "--prompt",
            ",".join(map(str, prompt)),
            "--fill",
            str(fill),
            *extra,
        ],
        cwd=REPO,
        env=child_env(service.run_dir),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line, f"writer exited with {proc.wait()}"
    return proc, json.loads(line)


def test_stubs_match_the_proto():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.protogen", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_independent_process_writes_and_another_reads_the_same_bytes_through_a_prefix_hit(service, client):
    writer, info = _spawn_writer(service, PROMPT, 1.5, "--hold")
    try:
        seq = _alloc(client, [PROMPT])[0]
        # 37 tokens: the hit is capped at 36, i.e. the two full blocks the writer committed.
        assert seq.num_cached_tokens == 2 * BLOCK
        assert list(seq.block_table[:2]) == info["block_table"][:2]
        assert seq.block_table[2] != info["block_table"][2]
        pool = attach_pool(client.pool)
        try:
            for block_id in seq.block_table[:2]:
                assert torch.all(pool.tensor[block_id] == 1.5)
            assert pool.tensor.shape[0] == 64
        finally:
            pool.close()
    finally:
        writer.stdin.close()
        writer.wait(10)


def test_swap_round_trip_preserves_bytes(client, request):
    seq = _alloc(client, [[7] * 40])[0]
    pool = attach_pool(client.pool)
    request.addfinalizer(pool.close)
    gen = torch.Generator().manual_seed(3)
    pattern = torch.randn((len(seq.block_table), *pool.tensor.shape[1:]), generator=gen)
    for i, block_id in enumerate(seq.block_table):
        pool.tensor[block_id].copy_(pattern[i])
    client.commit([(seq.sequence_id, [], 40)])
    out = client.swap_out([seq.sequence_id])
    assert out.num_blocks == len(seq.block_table)
    assert out.num_bytes == out.num_blocks * client.pool.block_bytes
    assert client.get_stats().num_swapped_sequences == 1
    for block_id in seq.block_table:
        pool.tensor[block_id].zero_()  # whatever happens to the device blocks, the host copy is intact
    back = client.swap_in([seq.sequence_id]).sequences[0]
    assert len(back.block_table) == len(seq.block_table)
    for i, block_id in enumerate(back.block_table):
        assert torch.equal(pool.tensor[block_id], pattern[i])
    stats = client.get_stats()
    assert stats.num_swapped_sequences == 0
    assert stats.num_swap_out_blocks >= out.num_blocks and stats.num_swap_in_blocks >= out.num_blocks


def test_sigkilled_client_leaks_no_block_and_its_committed_blocks_stay_cached(service, client):
    prompt = [200 + i % 50 for i in range(50)]  # 3 full blocks + 2 tokens
    writer, info = _spawn_writer(service, prompt, 2.0, "--hold")
    before = client.get_stats()
    assert any(lease.num_sequences == 1 for lease in before.leases)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)

    def released():
        s = client.get_stats()
        return (
            s
            if s.num_expired_leases > before.num_expired_leases
            and s.num_sequences == len(_own_sequences(client))
            else None
        )

    stats = wait_until(released, 15.0, "the killed client's lease to expire")
    owned_blocks = sum(len(s.block_table) for s in _own_sequences(client))
    assert stats.num_blocks_used == owned_blocks
    # Its last block holds 2 tokens past the 48 it committed: fenced (a frozen writer could
    # still be writing it), not leaked; the committed ones went back.
    assert stats.num_blocks_fenced >= 1  # (with earlier tests' writers' own, until their hold ends)
    assert stats.num_blocks_free + stats.num_blocks_used + stats.num_blocks_fenced == stats.num_blocks_total
    # The writer's three committed full blocks are still prefix hits.
    assert client.lookup_prefix([prompt])[0].num_cached_tokens == 3 * BLOCK
    seq = _alloc(client, [prompt])[0]
    assert seq.num_cached_tokens == 3 * BLOCK
    assert list(seq.block_table[:3]) == info["block_table"][:3]


def test_get_stats_counts_each_leases_tokens_and_the_slots_holding_them(service):
    c = CacheClient.connect(service.address, TOKEN)
    c.attach("token-stats")
    try:
        # 37 tokens + 4 lookahead -> 3 blocks; 20 + 4 -> 2 blocks, then 2 generated tokens committed.
        items = [AllocateItem(p, num_lookahead_tokens=4) for p in (PROMPT, list(range(100, 120)))]
        a, b = c.allocate(items)
        c.commit([(b.sequence_id, [7, 8], 20)])
        stats = c.get_stats()
        (mine,) = [lease for lease in stats.leases if lease.lease_id == c.lease_id[:8]]
        assert (mine.num_sequences, mine.num_blocks, mine.num_tokens) == (2, 5, 37 + 22)
        # Totals are the sums over leases, in one snapshot.
        assert stats.num_tokens == sum(lease.num_tokens for lease in stats.leases)
        assert stats.num_token_slots == BLOCK * sum(lease.num_blocks for lease in stats.leases)
        c.free([a.sequence_id, b.sequence_id])
        (mine,) = [lease for lease in c.get_stats().leases if lease.lease_id == c.lease_id[:8]]
        assert (mine.num_sequences, mine.num_blocks, mine.num_tokens) == (0, 0, 0)
    finally:
        c.close()


def test_calls_without_or_with_a_wrong_token_are_refused_but_health_is_open(service):
    for token in ("", "wrong-token"):
        c = CacheClient.connect(service.address, token)
        with pytest.raises(CacheCallError) as e:
            c.attach("intruder")
        assert e.value.code == "UNAUTHENTICATED"
        assert "token" in e.value.details
        with pytest.raises(CacheCallError) as e:
            c.get_stats()
        assert e.value.code == "UNAUTHENTICATED"
        c.close()
    with grpc.insecure_channel(service.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.v1.CacheService")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_socket_and_shared_memory_segment_are_owner_only(service, client):
    sock = Path(service.address[len("unix://") :])
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    segment = Path("/dev/shm") / client.pool.shm_name
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    assert segment.stat().st_uid == os.getuid()


def test_one_lease_cannot_touch_another_leases_sequences(service, client):
    seq = _alloc(client, [[5] * 20])[0]
    other = CacheClient.connect(service.address, TOKEN)
    other.attach("other")
    before = client.get_stats()
    calls = {
        "free": lambda: other.free([seq.sequence_id]),
        "extend": lambda: other.extend([(seq.sequence_id, 16)]),
        "commit": lambda: other.commit([(seq.sequence_id, [], 20)]),
        "swap_out": lambda: other.swap_out([seq.sequence_id]),
    }
    for name, call in calls.items():
        with pytest.raises(CacheCallError) as e:
            call()
        assert e.value.code == "PERMISSION_DENIED", name
        assert str(seq.sequence_id) in e.value.details, name
    after = client.get_stats()
    assert stats_without_clock(before) == stats_without_clock(after)
    other.close()


def test_cache_salt_isolates_tenants_in_allocate_and_lookup(service, client):
    prompt = [9] * 33
    seq = _alloc(client, [AllocateItem(prompt, tenant_salt="tenant-a")])[0]
    client.commit([(seq.sequence_id, [], 33)])
    assert client.lookup_prefix([prompt], tenant_salt="tenant-a")[0].num_cached_tokens == 32
    assert client.lookup_prefix([prompt], tenant_salt="tenant-b")[0].num_cached_tokens == 0
    assert client.lookup_prefix([prompt])[0].num_cached_tokens == 0
    other = _alloc(client, [AllocateItem(prompt, tenant_salt="tenant-b")])[0]
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(seq.block_table)


def test_watch_events_streams_stored_blocks_as_a_chain_with_increasing_ids(service, client):
    stream = client.watch_events(0)
    events: list[CacheEvent] = []
    done = threading.Event()

    def collect():
        try:
            for event in stream:
                events.append(event)
        except CacheCallError:  # cancelled
            pass
        done.set()

    threading.Thread(target=collect, daemon=True).start()
    prompt = [77] * 32
    seq = _alloc(client, [prompt])[0]
    client.commit([(seq.sequence_id, [], 32)])

    def stored_both():
        # Replay from 0 includes earlier tests' events, possibly on the same block ids: match the tokens too.
        mine = [
            e
            for _, e in events
            if isinstance(e, BlockStored) and e.block_id in seq.block_table and e.token_ids == [77] * 16
        ]
        return mine if len(mine) == 2 else None

    mine = wait_until(stored_both, 15.0, "BlockStored events")
    assert mine[0].token_ids == [77] * 16 and mine[0].medium == "device"
    assert mine[1].parent_block_hash == mine[0].block_hash
    ids = [e.event_id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    stream.cancel()  # from this thread, while the collector waits for the next event
    assert done.wait(15), "cancel() did not end the iteration on the other thread"


def test_watch_events_reports_evicted_blocks_as_removed_and_watch_event_batches_the_same_in_one_message(
    tmp_path,
):
    with cache_service(tmp_path, "--num-blocks", "4") as svc:
        c = CacheClient.connect(svc.address, TOKEN)
        c.attach("evictor")
        first = c.allocate([[1] * 64])[0]
        c.commit([(first.sequence_id, [], 64)])
        c.free([first.sequence_id])
        second = c.allocate([[2] * 64])[0]  # the pool is full of cached blocks: evict them
        assert sorted(second.block_table) == sorted(first.block_table)
        stream = c.watch_events(0)
        events = [next(stream) for _ in range(8)]
        stream.cancel()
        stored = [e.event for e in events[:4]]
        removed = [e.event for e in events[4:]]
        assert all(isinstance(e, BlockStored) for e in stored)
        assert all(isinstance(e, BlockRemoved) for e in removed)
        assert {r.block_hash for r in removed} == {s.block_hash for s in stored}
        # Freed in reverse order, so the chain's tail is evicted first.
        assert [r.block_id for r in removed] == [s.block_id for s in reversed(stored)]
        assert [e.event_id for e in events] == list(range(1, 9))
        assert c.get_stats().num_evictions == 4
        # The same events, every one that is ready in one message; without token ids if asked.
        for omit in (False, True):
            batches = c.watch_event_batches(0, omit_token_ids=omit, timeout_s=30)
            batch, caught_up = next(batches)
            batches.cancel()
            # (the host tier's BlockStored events of the evicted blocks follow the first 8)
            assert [e.event_id for e in batch] == list(range(1, len(batch) + 1)) and caught_up
            assert [e.event.block_hash for e in batch[:8]] == [e.event.block_hash for e in events]
            assert [getattr(e.event, "token_ids", None) for e in batch[:4]] == (
                [[]] * 4 if omit else [e.token_ids for e in stored]
            )
        # hashes_only: the same events as runs of hashes (device stores, device removals, host stores).
        runs = c.watch_event_batches(0, hashes_only=True, timeout_s=30)
        got = next(runs)
        runs.cancel()
        assert isinstance(got, RunBatch) and got.caught_up and got.runs == runs_of(batch)
        assert [(r.medium, r.stored, len(r.hashes)) for r in got.runs[:2]] == [
            ("device", True, 4),
            ("device", False, 4),
        ]
        c.close()


def test_a_stream_started_with_the_held_blocks_holds_what_a_replay_of_every_event_holds(tmp_path):
    from kvtier.vllm.block_index import apply_events, apply_held

    with cache_service(tmp_path, "--num-blocks", "4") as svc:
        c = CacheClient.connect(svc.address, TOKEN)
        c.attach("follower")
        for fill in (1, 2):  # the second chain evicts the first to the host tier
            seq = c.allocate([[fill] * 64])[0]
            c.commit([(seq.sequence_id, [], 64)])
            c.free([seq.sequence_id])
        replayed: dict[str, set[bytes]] = {}
        batches = c.watch_event_batches(0, omit_token_ids=True, timeout_s=30)
        for batch in batches:
            apply_events(replayed, batch.events)
            if batch.caught_up:
                break
        batches.cancel()
        last = batch.events[-1].event_id
        stream = c.watch_event_batches(start_with_held=True, hashes_only=True, timeout_s=30)  # as block_index
        held = [next(stream)]
        while not held[-1].end:
            held.append(next(stream))
        assert all(isinstance(b, HeldBatch) for b in held) and held[-1].caught_up
        assert {b.as_of for b in held} == {last}
        got: dict[str, set[bytes]] = {}
        for b in held:
            apply_held(got, b)
        assert got == {m: h for m, h in replayed.items() if h} and len(got["device"]) == len(got["host"]) == 4
        seq = c.allocate([[3] * 64])[0]  # what happens next follows the held blocks
        after = next(stream)
        stream.cancel()
        assert isinstance(after, RunBatch) and after.runs[0].first_event_id == last + 1
        # Held blocks are the present: resuming after an event is since_event_id's job alone.
        with pytest.raises(CacheCallError) as refused:
            next(c.watch_event_batches(3, start_with_held=True, timeout_s=30))
        assert (
            refused.value.code == "INVALID_ARGUMENT" and "since_event_id must be 0" in refused.value.details
        )
        c.free([seq.sequence_id])
        c.close()


def _bad_calls(c: CacheClient, seq_id: int, swapped_id: int, pool_blocks: int):
    ok = [1, 2, 3]
    item = AllocateItem

    def allocate(*items, lease=None):
        return _under_lease(c, c.lease_id if lease is None else lease, lambda: c.allocate(items))

    INV, NF, RE, FP = "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"
    return [
        ("Allocate without a lease", lambda: allocate(item(token_ids=ok), lease=""), INV, "lease_id"),
        ("Allocate on an unknown lease", lambda: allocate(item(token_ids=ok), lease="f" * 32), NF, "lease"),
        ("Allocate with no items", lambda: allocate(), INV, "items"),
        ("Free no sequences", lambda: c.free([]), INV, "sequence_ids"),
        ("Allocate an empty prompt", lambda: allocate(item(token_ids=[])), INV, "token_ids"),
        ("Allocate a token id above the vocabulary", lambda: allocate(item(token_ids=[1, 258])), INV, "258"),
        ("Allocate a negative token id", lambda: allocate(item(token_ids=[-1])), INV, "-1"),
        ("Allocate past max_model_len", lambda: allocate(item(token_ids=[1] * 1025)), INV, "1024"),
        (
            "Allocate a negative lookahead",
            lambda: allocate(item(token_ids=ok, num_lookahead_tokens=-5)),
            INV,
            "-5",
        ),
        ("Allocate more items than max_batch", lambda: allocate(*[item(token_ids=ok)] * 9), INV, "8"),
        (
            "Allocate a valid item then an invalid one",
            lambda: allocate(item(token_ids=ok), item(token_ids=[999])),
            INV,
            "999",
        ),
        (
            "Allocate more blocks than the pool has",
            lambda: allocate(*[item(token_ids=[1] * 1000)] * 8),
            RE,
            "blocks",
        ),
        ("Extend an unknown sequence", lambda: c.extend([(10**9, 1)]), NF, str(10**9)),
        ("Extend by a negative count", lambda: c.extend([(seq_id, -3)]), INV, "-3"),
        ("Extend past max_model_len", lambda: c.extend([(seq_id, 5000)]), INV, "1024"),
        (
            "Extend a sequence twice in one call",
            lambda: c.extend([(seq_id, 1), (seq_id, 1)]),
            INV,
            str(seq_id),
        ),
        ("Extend a swapped-out sequence", lambda: c.extend([(swapped_id, 1)]), FP, str(swapped_id)),
        ("Commit more tokens than written", lambda: c.commit([(seq_id, [], 99)]), INV, "99"),
        ("Commit tokens past the slots", lambda: c.commit([(seq_id, [1] * 40, 20)]), INV, "slots"),
        ("Commit a token id above the vocabulary", lambda: c.commit([(seq_id, [300], 20)]), INV, "300"),
        ("Free an unknown sequence", lambda: c.free([10**9]), NF, str(10**9)),
        ("Free a valid and an unknown sequence", lambda: c.free([seq_id, 10**9]), NF, str(10**9)),
        ("SwapOut a swapped-out sequence", lambda: c.swap_out([swapped_id]), FP, str(swapped_id)),
        ("SwapIn a sequence on the device", lambda: c.swap_in([seq_id]), FP, str(seq_id)),
        ("LookupPrefix a token id above the vocabulary", lambda: c.lookup_prefix([[1, 4000]]), INV, "4000"),
        (
            "Heartbeat an unknown lease",
            lambda: _under_lease(c, "0" * 32, c.heartbeat),
            NF,
            "lease",
        ),
        (
            "Attach with another model's fingerprint",
            lambda: c.attach("x", model_fingerprint="ab" * 32),
            FP,
            "fingerprint",
        ),
    ]


def test_every_rpc_rejects_bad_input_with_a_clear_status_and_changes_no_state(client):
    seq = _alloc(client, [[3] * 20])[0]
    client.commit([(seq.sequence_id, [], 10)])
    swapped = _alloc(client, [[4] * 20])[0]
    client.swap_out([swapped.sequence_id])
    # Earlier tests' clients leave their leases to run out; one expiring mid-loop is a change of
    # state no call made: wait until this client's lease is the only one.
    wait_until(lambda: len(client.get_stats().leases) == 1, 30.0, "earlier tests' leases to run out")
    for name, call, code, fragment in _bad_calls(client, seq.sequence_id, swapped.sequence_id, 64):
        before = stats_without_clock(client.get_stats())
        try:
            call()
        except CacheCallError as e:
            error = e
        else:
            pytest.fail(f"{name}: the call succeeded")
        assert error.code == code, f"{name}: {error.code} {error.details}"
        assert fragment in error.details, f"{name}: {error.details!r} does not name {fragment!r}"
        assert stats_without_clock(client.get_stats()) == before, f"{name} changed the service's state"
    client.swap_in([swapped.sequence_id])


def test_an_unknown_lease_carries_the_lease_expired_reason_and_an_unknown_sequence_none(client):
    # Both are NOT_FOUND; only the lease's carries ErrorInfo(LEASE_EXPIRED), which is what tells
    # a client to Attach again rather than drop one sequence.
    lease_calls = [
        lambda: _under_lease(client, "0" * 32, client.heartbeat),
        lambda: _under_lease(client, "f" * 32, lambda: client.free([1])),
    ]
    for call in lease_calls:
        with pytest.raises(CacheCallError) as lease_error:
            call()
        assert lease_error.value.code == "NOT_FOUND"
        assert "is unknown or expired: call Attach again" in lease_error.value.details
        assert lease_error.value.reason == LEASE_EXPIRED
        assert isinstance(lease_error.value, CacheUnavailable)  # what tells a client to attach again
    with pytest.raises(CacheCallError) as sequence_error:
        client.free([10**9])
    assert sequence_error.value.code == "NOT_FOUND"
    assert sequence_error.value.reason == ""
    assert not isinstance(sequence_error.value, CacheUnavailable)


def test_help_explains_every_flag():
    from kvtier.cachesvc.config import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"flag {action.option_strings} has no help text"
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cachesvc", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0
    for flag in ("--num-blocks", "--block-size", "--swap-space", "--model", "--lease-ttl", "--token-file"):
        assert flag in out.stdout


def test_pool_shape_comes_from_a_model_directory_and_startup_prints_capacity(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 96,
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "num_hidden_layers": 5,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(
        b"\0" * 64
    )  # the service hashes weights' identity, never loads them
    with cache_service(
        tmp_path / "run", "--model", str(model), "--num-blocks", "10", "--block-size", "32"
    ) as svc:
        c = CacheClient.connect(svc.address, TOKEN)
        c.attach("shape")
        assert c.pool.shape == [10, 5, 2, 32, 3, 8]
        assert c.pool.vocab_size == 1000 and c.pool.max_model_len == 512
        assert c.pool.block_bytes == 5 * 2 * 32 * 3 * 8 * 4
        c.close()
        log = svc.log()
    assert "10 blocks x 32 tokens = 320 tokens of capacity" in log


def test_cuda_backend_without_a_gpu_refuses_to_start_with_a_plain_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the cuda backend starts here (covered by test_pool_cuda.py)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cachesvc",
            "--backend",
            "cuda",
            "--listen",
            f"unix://{tmp_path}/c.sock",
        ],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cuda backend" in result.stderr and ("unavailable" in result.stderr or "CuPy" in result.stderr)


def test_prometheus_endpoint_reports_blocks_hits_and_rpc_latency(tmp_path):
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with cache_service(tmp_path, "--num-blocks", "32", "--metrics-port", "0") as svc:
        port = int(re.search(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics", svc.log()).group(1))
        c = CacheClient.connect(svc.address, TOKEN)
        c.attach("metrics")
        seq = c.allocate([[1] * 40])[0]
        c.commit([(seq.sequence_id, [], 40)])
        c.allocate([[1] * 40])  # 32 of 40 tokens hit

        def scrape():
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            samples = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            return samples

        def refreshed():
            s = scrape()
            return s if s.get(("kvtier_cache_prefix_hit_tokens_total", ())) == 32 else None

        samples = wait_until(refreshed, 15.0, "the metrics refresh")
        assert samples[("kvtier_cache_used_blocks", ())] == 4  # 3 + 1: the two hit blocks are shared
        # Two tables of 3 blocks (48 slots each) hold 40 tokens each.
        assert samples[("kvtier_cache_resident_tokens", ())] == 80
        assert samples[("kvtier_cache_slot_waste_ratio", ())] == pytest.approx(1 - 80 / 96)
        assert samples[("kvtier_cache_capacity_blocks", ())] == 32
        assert samples[("kvtier_cache_prefix_query_tokens_total", ())] == 80
        allocate_calls = samples[
            ("kvtier_cache_rpc_duration_seconds_count", (("code", "OK"), ("method", "Allocate")))
        ]
        assert allocate_calls == 2
        c.close()


def test_tcp_with_tls_serves_a_client_that_trusts_the_certificate_and_refuses_plaintext(tmp_path):
    with tls_cache_service(tmp_path, "--num-blocks", "8") as (address, cert, _):
        secure = CacheClient.connect(address, TOKEN, tls_ca=str(cert))
        secure.attach("tls")
        assert secure.pool.num_blocks == 8
        secure.close()
        plain = CacheClient.connect(address, TOKEN, timeout_s=3)
        with pytest.raises(CacheCallError) as e:
            plain.attach("plaintext")
        assert e.value.code == "UNAVAILABLE"
        plain.close()


def test_a_stall_of_the_service_costs_no_heartbeating_client_its_lease(tmp_path):
    # SIGSTOP (a VM pause, a starved process) the cache service for three TTLs: the heartbeats
    # of a live client wait in its socket meanwhile, so the stall is given back to every lease
    # (cachesvc.leases) and that client keeps its lease; a client that went silent still expires.
    with cache_service(tmp_path, "--num-blocks", "16", "--lease-ttl", "1") as svc:
        # A heartbeat sent during the stall waits in the socket and is served when it ends.
        live = CacheClient.connect(svc.address, TOKEN, timeout_s=10.0)
        silent = CacheClient.connect(svc.address, TOKEN, timeout_s=10.0)
        lost: list[Exception] = []
        renewed: list[float] = []
        try:
            live.attach("live")
            (seq,) = live.allocate([[1, 2, 3]])
            stop_beating = live.start_heartbeat_thread(renewed.append, lost.append)
            silent.attach("silent")  # never heartbeats
            svc.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(3.0)  # the stall being injected: three TTLs
            finally:
                svc.proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            wait_until(lambda: lost or any(t > resumed for t in renewed), 20.0, "a heartbeat after the stall")
            assert not lost, f"the live client lost its lease: {lost}"
            assert "stood still for" in svc.log(), svc.log()[-2000:]
            live.extend([(seq.sequence_id, 1)])  # its sequence is still its own
            # The silent lease had under a TTL left when the stall began: it runs out after all.
            stats = wait_until(
                lambda: (s := live.get_stats()).num_expired_leases == 1 and s,
                20.0,
                "the silent lease's expiry",
            )
            assert sorted(lease.client_name for lease in stats.leases) == ["live"]
            assert stats.num_sequences == 1 and not lost
            stop_beating.set()
        finally:
            live.close()
            silent.close()


def test_successful_control_calls_renew_the_lease_without_heartbeats(tmp_path):
    # A replica whose heartbeats are late but whose calls succeed is alive: each call renews.
    with cache_service(tmp_path, "--num-blocks", "16", "--lease-ttl", "1") as svc:
        c = CacheClient.connect(svc.address, TOKEN, timeout_s=5.0)
        try:
            c.attach("busy")  # never heartbeats
            (seq,) = c.allocate([[1, 2, 3]])
            started = time.monotonic()
            while time.monotonic() - started < 3.0:  # three TTLs
                c.extend([(seq.sequence_id, 1)])
                time.sleep(0.2)  # pacing the calls, well inside the 1 s TTL
            assert c.heartbeat() > 0.5
            stats = c.get_stats()
            assert stats.num_expired_leases == 0 and stats.num_sequences == 1
        finally:
            c.close()
