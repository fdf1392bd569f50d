"""Bad input on the wire: random RPC sequences, malformed protobuf bytes and oversized messages,
all against ONE real cache service subprocess over its Unix socket.

The state machine drives the public API from three leases at once (plus an unknown and an
empty lease id) with a mix of valid and invalid calls, and keeps its own model of what each
lease holds. After every call it reads GetStats and checks:

- free + used == total, used <= total, and used == the number of distinct blocks in the
  model's device block tables (so no block leaks and none is double-counted);
- per lease: sequences, device blocks and host blocks equal the model's;
- a failed call returned exactly the status the model predicts (validation order included)
  and left GetStats unchanged except its clock fields;
- a fresh block is never in another live table, a prefix hit only returns blocks committed
  earlier under the same tenant salt and token prefix, and LookupPrefix never reports a
  prefix no one of that tenant committed.

The pool (24 blocks, 13 host blocks, at most 4 sequences per call) is small so that
RESOURCE_EXHAUSTED paths are exercised too.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from servers import TOKEN, cache_service, stats_without_clock

from kvtier.api import cache_pb2
from kvtier.auth import bearer, grpc_target
from kvtier.cache_client import CacheClient
from kvtier.cachesvc.records import PLACEHOLDER_BLOCK
from kvtier.cachesvc.wire_limits import request_limits
from kvtier.sequence_types import CacheSnapshot

NUM_BLOCKS = 24
MAX_BATCH = 4
BS = 16
VOCAB = 258
MAX_LEN = 1024
NUM_LEASES = 3
UNKNOWN_LEASE, EMPTY_LEASE = NUM_LEASES, NUM_LEASES + 1

OK = None
INV = grpc.StatusCode.INVALID_ARGUMENT
NF = grpc.StatusCode.NOT_FOUND
PD = grpc.StatusCode.PERMISSION_DENIED
FP = grpc.StatusCode.FAILED_PRECONDITION
RE = grpc.StatusCode.RESOURCE_EXHAUSTED

# Prompts are prefixes of a few long token families, so shared prefixes (and hits) are common.
FAMILIES = ([1] * MAX_LEN, [(7 * i) % 256 for i in range(MAX_LEN)], [5, 6] * (MAX_LEN // 2))
SALTS = ("", "tenant-b")
# (method, status name) -> calls, over the whole run: shows what the machine exercised.
OUTCOMES: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fuzz")
    # A long lease TTL: leases must not expire while hypothesis runs (expiry is tested elsewhere).
    args = ["--num-blocks", str(NUM_BLOCKS), "--swap-space", "0.0001", "--max-batch", str(MAX_BATCH)]
    with cache_service(run_dir, *args, "--lease-ttl", "600") as svc:
        yield svc


@pytest.fixture(scope="module")
def leases(service):
    clients = []
    for k in range(NUM_LEASES):
        c = CacheClient.connect(service.address, TOKEN, timeout_s=10.0)
        c.attach(f"fuzz-{k}")
        clients.append(c)
    assert clients[0].pool.num_blocks == NUM_BLOCKS and clients[0].pool.block_size == BS
    assert clients[0].pool.vocab_size == VOCAB and clients[0].pool.max_model_len == MAX_LEN
    yield clients
    for c in clients:
        c.close()


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


# ---------------------------------------------------------------- the model


@dataclasses.dataclass
class SequenceModel:
    lease: int
    salt: str
    tokens: list[int]
    table: list[int]  # device block ids; empty while on the host
    computed: int
    host_blocks: int = 0  # blocks held in the host tier while swapped out
    released: int = 0  # leading table entries a sliding window gave back (placeholders)

    @property
    def live(self) -> list[int]:
        return self.table[self.released :]

    @property
    def on_device(self) -> bool:
        return self.host_blocks == 0


# Everything ever committed, by (tenant salt, token prefix of whole blocks) -> block ids. It
# outlives one hypothesis example because the service's prefix cache does too.
PUBLISHED: dict[tuple[str, tuple[int, ...]], set[int]] = {}

# "busy" resolves to the lease holding the most sequences, so calls on sequences mostly succeed.
lease_st = st.sampled_from(["busy"] * 12 + [0, 1, 2, UNKNOWN_LEASE, EMPTY_LEASE])
# (kind, family, length, salt, lookahead); kinds other than "ok" are invalid in one way each.
alloc_item_st = st.tuples(
    st.sampled_from(
        ["ok"] * 24 + ["empty", "oov", "negative", "int64", "too_long", "neg_la", "la_over", "nul"]
    ),
    st.integers(0, len(FAMILIES) - 1),
    st.integers(1, 80),
    st.sampled_from(SALTS),
    st.integers(0, 40),
)
# (whose sequence, index): resolved against the model when the rule runs.
# "own" prefers the lease's sequences in the place the call needs (device or host tier);
# "own_any" ignores the place, so FAILED_PRECONDITION comes up too.
pick_st = st.tuples(
    st.sampled_from(["own"] * 12 + ["own_any", "own_any", "other", "dead", "unknown"]), st.integers(0, 10**6)
)


def batch_of(item_st):
    """Mostly small valid batches; sometimes an empty one or one over --max-batch."""
    sizes = st.sampled_from([1, 1, 1, 1, 2, 2, 3, 0, MAX_BATCH + 1])
    return sizes.flatmap(lambda n: st.lists(item_st, min_size=n, max_size=n))


class CacheApiMachine(RuleBasedStateMachine):
    def __init__(self, clients: list[CacheClient]):
        super().__init__()
        self.clients = clients
        self.stub = clients[0].stub
        self.metadata = clients[0].metadata
        self.seqs: dict[int, SequenceModel] = {}
        self.dead: list[int] = []
        self.host_total = 0
        self.calls = 0

    # ------------------------------------------------------------ talking to the service

    def lease_id(self, lease: int) -> str:
        if lease == UNKNOWN_LEASE:
            return "0" * 32
        if lease == EMPTY_LEASE:
            return ""
        return self.clients[lease].lease_id

    def stats(self) -> CacheSnapshot:
        """GetStats through the client (only the calls under test go through the raw stub)."""
        return self.clients[0].get_stats()

    def call(self, method: str, request, expected, *, may_exhaust: bool = False):
        """Make one call; check its status against `expected` (None = success) and that a
        failed call changed nothing. Returns (reply or None, GetStats before the call)."""
        self.calls += 1
        before = self.stats()
        try:
            reply = getattr(self.stub, method)(request, metadata=self.metadata, timeout=10)
        except grpc.RpcError as e:
            code = e.code()
            if not (code == expected or (expected is None and may_exhaust and code == RE)):
                raise AssertionError(
                    f"{method} -> {code.name}: {e.details()!r}; the model expected "
                    f"{expected.name if expected else 'success'}\nrequest: {request}"
                ) from None
            OUTCOMES[method, code.name] += 1
            assert e.details(), f"{method} -> {code.name} without a message"
            after = self.stats()
            assert stats_without_clock(after) == stats_without_clock(before), (
                f"failed {method} ({code.name}: {e.details()}) changed the service's state"
            )
            return None, before
        OUTCOMES[method, "OK"] += 1
        assert expected is None, f"{method} succeeded; the model expected {expected.name}\nrequest: {request}"
        return reply, before

    # ------------------------------------------------------------ resolving picks

    def lease_of(self, choice, where: str | None = None) -> int:
        """Resolve "busy": the lease holding the most sequences (in `where`, if any are there)."""
        if choice != "busy":
            return choice
        placed = [m for m in self.seqs.values() if where is None or m.on_device == (where == "device")]
        counts = Counter(m.lease for m in placed or self.seqs.values())
        return counts.most_common(1)[0][0] if counts else 0

    def pick(self, lease: int, kind: str, index: int, where: str | None = None) -> int:
        """A sequence id of the given kind: `where` ("device"/"host") narrows "own" when it can."""
        own = sorted(s for s, m in self.seqs.items() if m.lease == lease)
        if kind == "own" and where is not None:
            placed = [s for s in own if self.seqs[s].on_device == (where == "device")]
            own = placed or own
        other = sorted(s for s, m in self.seqs.items() if m.lease != lease)
        pool = {"own": own, "own_any": own, "other": other, "dead": self.dead, "unknown": []}[kind]
        return pool[index % len(pool)] if pool else 10**12 + index

    def expect_owned(self, lease: int, sids: list[int], where: str | None, check) -> object:
        """The status the service must answer, replaying its validation order: lease, batch,
        then per item existence, ownership, location and the call's own checks, then duplicates."""
        if lease == EMPTY_LEASE:
            return INV
        if lease == UNKNOWN_LEASE:
            return NF
        if not sids or len(sids) > MAX_BATCH:
            return INV
        for k, sid in enumerate(sids):
            seq = self.seqs.get(sid)
            if seq is None:
                return NF
            if seq.lease != lease:
                return PD
            if where == "device" and not seq.on_device or where == "host" and seq.on_device:
                return FP
            code = check(k, seq)
            if code is not None:
                return code
        if len(set(sids)) != len(sids):
            return INV
        return OK

    def live_blocks(self) -> set[int]:
        return {b for m in self.seqs.values() for b in m.live}

    def publish(self, seq: SequenceModel) -> None:
        for b in range(seq.released, seq.computed // BS):
            PUBLISHED.setdefault((seq.salt, tuple(seq.tokens[: (b + 1) * BS])), set()).add(seq.table[b])

    def check_fresh(self, fresh: list[int], held_before: set[int], what: str) -> None:
        assert len(set(fresh)) == len(fresh), f"{what}: a block handed out twice in one call: {fresh}"
        assert not set(fresh) & held_before, (
            f"{what}: blocks {sorted(set(fresh) & held_before)} handed out while another sequence holds them"
        )
        assert all(0 <= b < NUM_BLOCKS for b in fresh), f"{what}: block id out of range in {fresh}"

    # ------------------------------------------------------------ rules

    @initialize()
    def one_sequence_per_lease_and_one_swapped_out(self):
        # Material for the calls on sequences from the first step: 3 x 3 blocks on the device,
        # then lease 0's sequence moved to the host tier.
        for k in range(NUM_LEASES):
            self.allocate(k, [("ok", k, 20 + k, SALTS[k % 2], 16)])
        self.swap_out(0, [("own", 0)])
        assert len(self.seqs) == NUM_LEASES and self.host_total == 3

    @rule(lease=lease_st, items=batch_of(alloc_item_st))
    def allocate(self, lease, items):
        lease = self.lease_of(lease)
        built, invalid, need = [], False, 0
        for kind, family, length, salt, lookahead in items:
            tokens = list(FAMILIES[family][:length])
            if kind == "empty":
                tokens = []
            elif kind == "too_long":
                tokens = list(FAMILIES[family][:MAX_LEN]) + [1]
            elif kind in ("oov", "negative", "int64"):
                tokens[length // 2] = {"oov": VOCAB, "negative": -1, "int64": 2**40}[kind]
            if kind == "neg_la":
                lookahead = -1
            elif kind == "la_over":
                lookahead = MAX_LEN - len(tokens) + 1
            if kind == "nul":
                salt = "bad\0salt"
            invalid |= kind != "ok"
            need += blocks_for(len(tokens) + max(lookahead, 0))
            built.append(
                cache_pb2.AllocateItem(token_ids=tokens, tenant_salt=salt, num_lookahead_tokens=lookahead)
            )
        if lease == EMPTY_LEASE:
            expected = INV
        elif lease == UNKNOWN_LEASE:
            expected = NF
        else:
            expected = INV if invalid or not items or len(items) > MAX_BATCH else OK
        free_before = self.stats().num_blocks_free
        # NOTE: prefix hits only lower what an allocation needs, so a call whose blocks would
        # fit even without any hit must not be refused for lack of room.
        reply, before = self.call(
            "Allocate",
            cache_pb2.AllocateRequest(lease_id=self.lease_id(lease), items=built),
            expected,
            may_exhaust=need > free_before,
        )
        if reply is None:
            return
        held = self.live_blocks()
        # Blocks live sequences hold but have not reported written: never a hit for anyone.
        unwritten = {b for m in self.seqs.values() for b in m.table[m.computed // BS :]}
        fresh_all, new_needed = [], 0
        assert len(reply.sequences) == len(built)
        for item, seq in zip(built, reply.sequences, strict=True):
            n, table = len(item.token_ids), list(seq.block_table)
            assert len(table) == blocks_for(n + item.num_lookahead_tokens), (
                n,
                item.num_lookahead_tokens,
                table,
            )
            assert seq.num_slots == len(table) * BS
            hit = seq.num_cached_tokens
            assert hit % BS == 0 and hit <= (n - 1) // BS * BS, f"hit {hit} of a {n}-token prompt"
            for b in range(hit // BS):
                key = (item.tenant_salt, tuple(item.token_ids[: (b + 1) * BS]))
                if table[b] not in PUBLISHED.get(key, set()):
                    # Promoted from the host cache (the default) into a fresh block: the tenant's
                    # own committed prefix, and no block another sequence holds.
                    assert key in PUBLISHED and table[b] not in held, (
                        f"block {table[b]} served as a hit for block {b} of a salt={item.tenant_salt!r} prompt, "
                        "but no sequence of that tenant committed that prefix"
                    )
                    PUBLISHED[key].add(table[b])
            assert not set(table[: hit // BS]) & unwritten, (
                f"blocks {sorted(set(table[: hit // BS]) & unwritten)} served as a hit while unwritten"
            )
            if hit:
                OUTCOMES["Allocate", "OK with a prefix hit"] += 1
            fresh_all += table[hit // BS :]
            new_needed += len(table) - hit // BS
            assert seq.sequence_id not in self.seqs and seq.sequence_id not in self.dead
            self.seqs[seq.sequence_id] = SequenceModel(
                lease, item.tenant_salt, list(item.token_ids), table, computed=hit
            )
        self.check_fresh(fresh_all, held, "Allocate")
        assert new_needed <= before.num_blocks_free

    @precondition(lambda self: self.seqs)
    @rule(
        lease=lease_st,
        picks=batch_of(st.tuples(pick_st, st.sampled_from([0, 1, 5, 16, 40, -1, MAX_LEN]))),
    )
    def extend(self, lease, picks):
        lease = self.lease_of(lease, "device")
        items = [(self.pick(lease, *p, "device"), n) for p, n in picks]

        def check(k, seq):
            n = items[k][1]
            if n < 0 or len(seq.tokens) + n > MAX_LEN:
                return INV
            return None

        expected = self.expect_owned(lease, [s for s, _ in items], "device", check)
        free = self.stats().num_blocks_free
        if expected is OK:
            more = sum(
                max(0, blocks_for(len(self.seqs[s].tokens) + n) - len(self.seqs[s].table)) for s, n in items
            )
            expected = RE if more > free else OK
        request = cache_pb2.ExtendRequest(
            lease_id=self.lease_id(lease),
            items=[cache_pb2.ExtendItem(sequence_id=s, num_tokens=n) for s, n in items],
        )
        reply, _ = self.call("Extend", request, expected)
        if reply is None:
            return
        held = self.live_blocks()
        fresh = []
        for (sid, n), seq in zip(items, reply.sequences, strict=True):
            model = self.seqs[sid]
            table = list(seq.block_table)
            assert table[: len(model.table)] == model.table, "Extend changed existing blocks"
            assert len(table) == max(len(model.table), blocks_for(len(model.tokens) + n))
            fresh += table[len(model.table) :]
            model.table = table
        self.check_fresh(fresh, held, "Extend")

    @precondition(lambda self: self.seqs)
    @rule(
        lease=lease_st,
        picks=batch_of(
            st.tuples(
                pick_st,
                st.sampled_from([0, 1, 1, 2, 3, 16, 20]),
                st.sampled_from(["all", "all", "all", "all", "keep", "mid", "less", "over", "oov"]),
            )
        ),
    )
    def commit(self, lease, picks):
        lease = self.lease_of(lease, "device")
        items = []
        for p, n_new, how in picks:
            sid = self.pick(lease, *p, "device")
            seq = self.seqs.get(sid)
            base, done = (len(seq.tokens), seq.computed) if seq else (0, 0)
            new = [(base + i) % 256 for i in range(n_new)]
            if how == "oov" and new:
                new[-1] = VOCAB + 1
            total = base + n_new
            computed = {
                "all": total,
                "keep": done,
                "mid": (done + total) // 2,
                "less": done - 1,
                "over": total + 1,
            }.get(how, total)
            items.append((sid, new, computed))

        def check(k, seq):
            _, new, computed = items[k]
            n = len(seq.tokens) + len(new)
            if n > len(seq.table) * BS or n > MAX_LEN:
                return INV
            if any(not 0 <= t < VOCAB for t in new):
                return INV
            if not seq.computed <= computed <= n:
                return INV
            return None

        expected = self.expect_owned(lease, [s for s, _, _ in items], "device", check)
        request = cache_pb2.CommitRequest(
            lease_id=self.lease_id(lease),
            items=[
                cache_pb2.CommitItem(sequence_id=s, token_ids=t, num_computed_tokens=c) for s, t, c in items
            ],
        )
        reply, _ = self.call("Commit", request, expected)
        if reply is None:
            return
        for sid, new, computed in items:
            seq = self.seqs[sid]
            seq.tokens += new
            seq.computed = computed
            self.publish(seq)

    @precondition(lambda self: self.seqs)
    @rule(
        lease=lease_st,
        picks=batch_of(st.tuples(pick_st, st.sampled_from(["behind"] * 4 + ["none", "past", -1]))),
    )
    def release(self, lease, picks):
        """Extend carrying releases (a sliding window's trail), each item asking no room: "behind"
        releases what is committed, "past" one block more (INVALID_ARGUMENT), -1 is negative."""
        lease = self.lease_of(lease, "device")
        sids = [self.pick(lease, *p, "device") for p, _ in picks]
        counts = []
        for sid, (_, how) in zip(sids, picks, strict=True):
            seq = self.seqs.get(sid)
            behind = seq.computed // BS if seq else 1
            counts.append({"behind": behind, "none": 0, "past": behind + 1}.get(how, how))

        def check(k, seq):
            n = counts[k]
            return INV if not 0 <= n <= len(seq.table) or n * BS > seq.computed else None

        # The servicer bounds the releases before it looks at the lease.
        expected = INV if len(sids) > MAX_BATCH else self.expect_owned(lease, sids, "device", check)
        request = cache_pb2.ExtendRequest(
            lease_id=self.lease_id(lease),
            items=[cache_pb2.ExtendItem(sequence_id=s, num_tokens=0) for s in sids],
            releases=[
                cache_pb2.ReleaseItem(sequence_id=s, num_blocks=n) for s, n in zip(sids, counts, strict=True)
            ],
        )
        reply, _ = self.call("Extend", request, expected)
        if reply is None:
            return
        for sid, n, seq in zip(sids, counts, reply.sequences, strict=True):
            model = self.seqs[sid]
            if n > model.released:
                OUTCOMES["Extend", "OK releasing blocks"] += 1
            model.released = max(model.released, n)
            table = list(seq.block_table)
            assert table[: model.released] == [PLACEHOLDER_BLOCK] * model.released, table
            assert table[model.released :] == model.live, "a release moved blocks it kept"
            model.table = table

    @precondition(lambda self: self.seqs)
    @rule(lease=lease_st, picks=batch_of(pick_st))
    def free(self, lease, picks):
        lease = self.lease_of(lease)
        sids = [self.pick(lease, *p) for p in picks]
        expected = self.expect_owned(lease, sids, None, lambda k, seq: None)
        request = cache_pb2.FreeRequest(lease_id=self.lease_id(lease), sequence_ids=sids)
        reply, _ = self.call("Free", request, expected)
        if reply is None:
            return
        for sid in sids:
            seq = self.seqs.pop(sid)
            self.host_total -= seq.host_blocks
            self.dead.append(sid)

    @precondition(lambda self: self.seqs)
    @rule(lease=lease_st, picks=batch_of(pick_st))
    def swap_out(self, lease, picks):
        lease = self.lease_of(lease, "device")
        sids = [self.pick(lease, *p, "device") for p in picks]
        expected = self.expect_owned(lease, sids, "device", lambda k, seq: None)
        stats = self.stats()
        if expected is OK:
            need = sum(len(self.seqs[s].live) for s in sids)
            expected = RE if need > stats.num_host_blocks_total - stats.num_host_blocks_used else OK
        reply, _ = self.call(
            "SwapOut", cache_pb2.SwapOutRequest(lease_id=self.lease_id(lease), sequence_ids=sids), expected
        )
        if reply is None:
            return
        assert reply.num_blocks == sum(len(self.seqs[s].live) for s in sids)
        for sid in sids:
            seq = self.seqs[sid]
            seq.host_blocks, seq.table = len(seq.live), []
            self.host_total += seq.host_blocks

    @precondition(lambda self: self.seqs)
    @rule(lease=lease_st, picks=batch_of(pick_st))
    def swap_in(self, lease, picks):
        lease = self.lease_of(lease, "host")
        sids = [self.pick(lease, *p, "host") for p in picks]
        expected = self.expect_owned(lease, sids, "host", lambda k, seq: None)
        if expected is OK:
            need = sum(self.seqs[s].host_blocks for s in sids)
            expected = RE if need > self.stats().num_blocks_free else OK
        reply, _ = self.call(
            "SwapIn", cache_pb2.SwapInRequest(lease_id=self.lease_id(lease), sequence_ids=sids), expected
        )
        if reply is None:
            return
        held = self.live_blocks()
        fresh = []
        for sid, seq in zip(sids, reply.sequences, strict=True):
            model = self.seqs[sid]
            assert list(seq.block_table[: model.released]) == [PLACEHOLDER_BLOCK] * model.released
            assert len(seq.block_table) == model.released + model.host_blocks
            fresh += list(seq.block_table[model.released :])
            self.host_total -= model.host_blocks
            model.table, model.host_blocks = list(seq.block_table), 0
            self.publish(model)
        self.check_fresh(fresh, held, "SwapIn")

    @rule(
        items=batch_of(
            st.tuples(
                st.integers(0, len(FAMILIES) - 1),
                st.integers(0, 80),
                st.sampled_from([*SALTS, *SALTS, "other", "bad\0"]),
                st.sampled_from([False] * 5 + [True]),
            )
        )
    )
    def lookup_prefix(self, items):
        built = []
        invalid = not items or len(items) > MAX_BATCH
        for family, length, salt, oov in items:
            tokens = list(FAMILIES[family][:length])
            if oov and tokens:
                tokens[-1] = VOCAB
            invalid |= (oov and bool(tokens)) or "\0" in salt
            built.append(cache_pb2.LookupPrefixItem(token_ids=tokens, tenant_salt=salt))
        reply, before = self.call(
            "LookupPrefix", cache_pb2.LookupPrefixRequest(items=built), INV if invalid else OK
        )
        if reply is None:
            return
        assert stats_without_clock(self.stats()) == stats_without_clock(before), (
            "LookupPrefix changed the service's state"
        )
        for item, cached in zip(built, reply.num_cached_tokens, strict=True):
            assert cached % BS == 0 and cached <= len(item.token_ids)
            for b in range(cached // BS):
                key = (item.tenant_salt, tuple(item.token_ids[: (b + 1) * BS]))
                assert key in PUBLISHED, (
                    f"LookupPrefix reports block {b} of a salt={item.tenant_salt!r} prompt cached, "
                    "but no sequence of that tenant committed that prefix"
                )

    @rule(lease=lease_st)
    def heartbeat(self, lease):
        lease = self.lease_of(lease)
        expected = {EMPTY_LEASE: INV, UNKNOWN_LEASE: NF}.get(lease, OK)
        self.call("Heartbeat", cache_pb2.HeartbeatRequest(lease_id=self.lease_id(lease)), expected)

    # ------------------------------------------------------------ invariants

    @invariant()
    def stats_match_the_model(self):
        s = self.stats()
        assert s.num_blocks_total == NUM_BLOCKS
        assert s.num_blocks_free + s.num_blocks_used == s.num_blocks_total
        assert 0 <= s.num_blocks_used <= s.num_blocks_total
        assert s.num_blocks_cached <= s.num_blocks_total
        assert s.num_blocks_used == len(self.live_blocks()), (
            f"the service counts {s.num_blocks_used} used blocks, live tables hold {len(self.live_blocks())}"
        )
        assert s.num_sequences == len(self.seqs)
        assert s.num_swapped_sequences == sum(1 for m in self.seqs.values() if not m.on_device)
        assert s.num_host_blocks_used == self.host_total
        by_id = {lease.lease_id: lease for lease in s.leases}
        for k, client in enumerate(self.clients):
            lease = by_id[client.lease_id[:8]]
            mine = [m for m in self.seqs.values() if m.lease == k]
            assert lease.num_sequences == len(mine), f"lease {k}"
            assert lease.num_blocks == sum(len(m.live) for m in mine), f"lease {k}"
            assert lease.num_host_blocks == sum(m.host_blocks for m in mine), f"lease {k}"

    def teardown(self):
        for k in range(NUM_LEASES):
            mine = [s for s, m in self.seqs.items() if m.lease == k]
            for i in range(0, len(mine), MAX_BATCH):
                self.clients[k].free(mine[i : i + MAX_BATCH])
        s = self.stats()
        assert s.num_sequences == 0 and s.num_blocks_used == 0 and s.num_host_blocks_used == 0


def test_random_valid_and_invalid_rpc_sequences_from_three_leases_keep_the_service_consistent(leases):
    started = time.monotonic()
    OUTCOMES.clear()
    run_state_machine_as_test(
        lambda: CacheApiMachine(leases),
        settings=settings(
            max_examples=40,
            stateful_step_count=50,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"state machine: {sum(OUTCOMES.values())} calls in {time.monotonic() - started:.1f}s")
    for (method, code), n in sorted(OUTCOMES.items()):
        print(f"  {method:<13} {code:<20} {n}")
    # The run must have exercised both sides of the API, not only its refusals.
    for method in ("Allocate", "Extend", "Commit", "Free", "SwapOut", "SwapIn", "LookupPrefix"):
        assert OUTCOMES[method, "OK"] > 0, f"no {method} ever succeeded"
    for code in ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "FAILED_PRECONDITION"):
        assert any(c == code for _, c in OUTCOMES), f"no call was refused with {code}"


# ---------------------------------------------------------------- malformed bytes and oversized messages

ALLOCATE = "/kvtier.v1.CacheService/Allocate"
GARBAGE = [
    b"\xff" * 16,  # field 0x1fffffff.. with wire type 7: not a valid tag
    b"\x0a\x05ab",  # lease_id (field 1) claims 5 bytes, 2 follow
    b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # an 11-byte varint length
    b"\x12\x04\x0a\x02\x08",  # an AllocateItem whose token_ids field is cut short
    b"\x0a\x02\xc3\x28",  # lease_id that is not valid UTF-8 (proto3 strings must be)
]


def raw_allocate(address: str, payload: bytes, options=()):
    """Send `payload` as the body of an Allocate call, bypassing protobuf serialization."""
    with grpc.insecure_channel(grpc_target(address), options=list(options)) as channel:
        call = channel.unary_unary(ALLOCATE, request_serializer=None, response_deserializer=None)
        return call(payload, metadata=bearer(TOKEN), timeout=30)


def still_serves(address: str) -> None:
    c = CacheClient.connect(address, TOKEN, timeout_s=10.0)
    try:
        c.attach("after-garbage")
        seq = c.allocate([[1, 2, 3]])[0]
        assert c.free([seq.sequence_id]) == 1  # blocks released
    finally:
        c.close()


@pytest.mark.parametrize(
    "payload", GARBAGE, ids=["bad-tag", "truncated-string", "overlong-varint", "truncated-item", "bad-utf8"]
)
def test_malformed_protobuf_bytes_are_refused_and_the_service_keeps_serving(service, leases, payload):
    before = stats_without_clock(leases[0].get_stats())
    with pytest.raises(grpc.RpcError) as e:
        raw_allocate(service.address, payload)
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), e.value.details()
    assert stats_without_clock(leases[0].get_stats()) == before
    still_serves(service.address)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(max_size=200))
def test_random_bytes_as_an_allocate_request_never_crash_or_change_the_service(service, leases, payload):
    before = stats_without_clock(leases[0].get_stats())
    try:
        raw_allocate(service.address, payload)
    except grpc.RpcError as e:
        # Bytes that happen to parse are an AllocateRequest with an empty or unknown lease id.
        allowed = (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert e.code() in allowed, f"{payload!r} -> {e.code().name}: {e.details()}"
    else:
        pytest.fail(f"{payload!r} was accepted as an Allocate without a lease")
    assert stats_without_clock(leases[0].get_stats()) == before


def test_a_message_just_over_allocates_limit_is_resource_exhausted_and_the_service_keeps_serving(
    service, leases
):
    def request_of(size: int) -> bytes:
        # AllocateRequest{lease_id: "x" * n}: tag (1 byte) + varint length (3 bytes) + n bytes.
        body = cache_pb2.AllocateRequest(lease_id="x" * (size - 4)).SerializeToString()
        assert len(body) == size
        return body

    # The cache service's limit for Allocate (max_batch items of max_model_len tokens), the
    # largest of its methods' limits: over it, grpc refuses the message unread.
    limit = request_limits(MAX_BATCH, MAX_LEN, VOCAB)[ALLOCATE]
    assert 1 << 14 < limit < 1 << 21
    with pytest.raises(grpc.RpcError) as e:
        raw_allocate(service.address, request_of(limit + 1))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    # Exactly at the limit, the message is read and refused on its merits (a lease id that long).
    with pytest.raises(grpc.RpcError) as e:
        raw_allocate(service.address, request_of(limit))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "lease_id is" in e.value.details() and len(e.value.details()) < 200
    still_serves(service.address)
