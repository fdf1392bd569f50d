"""The host cache and its area on real tensors: exact round trips under the block manager's own
keys, LRU within the slots, evicted blocks handed back with their bytes, swap's share taken first;
pinned memory and side-stream copies on CUDA (skipped with the reason on CPU). The contract every
tier keeps is tests/test_tier_contract.py's."""

from __future__ import annotations

import pytest
import torch

from kvtier.block_hash import chain_preimages, extra_key, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.events import HOST_REPLACED, split_replaced, tier_kind
from kvtier.cachesvc.host_area import AHEAD_BYTES, MAP_AHEAD_BYTES, SMALL_ROW_BYTES, HostArea
from kvtier.cachesvc.host_cache import HostCache
from kvtier.cachesvc.slot_lru import SlotLru
from kvtier.cachesvc.tiers import Blocks, Job

SHAPE = (8, 2, 2, 16, 2, 8)  # pool: 8 blocks of [2 layers, K/V, 16 tokens, 2 heads, head_dim 8]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: pinned slots and side-stream copies are tested on the GPU machine",
)


def filled_rows(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool as ``[8 blocks, block bytes]`` uint8 whose every element differs."""
    n = torch.Size(SHAPE).numel()
    pool = torch.arange(n, dtype=torch.float32).view(SHAPE).to(device=device, dtype=dtype)
    return pool.view(SHAPE[0], -1).view(torch.uint8)


def load(cache: HostCache, keys, rows, ids) -> int:
    cache.submit_load(Job(1, Blocks(keys, rows, ids)))
    (result,) = cache.finished_jobs()
    return result.num_done


def removed_keys(cache: HostCache) -> list[bytes]:
    """The keys the cache's event records say left it, in order."""
    out = []
    for record in cache.take_events():
        for part in split_replaced(record) if record[0] == HOST_REPLACED else (record,):
            if part[0] == tier_kind(False, "host"):
                out += part[1]
    return out


def test_round_trip_under_the_prefix_index_keys_is_byte_exact():
    rows = filled_rows(dtype=torch.bfloat16)
    manager = BlockManager(8, 16, record_events=False)
    extra = extra_key("model-a", "tenant-salt")
    tokens = list(range(100, 148))  # three full blocks
    ids = manager.allocate(3)
    manager.publish_blocks(ids, [], 0, 3, tokens, extra)
    cache = HostCache(4, rows.shape[1])
    assert cache.submit_store(Blocks([manager.blocks[i].index_key for i in ids], rows, ids)) is None
    expected = rows[ids].clone()
    rows.zero_()
    # The keys a later prompt computes from its token ids find them: 3 of a 4-block prompt.
    prompt_keys = chain_preimages(pack_token_ids([*tokens, *range(16)]), 16, extra, [], 0)
    assert cache.lookup_chain(prompt_keys) == 3
    assert load(cache, prompt_keys, rows, [5, 6, 7, 0]) == 3
    assert torch.equal(rows[5:8], expected)
    assert not rows[0].any()  # the fourth key is not held: nothing copied there
    assert cache.lookup_chain(chain_preimages(pack_token_ids(tokens), 16, extra_key("model-a"), [], 0)) == 0
    c = cache.counts()
    assert (c.blocks, c.bytes, c.promotions, c.hits) == (3, 3 * rows.shape[1], 3, 3)


def test_lru_within_the_slots_hands_evicted_blocks_back_with_their_bytes():
    rows = filled_rows()
    cache = HostCache(3, rows.shape[1])
    keys = [bytes([i]) * 96 for i in range(5)]
    assert cache.submit_store(Blocks(keys[:3], rows, [0, 1, 2]), pass_down=True) is None
    assert cache.touch(keys[0])  # 1 is now the least recently used
    evicted = cache.submit_store(Blocks(keys[3:4], rows, [3]), pass_down=True)
    assert list(evicted.keys) == [keys[1]] and torch.equal(evicted.rows[evicted.row_ids[0]], rows[1])
    assert [k in cache.held() for k in keys] == [True, False, True, True, False]
    # A batch larger than the cache: what goes down is each block's own bytes, never a stale slot.
    fresh = [bytes([10 + i]) * 96 for i in range(4)]
    evicted = cache.submit_store(Blocks(fresh, rows, [4, 5, 6, 7]), pass_down=True)
    assert list(evicted.keys) == [keys[2], keys[0], keys[3], fresh[0]]
    assert torch.equal(evicted.rows, rows[[2, 0, 3, 4]])
    out = torch.zeros_like(rows)
    assert load(cache, fresh[3:], out, [0]) == 1 and torch.equal(out[0], rows[7])
    assert cache.counts().evictions == 5
    cache.check_invariants()


def test_swap_reserves_slots_first_by_giving_up_cached_blocks():
    rows = filled_rows()
    cache = HostCache(4, rows.shape[1])
    keys = [bytes([i]) * 96 for i in range(4)]
    cache.submit_store(Blocks(keys, rows, [0, 1, 2, 3]))
    slots, given_up = cache.reserve(3, pass_down=True)
    assert list(given_up.keys) == keys[:3] and torch.equal(given_up.rows, rows[:3])
    assert cache.counts().blocks == 1 and cache.counts().extra["swap_slots"] == 3
    cache.attach_pool(rows)
    cache.store([7], slots[:1])  # swap copies through the same area
    assert cache.submit_store(Blocks(keys[:1], rows, [0])) is None  # the cache's one slot: key 0, not 3
    assert removed_keys(cache) == [*keys[:3], keys[3]] and cache.counts().blocks == 1
    slots += cache.reserve(1)[0]  # every slot is swap's
    with pytest.raises(ResourceExhausted, match="swap needs 1 slots but only 0 of 4"):
        cache.reserve(1)
    cache.submit_store(Blocks(keys[1:2], rows, [1]))
    assert cache.counts().blocks == 0 and cache.counts().skipped == 1
    cache.check_invariants()
    out = torch.zeros_like(rows)
    cache.attach_pool(out)
    cache.load(slots[:1], [2])
    assert torch.equal(out[2], rows[7])
    cache.release(slots)
    assert cache.counts().extra["free_slots"] == 4
    cache.check_invariants()


def test_a_wrong_row_layout_is_refused_whole():
    rows = filled_rows()
    cache = HostCache(2, rows.shape[1])
    with pytest.raises(InvalidArgument, match=r"need \[num_blocks, \d+\] uint8"):
        cache.submit_store(Blocks([b"k" * 40], rows[:, :-1], [5]))
    assert cache.counts().blocks == 0 and cache.take_events() == []


def _swap_round_trip(device: str, dtype: torch.dtype) -> None:
    """Swap's share of a bare area (no host cache): scattered slots, default-stream writes just before."""
    pool = torch.zeros((12, 2, 2, 16, 2, 8), dtype=dtype, device=device)
    for b in range(12):
        pool[b].fill_(b + 1)
    area = HostArea.for_pool(pool.view(12, -1).view(torch.uint8), 8 * pool[0].nbytes)
    first, _ = area.reserve(2)
    area.store([3, 4], first)
    second, _ = area.reserve(1)
    area.store([7], second)
    area.load(first, [10, 11])
    area.release(first)
    pool[5].fill_(-7)  # queued on the current stream just before the copy: the side stream waits
    pool[9].fill_(-9)
    pool[0].fill_(-3)
    slots, _ = area.reserve(4)  # slots 0, 1, 3, 4
    area.store([5, 9, 0, 1], slots)
    assert sorted(slots) == [0, 1, 3, 4]
    pool[[5, 9, 0, 1]] = 0
    area.load(slots, [2, 6, 8, 5])
    got = [float(pool[b].flatten()[0]) for b in (10, 11, 2, 6, 8, 5)]
    assert got == [4.0, 5.0, -7.0, -9.0, -3.0, 2.0]
    area.release(slots)
    assert area.num_used_blocks == 1 and area.used_slots() == [2]


def test_swap_round_trip_on_cpu_with_scattered_slots():
    _swap_round_trip("cpu", torch.float32)


def test_a_cpu_area_maps_its_pages_ahead_of_its_copies_on_a_thread_keeping_every_byte():
    """The pages of a CPU area are mapped ahead of the copies into them (one kernel call instead of
    a fault per page): a thread keeps them mapped to AHEAD_BYTES past the highest slot copied into,
    never the whole area, while the copies go on (the loop maps MAP_AHEAD_BYTES itself where it
    overtakes the thread); mapping a range (whose first page holds the end of a row already written:
    rows are not whole pages here) changes no byte written before, whoever maps it."""
    row_bytes = 3 * 4096 + 40  # over SMALL_ROW_BYTES: a memoryview copy per row
    step, ahead = MAP_AHEAD_BYTES // row_bytes, AHEAD_BYTES // row_bytes
    area = HostArea(2 * ahead, row_bytes)
    pool = torch.randint(0, 256, (64, row_bytes), dtype=torch.uint8)
    area.attach_pool(pool)
    assert area.mapped == 0
    written: dict[int, int] = {}  # slot -> pool row
    for first in range(0, 2 * step + 10, 61):  # batches across the steps' boundaries
        slots = list(range(first, min(first + 61, 2 * step + 10)))
        ids = [(s * 7) % 64 for s in slots]
        area.copy_rows(slots, ids)
        written.update(zip(slots, ids, strict=True))
        assert max(slots) < area.mapped <= max(slots) + 1 + ahead  # mapped before the copy
    area._mapper.join(timeout=60)
    last = 2 * step + 10  # the slots copied into: [0, last)
    assert last + ahead // 2 <= area.mapped <= last + ahead  # the thread's window, topped up at half
    far = area.mapped + 5  # one row past the mapped pages: the loop maps up to it
    area.copy_row(far, 9)
    written[far] = 9
    assert far < area.mapped
    area._mapper.join(timeout=60)
    assert area.mapped == area.num_slots  # the window past `far` is past the area: never beyond it
    for slot, i in written.items():
        assert torch.equal(area.slots[slot], pool[i]), slot


@pytest.mark.cuda
@needs_cuda
def test_cuda_area_is_pinned_and_copies_on_a_side_stream():
    area = HostArea(2, 1024, device="cuda")
    assert area.slots.is_pinned() and area.stream is not None and area.stream != torch.cuda.current_stream()
    _swap_round_trip("cuda", torch.bfloat16)
    _swap_round_trip("cuda", torch.float16)


@pytest.mark.cuda
@needs_cuda
def test_cuda_cache_sees_writes_queued_just_before_it():
    pool = torch.zeros((64, 4, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    rows = pool.view(64, -1).view(torch.uint8)
    cache = HostCache(64, rows.shape[1], device="cuda")
    for _ in range(3):  # a long queue of default-stream work ahead of the copy
        pool.mul_(1.0).add_(1.0)
    keys = [i.to_bytes(2, "little") * 48 for i in range(64)]
    cache.submit_store(Blocks(keys, rows, range(64)))
    pool.zero_()
    assert load(cache, keys, rows, [63 - i for i in range(64)]) == 64
    assert torch.all(pool == 3.0)  # read on the default stream right after the call returned


def test_slot_lru_takes_the_least_recently_used_past_touched_and_removed_places():
    """The host cache's LRU (cachesvc.slot_lru): touches and removals leave stale places behind;
    taking the oldest skips them, and the order stays exact through compaction and rebuilds."""
    lru = SlotLru()
    keys = [bytes([k]) * 8 for k in range(6)]
    lru.add(keys[:4], [10, 11, 12, 13])
    lru.touch(keys[0])  # 1 is now the least recently used
    assert lru.remove(keys[2]) == 12 and lru.remove(keys[2]) is None
    lru.add(keys[4:], [14, 15])
    assert lru.oldest_first() == [keys[1], keys[3], keys[0], keys[4], keys[5]]
    assert lru.pop_oldest(3) == ([keys[1], keys[3], keys[0]], [11, 13, 10])
    lru.add([keys[2]], [12])  # back after its removal: its old place stays skipped
    assert lru.pop_oldest(2) == ([keys[4], keys[5]], [14, 15]) and lru.oldest_first() == [keys[2]]
    # Many touches and no evictions: the order is rebuilt, not grown without bound.
    many = [k.to_bytes(4, "little") for k in range(3000)]
    lru.add(many, list(range(100, 3100)))
    for _ in range(2):
        for key in many[:1500]:
            lru.touch(key)
    assert len(lru._order) - lru._head <= 2 * len(lru) + 1024 + 1  # live places + at most that many stale
    assert lru.oldest_first() == [keys[2], *many[1500:], *many[:1500]]
    got, slots = lru.pop_oldest(len(lru))
    assert got == [keys[2], *many[1500:], *many[:1500]] and slots == [
        12,
        *range(1600, 3100),
        *range(100, 1600),
    ]
    assert len(lru) == 0


@pytest.mark.parametrize("max_batch", [9, 1])
@pytest.mark.parametrize("row", [8, SMALL_ROW_BYTES + 8])
def test_random_operations_keep_the_lru_order_the_victims_and_the_bytes_of_a_plain_model(max_batch, row):
    """Stores (the bound-rows path, and with evictions handed back) / loads / touches / discards /
    swap's reserve and release in a random order, against a plain OrderedDict model of what the
    cache holds and in which order: the keys held (least recently used first), the blocks that
    left it (its event records; handed back with their bytes when asked) and every held block's
    bytes agree after each step. Stores of up to ``max_batch`` blocks (1: Extend's single
    evictions, keep_rows' one-block path into a full cache); rows of ``row`` bytes (both of the
    area's copies: numpy items, memoryview slices)."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    num_slots = 6
    rows = torch.arange(32 * row, dtype=torch.int64).remainder(251).to(torch.uint8).view(32, row)
    cache = HostCache(num_slots, row)
    model: OrderedDict[bytes, int] = OrderedDict()  # key -> the pool row its bytes came from
    model_removed: list[bytes] = []
    swap: list[int] = []
    seen_removed: list[bytes] = []

    def evict_oldest(n: int) -> list[bytes]:
        gone = [model.popitem(last=False)[0] for _ in range(n)]
        model_removed.extend(gone)
        return gone

    for _ in range(400):
        op = rng.choice(["rows", "down", "load", "touch", "discard", "take", "release"])
        if op in ("rows", "down"):
            picked = rng.sample(range(32), rng.randint(1, max_batch))
            keys = [bytes([i]) * 40 for i in picked]
            evicted = cache.submit_store(Blocks(keys, rows, picked), pass_down=op == "down")
            new = [(k, i) for k, i in zip(keys, picked, strict=True) if k not in model]
            for k in keys:
                if k in model:
                    model.move_to_end(k)
            gone: list[bytes] = []
            while new and num_slots - len(swap) > 0:  # rounds of the room there is
                batch, new = new[: num_slots - len(swap)], new[num_slots - len(swap) :]
                gone += evict_oldest(max(0, len(model) + len(batch) - (num_slots - len(swap))))
                model.update(batch)
            if op == "down":
                assert list(evicted.keys if evicted else []) == gone
                for k, key in enumerate(gone):
                    assert torch.equal(evicted.rows[evicted.row_ids[k]], rows[key[0]])
        elif op in ("load", "touch"):
            key = bytes([rng.randrange(32)]) * 40
            out = torch.zeros((1, row), dtype=torch.uint8)
            held = load(cache, [key], out, [0]) == 1 if op == "load" else cache.touch(key)
            assert held == (key in model)
            if held:
                model.move_to_end(key)
                assert op == "touch" or torch.equal(out[0], rows[model[key]])
        elif op == "discard":
            key = bytes([rng.randrange(32)]) * 40
            held = model.pop(key, None) is not None
            assert cache.discard(key) == held
            model_removed.extend([key] if held else [])
        elif op == "take" and len(swap) < num_slots:
            n = rng.randint(1, num_slots - len(swap))
            swap += cache.reserve(n)[0]
            evict_oldest(max(0, len(model) + len(swap) - num_slots))
        elif op == "release" and swap:
            cache.release([swap.pop()])
        seen_removed += removed_keys(cache)
        assert cache.oldest_first() == list(model) and seen_removed == model_removed
        for key, i in model.items():
            assert torch.equal(cache.slots[cache._entries.slots[key]], rows[i])
        cache.check_invariants()
