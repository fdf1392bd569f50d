"""Random operation sequences over SequenceTable; invariants are checked after every step.

Besides the bookkeeping invariants (``check_invariants``), the machine checks what a prefix hit
promises: the pool holds the KV of exactly that prefix. Each committed position p of a sequence
writes a fingerprint of (cache_salt, token_ids[: p + 1]) into ``pool[block, p % block_size]``,
as a compute replica writes K/V; every hit block must then hold the fingerprints of the new
prompt. Swapping moves those bytes through the real host tier, so a wrong copy or a stale
block surfaces as a wrong fingerprint. A failed call must leave every piece of state unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.cachesvc.block_manager import BlockManager
from kvtier.cachesvc.errors import CacheError, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvtier.cachesvc.host_area import HostArea
from kvtier.cachesvc.sequences import SequenceTable
from kvtier.sequence_types import AllocateItem

BS = 4
NUM_BLOCKS = 24
HOST_BLOCKS = 10
VOCAB = 6  # a small alphabet makes shared prefixes (and hits) common
MAX_LEN = 48
LEASES = ("lease-a", "lease-b")
PREFIXES = ([1, 2, 3, 4, 5, 1, 2, 3], [5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0])

tokens_st = st.lists(st.integers(0, VOCAB - 1), max_size=14)
prompt_st = st.builds(lambda p, s: p + s, st.sampled_from([*PREFIXES, *PREFIXES, []]), tokens_st).filter(
    lambda t: 1 <= len(t) <= 30
)
spec_st = st.builds(
    AllocateItem,
    token_ids=prompt_st,
    tenant_salt=st.sampled_from(["", "", "tenant-b"]),
    num_lookahead_tokens=st.integers(0, 6),
)


def fingerprint(cache_salt: str, prefix: list[int]) -> int:
    """The stand-in for the K/V of the last token of ``prefix``: depends on all of it."""
    digest = hashlib.sha256(repr((cache_salt, prefix)).encode()).digest()
    return int.from_bytes(digest[:7], "little")


class SequenceTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Block-major pool [num_blocks, block_size] of int64 fingerprints, one per slot.
        self.pool = torch.zeros(NUM_BLOCKS, BS, dtype=torch.int64)
        self.table = SequenceTable(
            BlockManager(NUM_BLOCKS, BS),
            HostArea.for_pool(self.pool.view(torch.uint8), HOST_BLOCKS * self.pool[0].nbytes),
            model_fingerprint="fp",
            vocab_size=VOCAB,
            max_model_len=MAX_LEN,
            max_batch=4,
        )
        self.salts: dict[int, str] = {}
        # Fingerprints every published hash stands for: hash -> [fingerprint per slot].
        self.kv_of_hash: dict[bytes, list[int]] = {}

    # ------------------------------------------------------------------ helpers

    def live(self, lease: str | None = None, location: str | None = None) -> list[int]:
        return [
            s.sequence_id
            for s in self.table.sequences()
            if (lease is None or s.lease_id == lease) and (location is None or s.location == location)
        ]

    def snapshot(self) -> tuple:
        bm = self.table.block_manager
        host = self.table.host_area
        return (
            bm.free_block_ids(),
            [(b.ref_cnt, b.block_hash) for b in bm.blocks],
            bm.num_evictions,
            [dataclasses.astuple(s) for s in self.table.sequences()],
            dataclasses.astuple(self.table.stats),
            host.used_slots(),
            self.pool.clone().tolist(),
            host.slots.clone().tolist(),
        )

    def expect_failure(self, call, *errors: type[CacheError]) -> bool:
        """Run ``call``; if it raises one of ``errors``, assert no state changed. True if it ran."""
        before = self.snapshot()
        self.table.block_manager.take_events()
        try:
            call()
        except errors:
            assert self.snapshot() == before, "a failed call changed state"
            assert self.table.block_manager.take_events() == []
            return False
        return True

    def write_kv(self, sequence_id: int, start: int, end: int) -> None:
        """What compute does before Commit: write positions [start, end) of the sequence."""
        seq = self.table.get(sequence_id)
        salt = self.salts[sequence_id]
        for p in range(start, end):
            self.pool[seq.block_table[p // BS], p % BS] = fingerprint(salt, seq.token_ids[: p + 1])

    def record_published(self, sequence_id: int) -> None:
        """Remember which KV each published block of the sequence must hold from now on."""
        seq = self.table.get(sequence_id)
        salt = self.salts[sequence_id]
        for j in range(seq.num_published_blocks):
            h = seq.block_hashes[j]
            if h not in self.kv_of_hash:
                self.kv_of_hash[h] = [
                    fingerprint(salt, seq.token_ids[: p + 1]) for p in range(j * BS, (j + 1) * BS)
                ]

    # ------------------------------------------------------------------ rules

    @rule(lease=st.sampled_from(LEASES), specs=st.lists(spec_st, min_size=1, max_size=3))
    def allocate(self, lease: str, specs: list[AllocateItem]) -> None:
        views: list = []
        if not self.expect_failure(lambda: views.extend(self.table.allocate(lease, specs)), CacheError):
            return
        for spec, view in zip(specs, views, strict=True):
            self.salts[view.sequence_id] = spec.tenant_salt
            n = len(spec.token_ids)
            assert view.num_cached_tokens % BS == 0
            assert view.num_cached_tokens <= n - 1, "hit must leave the last prompt token to compute"
            assert view.num_slots >= n + spec.num_lookahead_tokens
            for p in range(view.num_cached_tokens):
                got = int(self.pool[view.block_table[p // BS], p % BS])
                assert got == fingerprint(spec.tenant_salt, spec.token_ids[: p + 1]), (
                    f"hit block {view.block_table[p // BS]} does not hold the KV of the prompt at {p}"
                )

    @precondition(lambda self: self.live(location="device"))
    @rule(data=st.data(), num_tokens=st.integers(0, 12))
    def extend(self, data: st.DataObject, num_tokens: int) -> None:
        sid = data.draw(st.sampled_from(self.live(location="device")))
        lease = self.table.get(sid).lease_id
        self.expect_failure(lambda: self.table.extend(lease, [(sid, num_tokens)]), CacheError)

    @precondition(lambda self: self.live(location="device"))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, VOCAB - 1), max_size=6))
    def commit(self, data: st.DataObject, new_tokens: list[int]) -> None:
        sid = data.draw(st.sampled_from(self.live(location="device")))
        seq = self.table.get(sid)
        slots = len(seq.block_table) * BS
        new_tokens = new_tokens[: slots - len(seq.token_ids)]
        total = len(seq.token_ids) + len(new_tokens)
        start = seq.num_computed_tokens
        # Mostly everything written (what a prefill does), sometimes a partial chunk.
        computed = data.draw(st.one_of(st.just(total), st.integers(start, total)))
        lease = seq.lease_id
        # Compute writes K/V of the new positions first, then commits.
        saved = self.pool.clone()
        seq.token_ids += new_tokens  # temporarily, so write_kv sees the tokens being computed
        self.write_kv(sid, start, computed)
        del seq.token_ids[len(seq.token_ids) - len(new_tokens) :]
        if not self.expect_failure(
            lambda: self.table.commit(lease, [(sid, new_tokens, computed)]), CacheError
        ):
            self.pool.copy_(saved)
            raise AssertionError("a valid commit failed")
        assert self.table.get(sid).num_computed_tokens == computed
        self.record_published(sid)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()))
        lease = self.table.get(sid).lease_id
        self.table.free(lease, [sid])
        self.salts.pop(sid)

    @precondition(lambda self: self.live(location="device"))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(LEASES))
        ids = self.live(lease, "device")[:2]
        if not ids:
            return
        # Slots past num_computed_tokens hold whatever compute left there (speculative K/V): give
        # each a distinct value so a misplaced block shows after the round trip. Those slots lie
        # in blocks only this sequence holds (shared and published blocks are fully computed).
        for sid in ids:
            seq = self.table.get(sid)
            for p in range(seq.num_computed_tokens, len(seq.block_table) * BS):
                self.pool[seq.block_table[p // BS], p % BS] = -(sid * 1000 + p)
        self.expect_failure(lambda: self.table.swap_out(lease, ids), CacheError)

    @precondition(lambda self: self.live(location="host"))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live(location="host")))
        seq = self.table.get(sid)
        written = [int(v) for s in seq.tier_slots for v in self.table.host_area.slots[s].view(torch.int64)]
        lease = seq.lease_id
        out: list = []
        if self.expect_failure(lambda: out.append(self.table.swap_in(lease, [sid])), CacheError):
            (view,), _, _ = out[0]
            live = view.block_table[seq.num_released_blocks :]  # placeholders held no slot
            back = [int(v) for b in live for v in self.pool[b]]
            assert back == written, "swap round trip changed the block bytes"
            self.record_published(sid)

    @precondition(lambda self: self.live(location="device"))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A sliding window left leading blocks behind (Extend's releases): refused, changing
        nothing, exactly when they reach past the committed tokens."""
        sid = data.draw(st.sampled_from(self.live(location="device")))
        seq = self.table.get(sid)
        n = data.draw(st.integers(0, len(seq.block_table)))
        allowed = n * BS <= seq.num_computed_tokens
        ran = self.expect_failure(
            lambda: self.table.extend(seq.lease_id, [(sid, 0)], releases=[(sid, n)]), InvalidArgument
        )
        assert ran == allowed, f"release of {n} blocks with {seq.num_computed_tokens} computed tokens"
        assert not ran or self.table.get(sid).num_released_blocks >= n

    @rule(data=st.data(), kind=st.sampled_from(["unknown", "foreign", "bad-token", "swapped", "duplicate"]))
    def invalid_call(self, data: st.DataObject, kind: str) -> None:
        table = self.table
        live = self.live()
        if kind == "unknown":
            ok = self.expect_failure(lambda: table.extend(LEASES[0], [(10_000, 1)]), NotFound)
        elif kind == "bad-token":
            ok = self.expect_failure(
                lambda: table.allocate(LEASES[0], [AllocateItem([1, 2]), AllocateItem([1, VOCAB])]),
                InvalidArgument,
            )
        elif not live:
            return
        elif kind == "foreign":
            sid = data.draw(st.sampled_from(live))
            other = LEASES[1] if table.get(sid).lease_id == LEASES[0] else LEASES[0]
            ok = self.expect_failure(lambda: table.free(other, [sid]), PermissionDenied)
        elif kind == "duplicate":
            sid = data.draw(st.sampled_from(live))
            ok = self.expect_failure(lambda: table.free(table.get(sid).lease_id, [sid, sid]), InvalidArgument)
        else:
            host = self.live(location="host")
            if not host:
                return
            sid = data.draw(st.sampled_from(host))
            ok = self.expect_failure(
                lambda: table.extend(table.get(sid).lease_id, [(sid, 1)]), FailedPrecondition
            )
        assert not ok, f"{kind} call did not fail"

    @precondition(lambda self: len(self.live()) >= 4)
    @rule(lease=st.sampled_from(LEASES))
    def free_lease(self, lease: str) -> None:
        for sid in self.live(lease):
            self.salts.pop(sid)
        self.table.free_lease(lease)
        assert self.table.sequences_of(lease) == []

    @invariant()
    def invariants_hold(self) -> None:
        self.table.check_invariants()

    @invariant()
    def every_indexed_block_holds_the_kv_its_hash_names(self) -> None:
        for block in self.table.block_manager.prefix_index.values():
            h = block.block_hash
            assert h in self.kv_of_hash, f"block {block.block_id} was indexed without a commit"
            assert self.pool[block.block_id].tolist() == self.kv_of_hash[h], (
                f"indexed block {block.block_id} was overwritten while its hash stayed published"
            )


SequenceTableMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSequenceTableMachine = SequenceTableMachine.TestCase
