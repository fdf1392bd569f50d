"""The tiers below the device together (cachesvc/lower_tiers.py's TierStack, one loop): blocks
evicted from a pool of rows go to the host cache and on down to the disk, come back byte-exact,
under both write policies, the reuse gate and the flags; swap's share of the host area gives up
cached blocks down the same loop; and bench/tiers.py's replay through the real block manager, small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_disk_tier import FLUSH_S, LAYOUT, key_of, open_tier, payload_of

from kvtier.cachesvc.disk_records import file_name
from kvtier.cachesvc.host_cache import HostCache
from kvtier.cachesvc.lower_tiers import TierStack


def pool_rows(n: int = 8) -> torch.Tensor:
    """A pool of ``n`` rows whose row i holds ``payload_of(i)``."""
    return torch.stack([torch.frombuffer(bytearray(payload_of(i)), dtype=torch.uint8) for i in range(n)])


def lower_tiers(tmp_path: Path, host_slots: int, policy: str = "evict", min_hits: int = 0):
    pool = pool_rows()
    host = [HostCache(host_slots, LAYOUT.block_bytes)] if host_slots else []
    return pool, TierStack(pool, [*host, open_tier(tmp_path)], policy, min_hits)


def test_host_cache_evictions_reach_the_disk_byte_exact(tmp_path):
    pool, tiers = lower_tiers(tmp_path, 2)
    host, disk = tiers.tiers
    tiers.keep([0, 1, 2, 3], [key_of(i) for i in range(4)])  # 0 and 1 go down
    pool.zero_()  # the pool rows are reused once keep returns
    assert disk.flush(FLUSH_S)
    assert [disk.contains(key_of(i)) for i in range(4)] == [True, True, False, False]
    assert [key_of(i) in host.held() for i in range(4)] == [False, False, True, True]
    assert bytes(disk.load(key_of(0))) == payload_of(0)
    back = torch.zeros(LAYOUT.shape)  # a pool block to promote into
    assert disk.load_into(key_of(1), back) and back.numpy().tobytes() == payload_of(1)
    assert not disk.load_into(key_of(2), back)  # on the host, not on disk
    tiers.close()


def test_offload_min_hits_keeps_only_blocks_hit_often_enough(tmp_path):
    _, tiers = lower_tiers(tmp_path, 4, min_hits=2)
    keys = [key_of(i) for i in range(3)]
    tiers.note_hits([keys[0], keys[1]])
    tiers.note_hits([keys[0]])
    tiers.keep([0, 1, 2], keys)
    assert [tiers.holds(k) for k in keys] == [True, False, False]
    assert tiers.stats()["not_kept_below_min_hits"] == 2
    tiers.note_hits([keys[1]])  # an evicted block starts counting again when it is back
    tiers.keep([1], [keys[1]])
    assert not tiers.holds(keys[1])
    tiers.close()


@pytest.mark.parametrize("host_slots", [2, 0], ids=["host-then-disk", "disk-only"])
def test_evicted_blocks_go_down_the_tiers_and_come_back_byte_exact(tmp_path, host_slots):
    pool, tiers = lower_tiers(tmp_path, host_slots)
    keys = [key_of(i) for i in range(4)]
    tiers.keep([0, 1, 2, 3], keys)  # with a host: 2 held, 2 evicted on to the disk
    disk = tiers.by_name["disk"]
    assert disk.flush(FLUSH_S)
    assert disk.stats()["blocks"] == (2 if host_slots else 4)
    assert tiers.lookup_chain([*keys, key_of(99)]) == 4
    pool[4:].zero_()
    assert tiers.promote([*keys[:2], key_of(99), keys[2]], [4, 5, 6, 7]) == 2  # stops at the miss
    assert tiers.promote(keys[2:], [6, 7]) == 2
    assert [pool[b].numpy().tobytes() for b in (4, 5, 6, 7)] == [payload_of(i) for i in range(4)]
    tiers.close()


def test_write_through_puts_every_kept_block_on_disk_and_a_bad_record_stops_a_promotion(tmp_path):
    pool, tiers = lower_tiers(tmp_path, 4, "through")
    keys = [key_of(i) for i in range(3)]
    tiers.keep([0, 1, 2], keys)
    host, disk = tiers.tiers
    assert disk.flush(FLUSH_S) and disk.stats()["blocks"] == 3
    host.discard(keys[1])  # now only on disk, and that record is damaged
    path = tmp_path / file_name(keys[1])
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    pool[3:].zero_()
    assert tiers.promote(keys, [3, 4, 5]) == 1 and torch.all(pool[4] == 0)
    assert tiers.stats()["disk"]["dropped_on_read"] == 1 and tiers.stats()["host"]["promotions"] == 1
    tiers.close()


def test_lower_tier_flags(tmp_path):
    from kvtier.cachesvc.config import parse_config
    from kvtier.cachesvc.lower_tiers import build

    def flags(*argv: str):  # the service's own parser: every tier's flags
        return parse_config(["--host-cache-gib", "0", "--swap-space", "0", *argv])

    rows = torch.zeros((4, LAYOUT.block_bytes), dtype=torch.uint8)
    assert build(flags(), rows, LAYOUT) == (None, None)
    stack, area = build(flags("--swap-space", "0.001"), rows, LAYOUT)
    assert stack is None and area.num_blocks == 2**30 // 1000 // LAYOUT.block_bytes  # swap's own area
    args = flags(
        "--host-cache-gib",
        "0.001",
        "--disk-path",
        str(tmp_path / "d"),
        "--disk-gib",
        "0.01",
        "--swap-space",
        "1",
    )
    tiers, area = build(args, rows, LAYOUT)
    assert [t.medium.name for t in tiers.tiers] == ["host", "disk"] and area is tiers.by_name["host"]
    assert area.num_slots == 2**30 // 1000 // LAYOUT.block_bytes  # one area: --swap-space is not a second
    assert tiers.by_name["disk"].budget_bytes == int(0.01 * 2**30) and tiers.min_hits == 0
    tiers.close()
    stack, _ = build(flags("--host-cache-gib", "0.001", "--offload-min-hits", "3"), rows, LAYOUT)
    assert stack.min_hits == 3
    with pytest.raises(ValueError, match="--offload-min-hits = -1 must be >= 0"):
        build(flags("--host-cache-gib", "0.001", "--offload-min-hits", "-1"), rows, LAYOUT)
    with pytest.raises(ValueError, match="--host-cache-gib = -1.0 must be >= 0"):
        build(flags("--host-cache-gib", "-1"), rows, LAYOUT)


def test_blocks_evicted_under_pressure_come_back_from_host_and_disk_byte_exact(tmp_path):
    """bench/tiers.py's hit-rate replay, small: the real block manager over a 32-block pool, a
    working set 4x the pool; every promoted block's bytes are checked against what was written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_tiers", Path(__file__).parents[1] / "bench" / "tiers.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rates = bench.hit_rates(bench.workload(120, 32), 32, 4096, tmp_path / "disk")
    assert [v for k, v in rates.items() if k.endswith("_wrong")] == [0] * 7  # 5 systems, 2 bursts
    assert rates["device"] < rates["host"] < rates["disk"] <= rates["ideal"], rates
    assert rates["disk"] >= 0.9 * rates["ideal"] and rates["restart"] >= 0.9 * rates["disk"], rates
    assert rates["disk_stats"]["skipped_writes"] == 0
    assert rates["burst_groups"] > rates["host"], rates  # back to back, the disk still serves


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the tiers under a device pool are tested on the GPU machine",
)
def test_a_cuda_pool_keeps_and_promotes_through_pinned_host_memory_and_disk(tmp_path):
    rows = pool_rows().cuda()
    expected = rows.clone()
    tiers = TierStack(rows, [HostCache(2, LAYOUT.block_bytes, device="cuda"), open_tier(tmp_path)])
    keys = [key_of(i) for i in range(4)]
    tiers.keep([0, 1, 2, 3], keys)  # 2 pinned, 2 on disk
    assert tiers.by_name["disk"].flush(FLUSH_S) and tiers.lookup_chain(keys) == 4
    rows[:4].mul_(0)  # queued on the default stream: the promotions must land after it
    assert tiers.promote(keys, [0, 1, 2, 3]) == 4
    assert torch.equal(rows, expected)
    tiers.close()


def test_allocate_promotes_a_chain_from_the_host_and_a_refused_allocate_changes_nothing():
    """SequenceTable with a host cache: the hook keeps evicted blocks, Allocate promotes a prompt's
    chain past its device hit (capped below the last token) and counts it cached; an Allocate the
    pool cannot hold promotes nothing and leaves the host cache as it was."""
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.errors import ResourceExhausted
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.sequence_types import AllocateItem

    bs, block_bytes = 4, 64
    pool = torch.zeros((4, block_bytes), dtype=torch.uint8)
    host = HostCache(4, block_bytes)
    tiers = TierStack(pool, [host])
    table = SequenceTable(
        BlockManager(4, bs), None, model_fingerprint="fp", vocab_size=100, max_model_len=64, lower_tiers=tiers
    )
    prompt = list(range(10))  # 2 full blocks + 2 tokens: a hit covers at most 2 blocks
    (seq,) = table.allocate("lease", [AllocateItem(prompt)])
    for k, block_id in enumerate(seq.block_table):
        pool[block_id] = k + 1
    table.commit("lease", [(seq.sequence_id, [], 8)])
    table.free("lease", [seq.sequence_id])
    (other,) = table.allocate("lease", [AllocateItem([50 + i for i in range(16)])])  # evicts both
    assert host.counts().blocks == 2 and table.block_manager.num_cached_blocks == 0
    with pytest.raises(ResourceExhausted):
        table.allocate("lease", [AllocateItem(prompt)])
    assert host.counts().promotions == 0 and host.counts().blocks == 2
    table.free("lease", [other.sequence_id])
    (again,) = table.allocate("lease", [AllocateItem(prompt)])
    assert again.num_cached_tokens == 2 * bs and host.counts().promotions == 2
    assert [int(pool[b][0]) for b in again.block_table[:2]] == [1, 2]
    assert table.lookup_prefix([(prompt, "", "")]) == [2 * bs]  # published again: a device hit
    table.check_invariants()


def test_the_host_cache_alone_takes_extend_and_allocate_evictions_straight_from_the_block_manager():
    """The default stack (the host cache alone under a CPU pool) stores through its direct store:
    Extend's one evicted block and Allocate's land byte exact under their keys, and the block
    manager's eviction lists are emptied (reused), so the next eviction stores only its own."""
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.sequence_types import AllocateItem

    bs, block_bytes = 4, 64
    pool = torch.zeros((3, block_bytes), dtype=torch.uint8)
    host = HostCache(8, block_bytes)
    bm = BlockManager(3, bs)
    table = SequenceTable(
        bm,
        None,
        model_fingerprint="fp",
        vocab_size=100,
        max_model_len=64,
        lower_tiers=TierStack(pool, [host]),
    )
    (a,) = table.allocate("lease", [AllocateItem(list(range(8)))])
    for k, block_id in enumerate(a.block_table):
        pool[block_id] = 10 + k
    table.commit("lease", [(a.sequence_id, [], 8)])
    keys = [bm.blocks[b].index_key for b in a.block_table]
    table.free("lease", [a.sequence_id])  # both published, to the queue's tail: the last block first
    (b,) = table.allocate("lease", [AllocateItem([50, 51, 52])])  # the free unpublished block: no eviction
    assert host.counts().stored == 0
    table.extend("lease", [(b.sequence_id, 2)])  # crosses a block boundary: evicts a's last block
    assert host.oldest_first() == keys[1:] and bm.evicted_ids == [] and bm.evicted_keys == []
    table.allocate("lease", [AllocateItem([60, 61, 62])])  # evicts a's first block
    assert host.oldest_first() == [keys[1], keys[0]] and host.counts().stored == 2
    table.free("lease", [b.sequence_id])
    pool.zero_()
    assert table.lower_tiers.promote(keys, [1, 2]) == 2
    assert [int(pool[i][0]) for i in (1, 2)] == [10, 11]


def test_swap_shares_the_host_cache_area_swap_first_and_gives_up_cached_blocks_to_the_disk(tmp_path):
    """Swap's share of the one host area: a swap-out reserves host slots by giving up cached blocks,
    which go down the same loop to the disk byte-exact; a swap-in brings the bytes back and returns
    the slots to the cache; the invariants hold throughout."""
    from kvtier.cachesvc.block_manager import BlockManager
    from kvtier.cachesvc.errors import ResourceExhausted
    from kvtier.cachesvc.sequences import SequenceTable
    from kvtier.sequence_types import AllocateItem

    bs = LAYOUT.block_size
    pool = torch.zeros((4, LAYOUT.block_bytes), dtype=torch.uint8)
    host = HostCache(3, LAYOUT.block_bytes)
    host.attach_pool(pool)
    tiers = TierStack(pool, [host, open_tier(tmp_path)])
    table = SequenceTable(
        BlockManager(4, bs),
        host,
        model_fingerprint="fp",
        vocab_size=100,
        max_model_len=64 * bs,
        lower_tiers=tiers,
    )
    (seq,) = table.allocate("lease", [AllocateItem([k % 100 for k in range(3 * bs)])])  # 3 blocks, published
    for k, block_id in enumerate(seq.block_table):
        pool[block_id] = 30 + k
    table.commit("lease", [(seq.sequence_id, [], 3 * bs)])
    table.free("lease", [seq.sequence_id])
    (other,) = table.allocate("lease", [AllocateItem([50] * (3 * bs + 1))])  # evicts all 3
    assert host.counts().blocks == 3 and table.host_area.num_free_blocks == 3
    for k, block_id in enumerate(other.block_table):
        pool[block_id] = 10 + k
    with pytest.raises(ResourceExhausted, match="swap out needs 4 host blocks but only 3 of 3"):
        table.swap_out("lease", [other.sequence_id])
    assert host.counts().blocks == 3  # a refused swap-out gives up nothing
    table.free("lease", [other.sequence_id])
    (small,) = table.allocate("lease", [AllocateItem([70] * (bs + 1))])  # 2 blocks
    for k, block_id in enumerate(small.block_table):
        pool[block_id] = 20 + k
    assert table.swap_out("lease", [small.sequence_id])[0] == 2
    assert host.counts().blocks == 1 and host.counts().extra["swap_slots"] == 2  # swap first
    disk = tiers.by_name["disk"]
    assert disk.flush(FLUSH_S) and disk.counts().blocks == 2  # the two given up went down, whole
    # The least recently used: freed in reverse table order, the chain's tail left the pool first.
    assert sorted(int(disk.load(k)[0]) for k in list(disk.held())) == [31, 32]
    table.check_invariants()
    host.check_invariants()
    (back,), _, _ = table.swap_in("lease", [small.sequence_id])
    assert [int(pool[b][0]) for b in back.block_table] == [20, 21]
    assert host.counts().extra["swap_slots"] == 0
    table.check_invariants()
    host.check_invariants()
    tiers.close()


def test_host_cache_gib_auto_is_a_share_of_the_memory_available_capped(tmp_path):
    import argparse

    from kvtier.cachesvc.lower_tiers import AUTO_MAX_GIB, add_arguments, auto_host_cache_gib

    meminfo = tmp_path / "meminfo"
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    meminfo.write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {20 * 2**20} kB\n")  # 20 GiB free
    assert auto_host_cache_gib(str(meminfo), str(cgroup)) == pytest.approx(2.0)  # no cgroup files: 10%
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(str(2**30))
    assert auto_host_cache_gib(str(meminfo), str(cgroup)) == pytest.approx(2.0)  # no limit
    (cgroup / "memory.max").write_text(str(9 * 2**30))  # a container: 8 GiB left under its limit
    assert auto_host_cache_gib(str(meminfo), str(cgroup)) == pytest.approx(0.8)
    meminfo.write_text(f"MemAvailable: {500 * 2**20} kB\n")
    (cgroup / "memory.max").write_text("max\n")
    assert auto_host_cache_gib(str(meminfo), str(cgroup)) == AUTO_MAX_GIB  # capped
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args([]).host_cache_gib == 0.0  # off unless asked for
    assert 0 < ap.parse_args(["--host-cache-gib", "auto"]).host_cache_gib <= AUTO_MAX_GIB
