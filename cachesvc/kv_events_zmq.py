"""Block events in vLLM's KV-event wire format over ZMQ (``--kv-events-endpoint``).

A second way out for what ``EventLog`` numbers for ``WatchEvents``: routers and cache managers
written against vLLM's KV-event publisher (llm-d's kv-cache manager, Dynamo, ...) subscribe to
the cache service as they would to a vLLM engine. The wire format (docs/architecture.md,
"KV events over ZMQ"):

- PUB, multipart ``[topic, seq (8 bytes, big-endian), payload]``, one message per batch; ``seq``
  counts batches from 0, with a gap only where batches were dropped (queue full).
- ``payload`` is msgpack of ``[ts, events, data_parallel_rank]`` (an array), each event a map
  tagged by its ``type``, as vLLM's msgspec ``KVCacheEvent`` structs encode (``tag=True``,
  ``omit_defaults=True``; what llm-d, Dynamo and SGLang read): ``{"type": "BlockStored",
  "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
  "lora_name"[, "extra_keys"]}``, ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
  ``{"type": "AllBlocksCleared"}``. ``--kv-events-format array`` sends each event as the
  positional array of older releases (``array_like=True``): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name[, extra_keys]]``, ...
- A chain's first block carries its tenant salt as vLLM carries a request's ``cache_salt``:
  ``extra_keys`` holds one entry per block of the event, ``[salt]`` for the chain's first
  block and None for the others; an unsalted event has no ``extra_keys``.
- ROUTER (``--kv-events-replay-endpoint``): a DEALER sends ``[b"", start_seq (8 bytes BE)]`` and
  gets ``[b"", seq, payload]`` for every kept batch with ``seq >= start_seq``, then
  ``[b"", seq = -1 (8 bytes BE, signed), b""]``.

Block hashes are our 32-byte chain values (``kvtier.block_hash``), not vLLM's; ``token_ids`` are
always sent so a consumer can compute its own keys.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgpack
import zmq

from kvtier.cachesvc.events import (
    HOST_REPLACED,
    REMOVED,
    STORED,
    EventRecord,
    lower_tier_blocks,
    split_replaced,
)
from kvtier.media import MEDIA

log = logging.getLogger("kvtier.cache")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence number of the replay's end marker."""

_STOP = object()


ZMQ_MEDIUMS = tuple(m.kv_event_medium for m in MEDIA)
"""vLLM's medium per ``events.MEDIUMS`` entry; the device's is the publisher's (GPU, or CPU for a CPU pool)."""


FORMATS = ("map", "array")
"""``--kv-events-format``: tagged maps (vLLM today), or positional arrays (older releases)."""

SaltOf = Callable[[bytes], str | None]
"""A chain's tenant salt from its extra key (``ExtraKeys.salt_of``); None for anything else."""


def block_stored(
    hashes: list, parent: bytes | None, token_ids: list[int], block_size: int, medium: str, salt: str | None
) -> dict:
    """vLLM's BlockStored as a tagged map, its fields in vLLM's order; ``salt`` (of a run that
    starts its chain) becomes the first block's extra key."""
    # lora_id (deprecated in vLLM) and lora_name: adapters enter our chain through its root
    # (extra_key), so neither is needed to read the hashes; both stay None.
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    if salt:
        event["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    return event


def block_removed(hashes: list, medium: str) -> dict:
    """vLLM's BlockRemoved as a tagged map."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def as_array(event: dict) -> list:
    """An event in the positional form of vLLM's ``array_like`` structs: tag, then the fields in
    order (a map holds exactly the fields that form sends: trailing defaults are left out)."""
    return list(event.values())


def encode_record(
    record: EventRecord, block_size: int, medium: str, salt_of: SaltOf | None = None
) -> list[dict]:
    """The vLLM events (tagged maps) one EventRecord stands for; ``medium`` is the device's (a
    host or disk tier's record names its own). ``salt_of`` names a chain's tenant salt from its
    extra key (None: no salts in the events).

    A device STORED record is a run of consecutive blocks of one chain: one BlockStored carries
    all of them, ``token_ids`` being the tokens of every block in order (as vLLM's does). A lower
    tier's STORED record is a BlockStored per block (each with its own parent).
    """
    if record[0] == HOST_REPLACED:  # the host's REMOVED record, then its STORED one
        halves = split_replaced(record)
        return [event for half in halves for event in encode_record(half, block_size, medium, salt_of)]
    medium = ZMQ_MEDIUMS[record[0] >> 1] or medium
    if record[0] > STORED:  # a lower tier's: one BlockStored per block (each names its parent)
        blocks = lower_tier_blocks(record)
        if record[0] & 1 == REMOVED:
            return [block_removed([h for h, _, _, _ in blocks], medium)]
        events = []
        for h, prefix, _, t in blocks:
            # A key's prefix is its parent's hash, or the chain's extra key for a first block.
            salt = salt_of(prefix) if salt_of is not None else None
            parent = None if salt is not None else prefix
            events.append(block_stored([h], parent, _token_ids(t, 1, block_size), block_size, medium, salt))
        return events
    if record[0] & 1 == REMOVED:
        return [block_removed(list(record[1]), medium)]
    _, hashes, _block_ids, token_bytes, parent = record[:5]
    # A device record's sixth item is its chain's extra key (cachesvc.events).
    root = parent is None and salt_of is not None and len(record) > 5
    salt = salt_of(record[5]) if root else None
    token_ids = _token_ids(token_bytes, len(hashes), block_size)
    return [block_stored(list(hashes), parent, token_ids, block_size, medium, salt)]


def _token_ids(token_bytes: bytes, num_blocks: int, block_size: int) -> list[int]:
    """The token ids of ``num_blocks`` blocks in ``pack_token_ids`` form."""
    return list(struct.unpack_from(f"<{num_blocks * block_size}i", token_bytes))


def encode_batch(ts: float, events: list, data_parallel_rank: int | None = 0) -> bytes:
    """msgpack of a KVEventBatch: ``[ts, events, data_parallel_rank]`` (an array in both formats)."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


class KvEventsPublisher:
    """Publishes the node's event records as vLLM KV-event batches; replays kept batches.

    ``__call__(records)`` is an ``EventLog`` sink: it runs on the service's asyncio loop and only
    enqueues. A daemon thread owns both sockets: it encodes, numbers, sends and keeps the newest
    ``buffer_batches`` payloads for replay. ``event_format`` is one of FORMATS; ``salt_of``
    (called from that thread) names the tenant salt of a chain's extra key.
    """

    # NOTE: a thread with a queue, as vLLM's publisher has, rather than NOBLOCK sends on the
    # loop: encoding a commit's token lists costs microseconds per block that RPCs should not
    # wait for, and the ROUTER needs a reader anyway, which a blocking poll in a thread gives
    # without a timer on the loop. Records are immutable tuples, so handing them over is safe.

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        medium: str = "GPU",
        event_format: str = "map",
        salt_of: SaltOf | None = None,
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        if event_format not in FORMATS:
            raise ValueError(f"KV event format {event_format!r}: one of {', '.join(FORMATS)}")
        self.block_size = block_size
        self.medium = medium
        self.array = event_format == "array"
        self.salt_of = salt_of
        self.topic = topic.encode("utf-8")
        self.num_dropped = 0  # batches refused because the queue was full
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._dropped_seen = 0  # num_dropped already turned into skipped numbers
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A ROUTER drops what exceeds its send HWM: leave room for a whole replay.
                self._replay.set_hwm(buffer_batches + 1)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        # A new service holds no block: consumers that knew an earlier one here start over.
        self._queue.put((time.time(), [{"type": "AllBlocksCleared"}]))
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def __call__(self, records: list[EventRecord]) -> None:
        """EventLog sink: queue one batch holding the events of ``records`` (from one call)."""
        try:
            self._queue.put_nowait((time.time(), records))
        except queue.Full:
            # NOTE: dropped rather than blocking the loop. The dropped batches' numbers are
            # skipped (see _send), so subscribers see a gap that no replay fills and know their
            # view went stale. Only the loop writes num_dropped, only the publisher thread reads it.
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("kv events: queue full, %d batches dropped so far", self.num_dropped)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("kv events: publisher thread still busy after %.1fs; closing anyway", timeout_s)
            return  # the daemon thread owns the sockets; the process exit reclaims them
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------ the publisher thread

    def _encode(self, ts: float, records: Iterable) -> bytes:
        # A record is an EventRecord (kind int first) or, for the startup batch, an event already.
        events = []
        for record in records:
            if isinstance(record, dict):
                events.append(record)
            else:
                events += encode_record(record, self.block_size, self.medium, self.salt_of)
        return encode_batch(ts, [as_array(e) for e in events] if self.array else events)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.05 if self._replay is not None else None)
                except queue.Empty:
                    continue
                if item is _STOP:
                    return
                self._send(*item)
        except Exception:
            log.exception("kv events: publisher thread failed; no more events are published")

    def _send(self, ts: float, records: list) -> None:
        payload = self._encode(ts, records)
        dropped = self.num_dropped
        seq = self._next_seq + dropped - self._dropped_seen
        self._dropped_seen = dropped
        self._next_seq = seq + 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: malformed replay request of %d frames ignored", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))
