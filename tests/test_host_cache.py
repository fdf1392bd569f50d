"""The host block cache on real tensors: exact round trips under the block manager's own keys, LRU
within the slots, evicted entries handed on with their bytes, swap taking slots first; pinned
memory and side-stream copies on CUDA (skipped with the reason on CPU)."""

from __future__ import annotations

import pytest
import torch
from test_host_tier import needs_cuda  # the same reason printed when it skips

from kvtier.block_hash import chain_preimages, extra_key, pack_token_ids
from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.host_cache import HostBlockCache
from kvtier.cachesvc.host_slots import SMALL_ROW_BYTES
from kvtier.cachesvc.slot_lru import SlotLru

SHAPE = (8, 2, 2, 16, 2, 8)  # pool: 8 blocks of [2 layers, K/V, 16 tokens, 2 heads, head_dim 8]


def filled_pool(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool whose every element differs (block b starts at b * block elements)."""
    n = torch.Size(SHAPE).numel()
    return torch.arange(n, dtype=torch.float32).view(SHAPE).to(device=device, dtype=dtype)


def block_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def test_round_trip_under_the_prefix_index_keys_is_byte_exact():
    pool = filled_pool(dtype=torch.bfloat16)
    manager = BlockManager(8, 16, record_events=False)
    extra = extra_key("model-a", "tenant-salt")
    tokens = list(range(100, 148))  # three full blocks
    ids = manager.allocate(3)
    hashes: list = []
    manager.publish_blocks(ids, hashes, 0, 3, tokens, extra)
    published = [(manager.blocks[i].index_key, hashes[k - 1] if k else None) for k, i in enumerate(ids)]

    cache = HostBlockCache(4, block_bytes(pool))
    assert (
        cache.offer_many([(key, parent, pool[i]) for (key, parent), i in zip(published, ids, strict=True)])
        == 3
    )
    expected = pool[ids].clone()
    pool.zero_()
    # The keys a later prompt computes from its token ids find them: 3 of a 4-block prompt.
    prompt_keys = chain_preimages(pack_token_ids([*tokens, *range(16)]), 16, extra, [], 0)
    assert cache.lookup_chain(prompt_keys) == 3
    assert cache.load_many(prompt_keys, [pool[5], pool[6], pool[7], pool[0]]) == 3
    assert torch.equal(pool[5:8].view(torch.uint8), expected.view(torch.uint8))
    assert torch.all(pool[0] == 0)  # the fourth key is not held: nothing copied there
    assert cache.lookup_chain(chain_preimages(pack_token_ids(tokens), 16, extra_key("model-a"), [], 0)) == 0
    stats = cache.stats()
    assert (stats["blocks"], stats["bytes"], stats["promotions"], stats["hits"]) == (
        3,
        3 * block_bytes(pool),
        3,
        3,
    )


def test_lru_within_the_slots_hands_evicted_entries_on_with_their_bytes():
    pool = filled_pool()
    evicted: list[tuple[bytes, bytes | None, bytes]] = []
    cache = HostBlockCache(
        3, block_bytes(pool), on_evict=lambda k, p, data: evicted.append((k, p, data.numpy().tobytes()))
    )
    keys = [bytes([i]) * 96 for i in range(5)]
    for i in range(3):
        assert cache.offer(keys[i], keys[i - 1][:32] if i else None, pool[i])
    assert cache.touch(keys[0])  # 1 is now the least recently used
    assert cache.offer(keys[3], keys[2][:32], pool[3])
    assert [e[0] for e in evicted] == [keys[1]] and evicted[0][1] == keys[0][:32]
    assert evicted[0][2] == pool[1].numpy().tobytes()
    assert cache.evict(1) == 1 and evicted[-1][0] == keys[2]
    assert [k in cache for k in keys] == [True, False, False, True, False]
    # A batch larger than the cache: what goes down is each block's own bytes, never a stale slot.
    fresh = [bytes([10 + i]) * 96 for i in range(4)]
    assert cache.offer_many([(fresh[i], None, pool[4 + i]) for i in range(4)]) == 4
    assert [e[0] for e in evicted[2:]] == [keys[0], keys[3], fresh[0]]
    assert evicted[-1][2] == pool[4].numpy().tobytes()
    assert cache.load(fresh[3], pool[0]) and torch.equal(pool[0], pool[7])
    assert cache.stats()["evictions"] == 5
    cache.check_invariants()


def test_swap_takes_slots_first_by_evicting_cached_entries():
    pool = filled_pool()
    evicted: list[bytes] = []
    cache = HostBlockCache(4, block_bytes(pool), on_evict=lambda k, p, data: evicted.append(k))
    keys = [bytes([i]) * 96 for i in range(4)]
    assert cache.offer_many([(keys[i], None, pool[i]) for i in range(4)]) == 4
    slots = cache.take_slots(3)
    assert evicted == keys[:3] and len(cache) == 1 and cache.stats()["swap_slots"] == 3
    cache.slots[slots[0]].copy_(pool[7].view(-1).view(torch.uint8))  # swap uses its rows
    assert cache.offer(keys[0], None, pool[0])  # the cache's one slot now holds key 0, not key 3
    assert evicted == [*keys[:3], keys[3]] and len(cache) == 1
    slots += cache.take_slots(1)  # every slot is swap's
    with pytest.raises(ResourceExhausted, match="swap needs 1 slots but only 0 of 4"):
        cache.take_slots(1)
    assert not cache.offer(keys[1], None, pool[1]) and cache.stats()["rejected"] == 1
    assert cache.stats()["swap_slots"] == 4 and len(cache) == 0
    cache.check_invariants()
    cache.release_slots(slots)
    assert cache.stats()["free_slots"] == 4
    assert (
        cache.offer(keys[2], None, pool[2]) and cache.load(keys[2], pool[6]) and torch.equal(pool[6], pool[2])
    )
    cache.check_invariants()


@pytest.mark.cuda
@needs_cuda
def test_cuda_cache_is_pinned_and_sees_writes_queued_just_before_it():
    pool = torch.zeros((64, 4, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    cache = HostBlockCache(64, block_bytes(pool), device="cuda")
    assert cache.slots.is_pinned() and cache.stream != torch.cuda.current_stream()
    for _ in range(3):  # a long queue of default-stream work ahead of the copy
        pool.mul_(1.0).add_(1.0)
    keys = [i.to_bytes(2, "little") * 48 for i in range(64)]
    assert cache.offer_many([(keys[i], None, pool[i]) for i in range(64)]) == 64
    pool.zero_()
    assert cache.load_many(keys, [pool[63 - i] for i in range(64)]) == 64
    assert torch.all(pool == 3.0)  # read on the default stream right after the call returned


def test_offer_rows_takes_pool_rows_like_offer_many_and_refuses_a_wrong_layout():
    rows = filled_pool().view(SHAPE[0], -1).view(torch.uint8)  # [8 blocks, block bytes]
    changes: list[tuple[bool, bytes, int]] = []
    cache = HostBlockCache(2, rows.shape[1])
    cache.on_change = lambda stored, keys, slots: changes.extend(
        (stored, k, s) for k, s in zip(keys, slots, strict=True)
    )
    keys = [bytes([k]) * 40 for k in range(3)]
    with pytest.raises(InvalidArgument, match=r"need \[num_blocks, \d+\] uint8"):
        cache.offer_rows(keys, rows[:, :-1], [5, 6, 7])
    assert len(cache) == 0 and changes == []  # refused whole: nothing taken
    # Three blocks into two slots: the first is evicted again within the batch (after its copy).
    assert cache.offer_rows(keys, rows, [5, 6, 7]) == 3
    assert [(stored, key) for stored, key, _ in changes] == [
        (True, keys[0]),
        (True, keys[1]),
        (False, keys[0]),
        (True, keys[2]),
    ]
    assert cache.entry(keys[1]).parent_hash == keys[1][:32]
    out = torch.zeros(2, rows.shape[1], dtype=torch.uint8)
    assert cache.load_many(keys[1:], [out[0], out[1]]) == 2
    assert torch.equal(out, rows[6:8])
    cache.check_invariants()


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
    """offer_rows / offer_many / load / touch / discard / evict / take_slots / release_slots in a
    random order, against a plain OrderedDict model of what the cache holds and in which order:
    the keys held (least recently used first), the victims handed to on_evict and every held
    block's bytes agree after each step. Offers of up to ``max_batch`` blocks (1: Extend's
    single evictions, keep_rows' one-block path into a full cache); rows of ``row`` bytes (both
    of HostSlots' copies: numpy items, memoryview slices)."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    num_slots = 6
    rows = torch.arange(32 * row, dtype=torch.int64).remainder(251).to(torch.uint8).view(32, row)
    victims: list[bytes] = []
    cache = HostBlockCache(num_slots, row, on_evict=lambda k, p, data: victims.append(k))
    model: OrderedDict[bytes, int] = OrderedDict()  # key -> the pool row its bytes came from
    model_victims: list[bytes] = []
    swap: list[int] = []

    def evict_oldest(n: int) -> None:
        for _ in range(n):
            model_victims.append(model.popitem(last=False)[0])

    for _ in range(400):
        op = rng.choice(["rows", "many", "load", "touch", "discard", "evict", "take", "release"])
        if op in ("rows", "many"):
            picked = rng.sample(range(32), rng.randint(1, max_batch))
            keys = [bytes([i]) * 40 for i in picked]
            if op == "rows":
                cache.offer_rows(keys, rows, picked)
            else:
                cache.offer_many([(k, None, rows[i]) for k, i in zip(keys, picked, strict=True)])
            new = [(k, i) for k, i in zip(keys, picked, strict=True) if k not in model]
            for k in keys:
                if k in model:
                    model.move_to_end(k)
            while new and num_slots - len(swap) > 0:  # rounds of the room there is
                batch, new = new[: num_slots - len(swap)], new[num_slots - len(swap) :]
                evict_oldest(max(0, len(model) + len(batch) - (num_slots - len(swap))))
                model.update(batch)
        elif op in ("load", "touch"):
            key = bytes([rng.randrange(32)]) * 40
            out = torch.zeros(row, dtype=torch.uint8)
            held = cache.load(key, out) if op == "load" else cache.touch(key)
            assert held == (key in model)
            if held:
                model.move_to_end(key)
                assert op == "touch" or torch.equal(out, rows[model[key]])
        elif op == "discard":
            key = bytes([rng.randrange(32)]) * 40
            assert cache.discard(key) == (model.pop(key, None) is not None)
        elif op == "evict":
            n = rng.randint(0, 3)
            assert cache.evict(n) == min(n, len(model))
            evict_oldest(min(n, len(model)))
        elif op == "take" and len(swap) < num_slots:
            n = rng.randint(1, num_slots - len(swap))
            swap += cache.take_slots(n)
            evict_oldest(max(0, len(model) + len(swap) - num_slots))
        elif op == "release" and swap:
            cache.release_slots([swap.pop()])
        assert cache._entries.oldest_first() == list(model) and victims == model_victims
        for key, i in model.items():
            assert torch.equal(cache.slots[cache.entry(key).slot], rows[i])
        cache.check_invariants()
