"""KV events in vLLM's wire format over ZMQ: a real cache service, a real CacheClient, and a
subscriber written here from the published schema (plain pyzmq + msgpack; nothing of ours).

Schema (docs/architecture.md, "KV events over ZMQ"): PUB frames ``[topic, seq (8 bytes BE),
payload]``; payload ``[ts, events, data_parallel_rank]``; events ``["BlockStored",
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. Replay: a DEALER sends
``[b"", start_seq]``, gets ``[b"", seq, payload]`` per kept batch, then ``[b"", -1, b""]``.
"""

from __future__ import annotations

import socket
import time

import msgpack
import msgspec
import pytest
import zmq
from servers import TOKEN, cache_service

from kvtier.block_hash import extra_key, hash_full_blocks
from kvtier.cache_client import CacheClient
from kvtier.cachesvc.config import parse_config

BS = 16
TOPIC = b"kv@test-pod@tiny"
END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode(payload: bytes) -> list:
    """A batch as ``[ts, events, data_parallel_rank]``, events as positional lists."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    return batch


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
        (seq,) = client.allocate([tokens]).sequences
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
            if ["BlockStored", [last_probe]] in [e[:2] for e in decode(payload)[1]]:
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
            ts, events, rank = decode(payload)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            for event in events:
                if event[0] == "BlockStored":
                    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = event
                    assert lora_id is None and lora_name is None and medium == "CPU"
                    assert len(token_ids) == len(hashes) * block_size
                    for i, h in enumerate(hashes):
                        assert isinstance(h, bytes) and len(h) == 32
                        stored[h] = (parent, token_ids[i * block_size : (i + 1) * block_size], block_size)
                        parent = h
                else:
                    tag, hashes, medium = event
                    assert tag == "BlockRemoved" and medium == "CPU"
                    assert all(h in stored or h in probe_hashes for h in hashes), (
                        "removed a block never stored"
                    )
                    removed.extend(hashes)

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
        assert decode(everything[0][1])[1] == [["AllBlocksCleared"]]
        assert everything[first_seq:] == live
        assert replay(service.replay_endpoint, seqs[-1] + 1) == []
    finally:
        sub.close(linger=0)
        client.close()


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's KVEventBatch as its array-encoded releases declare it (field order and tags)."""

    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


def test_a_msgspec_decoder_with_vllms_declarations_reads_every_batch(service) -> None:
    client = CacheClient.connect(service.address, TOKEN)
    client.attach("kv-events-msgspec")
    try:
        tokens = [7] * (2 * BS)
        (seq,) = client.allocate([tokens]).sequences
        client.commit([(seq.sequence_id, [], len(tokens))])
        client.free([seq.sequence_id])
        expected = hash_full_blocks(tokens, BS, extra_key(client.pool.model_fingerprint))
    finally:
        client.close()
    decoder = msgspec.msgpack.Decoder(VllmEventBatch)
    deadline = time.monotonic() + 20.0
    while True:  # the publisher thread may not have sent the commit yet
        batches = [decoder.decode(payload) for _, payload in replay(service.replay_endpoint, 0)]
        events = [e for b in batches for e in b.events]
        if any(isinstance(e, VllmBlockStored) and e.block_hashes == expected for e in events):
            break
        assert time.monotonic() < deadline, "the commit's BlockStored was never replayed"
    assert isinstance(events[0], VllmAllBlocksCleared)
    assert all(b.data_parallel_rank == 0 for b in batches)


def test_the_replay_endpoint_needs_the_publisher() -> None:
    assert parse_config([]).kv_events_endpoint is None
    with pytest.raises(SystemExit):
        parse_config(["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"])
