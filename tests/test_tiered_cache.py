"""The tiered prefix cache wired into the cache service (issue 22), as a real subprocess with a
real disk directory: published blocks evicted from the pool go to the host cache and the disk,
a later Allocate promotes them byte-exact, a SIGKILL mid-load and a restart serve only whole,
verified records, and another tenant salt or pool layout never hits them."""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import torch
from servers import TOKEN, ModuleLoop, cache_service, cache_stats, greedy_request, local_stack, wait_until
from test_kv_events_zmq import decode, free_port, replay

from kvtier.block_hash import extra_key, hash_preimage, pack_token_ids
from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.cachesvc.disk_records import file_name
from kvtier.cli.stack import wait_serving
from kvtier.compute_client import ComputeClient
from kvtier.model_spec import ModelShape
from kvtier.pool import attach_pool

BS = 16
SHAPE = ModelShape.tiny()
BLOCK_BYTES = SHAPE.block_bytes(BS, "float32")
NUM_BLOCKS = 6  # the pool: a prompt of 3 full blocks + 1 token takes 4
HOST_GIB = 2 * BLOCK_BYTES / 2**30  # the host cache holds two blocks
FLUSH_S = 60.0  # deadline for the disk writer to land a record


def prompt(seed: int) -> list[int]:
    """3 full blocks + 1 token of seeded token ids (the hit is capped at the 3 full blocks)."""
    rng = random.Random(seed)
    return [rng.randrange(SHAPE.vocab_size) for _ in range(3 * BS + 1)]


def index_keys(tokens: list[int], fingerprint: str = SHAPE.fingerprint) -> list[bytes]:
    """The prefix-index key of each full block of ``tokens`` (``parent || token bytes``)."""
    parent, data, step = extra_key(fingerprint), pack_token_ids(tokens), 4 * BS
    keys = []
    for b in range(len(tokens) // BS):
        keys.append(parent + data[b * step : (b + 1) * step])
        parent = hash_preimage(keys[-1])
    return keys


def record_paths(disk: Path, tokens: list[int], fingerprint: str = SHAPE.fingerprint) -> list[Path]:
    """The record file each full block of ``tokens`` would have (its index key's hash, hex)."""
    return [disk / file_name(key) for key in index_keys(tokens, fingerprint)]


def tier_events(client: Client, until) -> dict[tuple[str, str], list[bytes]]:
    """WatchEvents from 0 as ``{(kind, medium): [block hash, ...]}`` (kind: BlockStored or
    BlockRemoved), read until ``until(that)`` holds (the disk's events are logged by the next call
    or the lease reaper's sweep)."""
    seen: dict[tuple[str, str], list[bytes]] = {}
    stream = client.c.watch_events(0, timeout_s=FLUSH_S)
    for _, event in stream:
        seen.setdefault((type(event).__name__, event.medium), []).append(event.block_hash)
        if until(seen):
            break
    stream.cancel()
    return seen


def zmq_events(endpoint: str) -> dict[tuple[str, str], list[bytes]]:
    """The ZMQ replay's events from seq 0 as ``{(tag, medium): [block hash, ...]}``."""
    seen: dict[tuple[str, str], list[bytes]] = {}
    for _, payload in replay(endpoint, 0):
        for event in decode(payload).events:  # vLLM's own structs
            tag = type(event).__name__
            if tag == "AllBlocksCleared":  # the startup batch
                continue
            seen.setdefault((tag, event.medium), []).extend(event.block_hashes)
    return seen


class Client:
    """A leased client of the service and its mapping of the pool."""

    def __init__(self, svc) -> None:
        self.c = CacheClient.connect(svc.address, TOKEN, timeout_s=30.0)
        self.c.attach("tiers")
        self.pool = attach_pool(self.c.pool)
        assert self.c.pool.size_bytes // NUM_BLOCKS == BLOCK_BYTES

    def publish(self, tokens: list[int], seed: int) -> list[float]:
        """Allocate ``tokens``, write a distinct value into each full block, commit and free them;
        the values written, per full block."""
        (seq,) = self.c.allocate([tokens])
        fills = [seed + 0.25 * b for b in range(3)]
        for block_id, fill in zip(seq.block_table, fills, strict=False):
            self.pool.tensor[block_id] = fill
        self.c.commit([(seq.sequence_id, [], 3 * BS)])
        self.c.free([seq.sequence_id])
        return fills

    def hit(self, tokens: list[int], fills: list[float] | None = None, salt: str = "") -> int:
        """Allocate ``tokens`` (tenant ``salt``), check the cached blocks hold ``fills``, free;
        the cached tokens."""
        (seq,) = self.c.allocate([AllocateItem(tokens, tenant_salt=salt)])
        n = seq.num_cached_tokens // BS
        for b in range(n):
            assert fills is not None and torch.all(self.pool.tensor[seq.block_table[b]] == fills[b]), (
                f"block {b} of a promoted prefix does not hold the bytes written"
            )
        self.c.free([seq.sequence_id])
        return seq.num_cached_tokens

    def flush_pool(self) -> None:
        """Take every pool block once (unpublished), so every published block is evicted."""
        (seq,) = self.c.allocate([[1] * (NUM_BLOCKS * BS)])
        self.c.free([seq.sequence_id])

    def close(self) -> None:
        self.pool.close()
        self.c.close()


def tier_args(disk: Path, *more: str) -> list[str]:
    return [
        "--num-blocks", str(NUM_BLOCKS), "--swap-space", "0", "--host-cache-gib", str(HOST_GIB),
        "--disk-path", str(disk), "--disk-write-policy", "through", "--lease-ttl", "30", *more,
    ]  # fmt: skip


def test_evicted_prefixes_come_back_from_host_and_disk_and_survive_a_sigkill(tmp_path):
    disk = tmp_path / "kv-disk"
    a = prompt(1)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    zmq_args = ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    zmq_args += ["--kv-events-replay-endpoint", replay_endpoint]
    with cache_service(tmp_path, *tier_args(disk, *zmq_args)) as svc:
        client = Client(svc)
        fills_a = client.publish(a, 1)
        # a's blocks are evicted last to first: the host keeps blocks 0 and 1, all three reach the disk
        client.flush_pool()  # the disk tier counts a record once it is durable (its file is renamed before)
        wait_until(
            lambda: client.c.get_stats().tiers[2].num_blocks == 3, FLUSH_S, "a's records in the disk tier"
        )
        assert all(p.exists() for p in record_paths(disk, a))
        [hit] = client.c.lookup_prefix([a])  # per tier (per medium of kvtier.media), read-only
        assert (hit.num_cached_tokens, hit.below["host"], hit.below["disk"]) == (0, 2 * BS, BS), hit
        assert hit.total == 3 * BS, hit  # no other medium holds any
        assert client.hit(a, fills_a) == 3 * BS  # blocks 0-1 from the host, block 2 from disk
        [hit] = client.c.lookup_prefix([a])
        assert (hit.num_cached_tokens, hit.total) == (3 * BS, 3 * BS), hit
        device, host, on_disk = client.c.get_stats().tiers
        assert [t.medium for t in (device, host, on_disk)] == ["device", "host", "disk"]
        assert (device.num_promotions, host.num_hit_blocks, on_disk.num_hit_blocks) == (3, 2, 1)
        assert device.num_evictions == 3 and device.num_hit_blocks == 0
        assert (host.num_blocks, host.num_bytes, host.num_stored_blocks) == (2, 2 * BLOCK_BYTES, 3)
        assert on_disk.num_stored_blocks == on_disk.num_blocks == 3 and on_disk.write_queue_depth == 0
        stream = client.c.watch_events(0)  # a's first publication, its eviction, its promotion
        kinds = [(type(e).__name__, e.medium) for _, (_, e) in zip(range(6), stream, strict=False)]
        stream.cancel()
        assert kinds == [("BlockStored", "device")] * 3 + [("BlockRemoved", "device")] * 3, kinds
        assert client.hit(a, fills_a, salt="other-tenant") == 0

        # Per tier: a's blocks entered the host (block 2 left it again, for block 0) and the
        # disk; WatchEvents and a ZMQ consumer see each with its medium.
        hashes = [hash_preimage(key) for key in index_keys(a)]
        seen = tier_events(client, lambda seen: len(seen.get(("BlockStored", "disk"), [])) >= 3)
        assert sorted(seen[("BlockStored", "host")]) == sorted(hashes), seen
        assert seen[("BlockRemoved", "host")] == [hashes[2]], seen
        assert sorted(seen[("BlockStored", "disk")]) == sorted(hashes), seen
        published = zmq_events(replay_endpoint)
        assert sorted(published[("BlockStored", "STORAGE")]) == sorted(hashes), published
        assert hashes[2] in published[("BlockRemoved", "CPU")]  # the host's (a CPU pool's is CPU too)

        # A write-heavy load: every prompt published evicts the previous one to host and disk.
        load = {seed: prompt(seed) for seed in range(2, 40)}
        fills = {}
        for seed, tokens in load.items():
            fills[seed] = client.publish(tokens, seed)
            if seed == 6:  # the two records damaged below are whole before the kill
                wait_until(
                    lambda: (
                        record_paths(disk, load[2])[0].exists() and record_paths(disk, load[3])[0].exists()
                    ),
                    FLUSH_S,
                    "records of prompts 2 and 3",
                )
        client.flush_pool()
        client.close()
        svc.stop(signal.SIGKILL)

        corrupt, torn = record_paths(disk, load[2])[0], record_paths(disk, load[3])[0]
        data = bytearray(corrupt.read_bytes())
        data[-100] ^= 0xFF  # a payload byte: only the checksum can tell
        corrupt.write_bytes(bytes(data))
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
        # What a restart may serve: per prompt, its leading whole records (a torn write never
        # is one: records are renamed into place).
        leading = {
            seed: next((b for b, p in enumerate(record_paths(disk, t)) if not p.exists()), 3)
            for seed, t in load.items()
            if seed not in (2, 3)
        }

        svc.restart()
        wait_serving(svc)
        log = svc.log()
        assert f"dropped {corrupt.name}" in log and f"dropped {torn.name}" in log, log[-3000:]
        client = Client(svc)
        # The records found are announced as stored on disk: a follower of the events (a vLLM
        # engine's block index) knows what the restarted service holds there.
        disk_blocks = next(t.num_blocks for t in client.c.get_stats().tiers if t.medium == "disk")
        batches = client.c.watch_event_batches(0, omit_token_ids=True, timeout_s=30)
        announced, caught_up = next(batches)
        batches.cancel()
        assert caught_up and len(announced) == disk_blocks > 0, (len(announced), disk_blocks)
        assert {(type(e.event).__name__, e.event.medium) for e in announced} == {("BlockStored", "disk")}
        assert client.hit(a, fills_a) == 3 * BS  # from disk after the restart
        assert client.hit(load[2]) == 0 and client.hit(load[3]) == 0
        hits = {seed: client.hit(load[seed], fills[seed]) // BS for seed in leading}
        assert hits == leading  # every whole record served, byte-exact, nothing else
        assert sum(hits.values()) >= 3, f"the repeated workload hit nothing from disk: {hits}"

        # Swap shares the host cache's two slots, swap first: a swap-out evicts cached blocks.
        (seq,) = client.c.allocate([[7] * (2 * BS)])
        for k, block_id in enumerate(seq.block_table):
            client.pool.tensor[block_id] = 3.5 + k
        client.c.swap_out([seq.sequence_id])
        stats = client.c.get_stats()
        assert (stats.num_host_blocks_total, stats.num_host_blocks_used, stats.tiers[1].num_blocks) == (
            2,
            2,
            0,
        )
        (back,) = client.c.swap_in([seq.sequence_id]).sequences
        assert [float(client.pool.tensor[b].flatten()[0]) for b in back.block_table] == [3.5, 4.5]
        assert client.c.get_stats().num_host_blocks_used == 0
        client.c.free([seq.sequence_id])
        client.close()

    # Another model fingerprint, dtype or block size never hits these records (each on a copy:
    # a record of another layout is dropped at the scan).
    for k, other in enumerate(
        (["--model-fingerprint", "another-model"], ["--kv-cache-dtype", "float16"], ["--block-size", "32"])
    ):
        copy = tmp_path / f"copy-{k}"
        shutil.copytree(disk, copy)
        run_dir = tmp_path / f"run-{k}"
        run_dir.mkdir(mode=0o700)
        with cache_service(run_dir, *tier_args(copy, *other)) as svc:
            c = CacheClient.connect(svc.address, TOKEN, timeout_s=30.0)
            c.attach("other-layout")
            (seq,) = c.allocate([a])
            assert seq.num_cached_tokens == 0, other
            c.close()


def test_blocks_the_disk_queue_skips_are_counted_in_get_stats_and_the_metrics(tmp_path):
    """Issue 31: evictions faster than the disk writer (a 1-block write queue, no host cache) skip
    writes; each skipped block is counted in GetStats' disk row and in
    kvtier_cache_tier_skipped_blocks_total, never silent, and every block offered is either
    written or counted."""
    import re

    from test_compute_metrics import scrape

    disk = tmp_path / "kv-disk"
    more = (
        "--host-cache-gib",
        "0",
        "--disk-write-queue",
        "1",
        "--disk-write-policy",
        "evict",
        "--metrics-port",
        "0",
    )
    with cache_service(tmp_path, *tier_args(disk, *more)) as svc:
        client = Client(svc)
        for seed in range(10):  # each round evicts the last prompt's 3 blocks in one Allocate
            client.publish(prompt(seed), seed)
            client.flush_pool()

        def settled():
            (row,) = [t for t in client.c.get_stats().tiers if t.medium == "disk"]
            return row if row.num_stored_blocks + row.num_skipped_blocks == 30 else None

        row = wait_until(settled, FLUSH_S, "every evicted block written or counted as skipped")
        assert row.num_skipped_blocks > 0 and row.write_queue_depth == 0, row
        port = int(re.search(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics", svc.log()).group(1))
        series = ("kvtier_cache_tier_skipped_blocks_total", (("medium", "disk"),))
        wait_until(lambda: scrape(port).get(series) == row.num_skipped_blocks, 15.0, "the metrics refresh")
        client.close()


LOOP = ModuleLoop()


def complete(addresses: list[str], requests) -> list:
    """Send ``requests`` one after the other through one client."""

    async def complete_all() -> list:
        client = ComputeClient(addresses, TOKEN)
        try:
            return [await client.complete(r) for r in requests]
        finally:
            await client.close()

    return LOOP.run(complete_all())


def test_greedy_tokens_from_promoted_blocks_equal_a_run_that_computed_them(tmp_path):
    """Compute reads promoted blocks as ordinary cached ones: the same greedy tokens as the
    first run, which computed every prompt token (a pool that never evicts would serve the same)."""
    rng = random.Random(5)
    long_prompt = [rng.randrange(256) for _ in range(6 * BS + 4)]
    fillers = [[rng.randrange(256) for _ in range(14 * BS)] for _ in range(3)]
    cache_args = [*tier_args(tmp_path / "kv-disk"), "--num-blocks", "24"]  # the last --num-blocks wins
    with local_stack(tmp_path / "run", cache_args=cache_args, replicas=1) as stack:
        (first,) = complete(stack.compute_addresses, [greedy_request(long_prompt, 8)])
        assert first.cached_prompt_tokens == 0
        complete(stack.compute_addresses, [greedy_request(f, 1) for f in fillers])  # evict it
        (again,) = complete(stack.compute_addresses, [greedy_request(long_prompt, 8)])
        tiers = {t.medium: t for t in cache_stats(stack).tiers}
    assert again.cached_prompt_tokens == 6 * BS  # every full block, promoted from host or disk
    assert tiers["device"].num_promotions >= 6, tiers
    assert again.token_ids == first.token_ids
