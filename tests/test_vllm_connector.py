"""kvtier as vLLM's KV cache: real vLLM engines (``python -m vllm.entrypoints.openai.api_server``, the
CPU build) with ``KvtierConnector``, a real cache service, the official ``openai`` client; no mocks.

One cache service and two engines (A, B) serve the whole module, so it starts vLLM three times
(A, B, A again after its SIGKILL) plus one engine that must be refused, started beside them. The
tests run in file order and each leaves the stack serving. The model is a seeded-random byte Llama
with head size 32 (vLLM's CPU attention needs 32 or more) and 4,096 positions, float32 (the cache
service's default on cpu-shm); vLLM's CPU attention needs a block size that is a multiple of 32.

"Greedy output equal to a vLLM run without the connector": engine A computes each prompt from
nothing (its connector only saves), so A's tokens are vLLM's own; B's are compared with them when
B loaded the prefix from kvtier.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs its CPU build)")

import httpx  # noqa: E402
import openai  # noqa: E402
from servers import TOKEN, cache_service, child_env, disk_drained, wait_until  # noqa: E402

from kvtier.cache_client import CacheClient  # noqa: E402
from kvtier.cli.stack import wait_serving  # noqa: E402
from kvtier.vllm.backend_writes import CpuWrite, FlashWrite  # noqa: E402

BLOCK_SIZE = 32
LONG_PREFIX = 1100  # tokens: 34 full blocks (1,088 tokens) can hit
ENGINE_START_S = 600.0  # a vLLM start on a loaded 2-core machine takes one to three minutes
KV_CONFIG = (
    '{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm.connector", '
    '"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


class Engine:
    """One vLLM OpenAI server (and its engine core) in its own session, so a kill takes all of it."""

    def __init__(self, name: str, run_dir: Path, model_dir: Path, *args: str):
        self.name, self.model = name, str(model_dir)
        self.port = free_port()
        self.log_path = run_dir / f"{name}.log"
        self.env = child_env(
            run_dir, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1"
        )
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--max-model-len", "4096",
            "--distributed-executor-backend", "uni", "--block-size", str(BLOCK_SIZE), "--kv-transfer-config", KV_CONFIG, *args,
        ]  # fmt: skip
        self.start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=300)

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> Engine:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, ENGINE_START_S, f"vLLM engine {self.name} to serve")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(60)

    def complete(self, tokens: list[int], max_tokens: int = 8, salt: str | None = None) -> list[int]:
        """Greedy completion of `tokens` (EOS ignored); the generated token ids."""
        extra = {"return_token_ids": True, "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        reply = self.client.completions.create(
            model=self.model, prompt=tokens, max_tokens=max_tokens, temperature=0, extra_body=extra
        )
        return list(reply.choices[0].model_extra["token_ids"])

    def metric(self, name: str) -> float:
        """The sum of vLLM's /metrics series ``name`` over its labels."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        assert found, f"vLLM's /metrics has no {name}"
        return sum(float(v) for v in found)

    def kv_usage(self) -> float:
        """The share of vLLM's KV blocks its requests hold (freed blocks its prefix cache keeps do not count)."""
        return self.metric("vllm:kv_cache_usage_perc")

    def external_hits(self) -> float:
        """vLLM's count of prompt tokens its KV connector supplied."""
        return self.metric("vllm:external_prefix_cache_hits_total")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The engines' model, and another one (other weights) for the refused engine."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.computesvc.model import seed_weights
    from kvtier.model_spec import TINY_LLAMA_CONFIG
    from kvtier.tokenizer import build_byte_tokenizer

    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"vllm-llama-{seed}")
        config = LlamaConfig(
            **{
                **TINY_LLAMA_CONFIG,
                "num_attention_heads": 2,
                "max_position_embeddings": 4096,
                "dtype": "float32",
            }
        )
        torch.manual_seed(seed)
        seed_weights(LlamaForCausalLM(config), seed).save_pretrained(path)
        build_byte_tokenizer().save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dirs):
    """A cache service (160 blocks of 32 tokens, a 4 MiB host cache of 128 blocks, a disk tier) with engines A and
    B, and the refused engine started beside them; all stopped at the end."""
    run_dir = tmp_path_factory.mktemp("vllm-run")
    os.chmod(run_dir, 0o700)
    started = time.monotonic()
    cache_args = ["--model", str(model_dirs[0]), "--block-size", str(BLOCK_SIZE), "--num-blocks", "160",
                  "--host-cache-gib", "0.004", "--disk-path", str(run_dir / "disk"), "--lease-ttl", "2"]  # fmt: skip
    with cache_service(run_dir, *cache_args) as cache:
        engines = {
            "A": Engine("engine-a", run_dir, model_dirs[0], "--dtype", "float32"),
            "B": Engine("engine-b", run_dir, model_dirs[0], "--dtype", "float32"),
            # Another model, vLLM's CPU default dtype (bfloat16) and block size 64: refused at startup.
            "refused": Engine("engine-refused", run_dir, model_dirs[1], "--block-size", "64"),
        }
        try:
            for name in ("A", "B"):
                engines[name].wait_ready()
            print(f"\nvLLM engines A and B serving after {time.monotonic() - started:.0f}s")
            yield {"cache": cache, "run_dir": run_dir, **engines}
        finally:
            for engine in engines.values():
                engine.kill()
            print(f"\ntest_vllm_connector's stack ran {time.monotonic() - started:.0f}s")


def cache_client(stack) -> CacheClient:
    return CacheClient.connect(stack["cache"].address, TOKEN, timeout_s=10.0)


def held_tokens(stack, tokens: list[int], salt: str = "") -> tuple[int, int, int]:
    """(device, host, disk) tokens of `tokens` the cache service holds under `salt`."""
    client = cache_client(stack)
    try:
        [hit] = client.lookup_prefix([tokens], tenant_salt=salt)
    finally:
        client.close()
    return hit.num_cached_tokens, hit.below.get("host", 0), hit.below.get("disk", 0)


def wait_saved(stack, tokens: list[int], salt: str = "") -> None:
    """Until every full block of `tokens` is in the cache (a save is written after the step)."""
    full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    wait_until(lambda: sum(held_tokens(stack, tokens, salt)) >= full, 60, f"{full} tokens saved to kvtier")


PREFIX = prompt(1, LONG_PREFIX)
OUTPUTS: dict[str, list[int]] = {}  # greedy outputs A computed from nothing, by prompt name


def test_prefix_computed_by_one_engine_is_loaded_by_another(stack):
    a, b = stack["A"], stack["B"]
    OUTPUTS["prefix"] = a.complete(PREFIX, max_tokens=16)
    wait_saved(stack, PREFIX)
    before = b.external_hits()
    assert b.complete(PREFIX, max_tokens=16) == OUTPUTS["prefix"]
    # Every full block below the last prompt token came from kvtier: 34 blocks.
    assert b.external_hits() - before == (LONG_PREFIX - 1) // BLOCK_SIZE * BLOCK_SIZE
    # The connector's own lines reach vLLM's log (its logger is a child of vLLM's "vllm").
    assert "kvtier connector:" in b.log() and "attached to" in b.log(), b.log()[-3000:]


def scheduler_side(address: str, tmp_path: Path, role: str = "kv_both", **settings):
    """The connector's scheduler side for vLLM's ``role`` (kv_both, kv_producer: kvtier.vllm.saving;
    kv_consumer: kvtier.vllm.lookups) on its own lease, as vLLM's scheduler drives it."""
    from vllm.config import KVTransferConfig

    from kvtier.vllm.cache_link import CacheLink
    from kvtier.vllm.config import ConnectorConfig
    from kvtier.vllm.connector import scheduler_side as make_side

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cfg = ConnectorConfig.from_extra_config(
        {"cache_address": address, "token_file": str(token_file), **settings}
    )
    link = CacheLink(cfg, "scheduler")
    link.start()
    return link, make_side(
        KVTransferConfig(kv_connector="KvtierConnector", kv_role=role), cfg, link, BLOCK_SIZE, 4096
    )


def vllm_request(rid: str, tokens: list[int], salt: str | None = None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt)


def own_cache_service(model_dirs, tmp_path: Path, *extra: str):
    """A small cache service of the test's own (64 blocks, a lease lasting a minute: it is SIGSTOPped)."""
    args = ["--model", str(model_dirs[0]), "--block-size", str(BLOCK_SIZE), "--num-blocks", "64"]
    return cache_service(tmp_path / "run", *args, "--lease-ttl", "60", *extra)


def commit(client: CacheClient, tokens: list[int], salt: str = "") -> None:
    """Publish `tokens`' full blocks in the cache as a save does (Allocate, then Free with a commit)."""
    from kvtier.sequence_types import AllocateItem, CommitItem

    [seq] = client.allocate([AllocateItem(tokens, tenant_salt=salt)])
    client.free([seq.sequence_id], [CommitItem(seq.sequence_id, [], len(tokens) // BLOCK_SIZE * BLOCK_SIZE)])


def test_scheduler_answers_a_held_prefix_in_its_first_ask_with_a_long_lookup_wait(stack, tmp_path):
    """Asked on arrival (vLLM's on_new_request: the prompt's pool sequence allocated), the cache's
    answer is there when the scheduler first asks: the held prefix A saved is counted (and pinned)
    at once, a miss is 0 at once; no step is lost to "not yet". (The wait is raised from its
    default so a loaded machine's slow calls cannot turn this into a "not yet".)"""
    link, lookups = scheduler_side(stack["cache"].address, tmp_path, lookup_wait_ms=60_000)
    try:
        held, fresh = vllm_request("held", PREFIX), vllm_request("fresh", prompt(90, 300))
        for request in (held, fresh):
            lookups.on_new_request(request)
        assert lookups.num_new_matched_tokens(held, 0) == (
            (LONG_PREFIX - 1) // BLOCK_SIZE * BLOCK_SIZE,
            False,
        )
        assert lookups.num_new_matched_tokens(fresh, 0) == (0, False)
        # vLLM's own prefix cache covering every block kvtier could load: answered without a wait.
        local = vllm_request("local", PREFIX)
        assert lookups.num_new_matched_tokens(local, LONG_PREFIX // BLOCK_SIZE * BLOCK_SIZE) == (0, False)
        assert lookups.stats["not_yet"] == 0, lookups.stats
        for request in (held, fresh, local):
            lookups.update_state_after_alloc(request, [], 0)  # not loaded after all
            lookups.request_finished(request)  # the pool sequences go
    finally:
        lookups.close()
        link.close()


def index_answers(address: str, tmp_path: Path, held_tokens: list[int], hit: int) -> None:
    """A kv_consumer scheduler side's block index, once complete, answers a never-stored prompt 0
    on arrival (no LookupPrefix, no wait) and asks ``held_tokens`` (whose first block the cache
    holds), which hits ``hit`` tokens."""
    link, lookups = scheduler_side(address, tmp_path, "kv_consumer", lookup_wait_ms=60_000)
    try:
        wait_until(lambda: lookups._index.complete, 60, "the block index to catch up with the cache")
        fresh, held = vllm_request("fresh", prompt(400, 300)), vllm_request("held", held_tokens)
        for request in (fresh, held):
            lookups.on_new_request(request)
        assert lookups.stats["index_misses"] == 1 and lookups.stats["asked"] == 1, lookups.stats
        assert lookups.num_new_matched_tokens(fresh, 0) == (0, False)
        assert lookups.num_new_matched_tokens(held, 0) == (hit, False)
        for request in (fresh, held):
            lookups.update_state_after_alloc(request, [], 0)  # not loaded after all: the pin is freed
            lookups.request_finished(request)
    finally:
        lookups.close()
        link.close()


def test_by_default_a_prompt_whose_first_block_the_cache_never_announced_is_a_miss_without_a_call(
    stack, tmp_path
):
    """The block index is on by default: once it has the blocks the cache holds and the events up
    to the newest, a prompt whose first block was never stored is answered 0 on arrival (no
    LookupPrefix, no wait), and one whose first block is held is still asked (and its hit counted)."""
    index_answers(stack["cache"].address, tmp_path, PREFIX, (LONG_PREFIX - 1) // BLOCK_SIZE * BLOCK_SIZE)


def test_with_a_short_event_log_an_engine_joining_later_still_answers_misses_from_the_held_blocks(
    model_dirs, tmp_path
):
    """A cache that has run a while keeps only its newest events (here 64: --event-log-events, not
    the default): an engine's block index starts from the blocks the cache holds (WatchEventBatches'
    start_with_held), so it is complete at once. A never-stored first block is a miss without a
    call; a chain whose events the log dropped (now in the host tier) is still asked, and hits."""
    with own_cache_service(model_dirs, tmp_path, "--event-log-events", "64") as cache:
        client = CacheClient.connect(cache.address, TOKEN, timeout_s=10.0)
        client.attach("test-publisher")
        old = prompt(500, 8 * BLOCK_SIZE + 1)
        for seed in [None, *range(600, 610)]:  # 88 blocks, 64 in the pool
            commit(client, old if seed is None else prompt(seed, 8 * BLOCK_SIZE + 1))
        oldest = next(client.watch_event_batches(0, omit_token_ids=True, timeout_s=30)).events[0].event_id
        assert oldest > 8, f"the log still keeps event {oldest}: old's BlockStored events were not dropped"
        client.close()
        index_answers(cache.address, tmp_path, old, 8 * BLOCK_SIZE)


def test_a_consumer_engine_only_loads_and_a_producer_only_saves(stack, tmp_path):
    """vLLM's kv_role: a kv_consumer's scheduler side plans no save of what it computes; a
    kv_producer's answers a prefix the cache holds 0 and saves what it computes into the pool
    blocks it allocated for the prompt on arrival."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    hit = (LONG_PREFIX - 1) // BLOCK_SIZE * BLOCK_SIZE
    for role, loads, saves in (("kv_consumer", True, False), ("kv_producer", False, True)):
        link, lookups = scheduler_side(stack["cache"].address, tmp_path, role, lookup_wait_ms=60_000)
        try:
            held, fresh = vllm_request("held", PREFIX), vllm_request("fresh", prompt(300, 100))
            for request in (held, fresh):
                lookups.on_new_request(request)
            assert lookups.num_new_matched_tokens(held, 0) == ((hit if loads else 0), False), role
            lookups.update_state_after_alloc(held, [], 0)  # not loaded after all: a pin is freed
            assert lookups.num_new_matched_tokens(fresh, 0) == (0, False), role
            lookups.update_state_after_alloc(fresh, [7, 8, 9, 10], 0)
            if saves:  # planned once the prompt's pool sequence is known
                wait_until(
                    lambda s=lookups: s._tracks["fresh"].allocation.done(), 60, "the prompt's pool blocks"
                )
            step = SchedulerOutput.make_empty()
            step.scheduled_new_reqs = [NewRequestData.from_request(fresh, ([7, 8, 9, 10],))]
            step.num_scheduled_tokens = {"fresh": 100}
            saves_planned = lookups.build_meta(step).saves
            assert [s.vllm_block_ids for s in saves_planned] == ([[7, 8, 9]] if saves else []), role
            # Both prompts looked up (a consumer: asked, or a sure miss answered by the block index once
            # it has caught up), or a pool sequence allocated for each (a producer).
            asked = (lookups.stats["looked_up"], lookups.stats.get("allocated", 0))
            assert asked == ((2, 0) if loads else (0, 2)), (role, lookups.stats)
            for request in (held, fresh):
                lookups.request_finished(request)
        finally:
            lookups.close()
            link.close()


def test_a_hung_cache_service_costs_one_long_lookup_wait_and_with_the_block_index_a_sure_miss_nothing(
    model_dirs, tmp_path
):
    """With the cache service stopped (SIGSTOP: calls hang, nothing refuses), the first new request's
    ask waits its step's lookup_wait_ms and answers "not yet"; once an answer has been awaited for
    more than a second, new requests are answered "not yet" without waiting until the calls come
    back. Then answers resume. (lookup_wait_ms is raised from its default to outlast that second.)
    A prompt whose first block the cache never announced under its salt (the block index has
    followed the cache's events since its first) is answered 0 at once even then: no call is made
    for it. Those whose first block it did announce (unsalted, or under the same salt) are asked.
    (block_index is on, as by default.)"""
    from vllm.v1.core.sched.output import SchedulerOutput

    with own_cache_service(model_dirs, tmp_path) as cache:
        link, lookups = scheduler_side(
            cache.address, tmp_path, "kv_consumer", lookup_wait_ms=2000, rpc_timeout_s=60, block_index=True
        )
        client = CacheClient.connect(cache.address, TOKEN, timeout_s=10.0)
        client.attach("test-publisher")
        root = prompt(99, BLOCK_SIZE)
        commit(client, root + prompt(98, 2 * BLOCK_SIZE))
        commit(client, root, salt="alice")
        client.close()
        index = lookups._index
        wait_until(
            lambda: index.complete and not index.surely_missed(root, "alice", ""), 60, "the index to follow"
        )
        # First block held: asked (r3 under the salt that holds it). Never announced: answered locally.
        requests = [
            vllm_request(f"r{i}", root + prompt(100 + i, 268), "alice" if i == 3 else None) for i in range(4)
        ]
        misses = [
            vllm_request("fresh", prompt(200, 300)),
            vllm_request("other salt", root + prompt(201, 268), "bob"),
        ]
        took, took_misses = [], []
        try:
            os.kill(cache.proc.pid, signal.SIGSTOP)
            for request in misses:
                lookups.on_new_request(request)
                start = time.monotonic()
                assert lookups.num_new_matched_tokens(request, 0) == (0, False)
                took_misses.append(time.monotonic() - start)
            for request in requests:
                lookups.on_new_request(request)
                start = time.monotonic()
                assert lookups.num_new_matched_tokens(request, 0) == (None, False)
                took.append(time.monotonic() - start)
                lookups.build_meta(SchedulerOutput.make_empty())  # the scheduler's step ends
            assert max(took_misses) < 0.5 and took[0] >= 1.9 and max(took[1:]) < 0.5, (took_misses, took)
        finally:
            os.kill(cache.proc.pid, signal.SIGCONT)
        try:
            for request in requests:  # the held first block is their hit, pinned; then released
                wait_until(
                    lambda r=request: lookups.num_new_matched_tokens(r, 0) == (BLOCK_SIZE, False),
                    60,
                    "an answer",
                )
                lookups.update_state_after_alloc(request, [], 0)
        finally:
            lookups.close()
            link.close()


def test_cache_salt_separates_tenants(stack):
    a, b = stack["A"], stack["B"]
    tokens = prompt(2, 100)  # 3 full blocks: size does not matter here
    expected = a.complete(tokens, salt="alice")
    wait_saved(stack, tokens, salt="alice")
    assert held_tokens(stack, tokens, salt="bob") == (0, 0, 0)
    assert held_tokens(stack, tokens) == (0, 0, 0)  # nor without a salt
    before = b.external_hits()
    assert b.complete(tokens, salt="bob") == expected
    assert b.external_hits() == before, "another salt's blocks were loaded"
    assert b.complete(tokens, salt="alice") == expected
    assert b.external_hits() - before == 96, "the same salt's blocks were not loaded"


def test_a_prefill_only_request_is_saved_by_an_engine_that_then_goes_idle(stack):
    """max_tokens 1 (a disaggregated prefill's request): its one step saves it (waiting for its pool
    blocks if need be), and the engine, idle after it, publishes it; vLLM has freed the request's
    blocks (the connector never holds them)."""
    tokens = prompt(3, 130)  # 4 full blocks
    stack["A"].complete(tokens, max_tokens=1)
    wait_saved(stack, tokens)
    assert held_tokens(stack, tokens)[0] == 128
    wait_until(lambda: stack["A"].kv_usage() == 0.0, 60, "vLLM's blocks freed")


def test_restarted_engine_hits_its_prefixes_in_every_tier(stack):
    """A is SIGKILLed and started again; meanwhile B's prompts push A's prefix out of the pool, past
    the host cache, onto disk. A new hits it there, and a later prompt in the host cache."""
    a, b = stack["A"], stack["B"]

    def engine_leases() -> set[str]:
        return {lease.client_name for lease in leases(stack) if lease.client_name.startswith("vllm")}

    old_leases = engine_leases()
    a.kill()
    # The killed engine's two leases (scheduler, worker) expire and leave nothing behind: B's two are
    # all that is left. Before the fillers: a sequence A's scheduler had pinned (a lookup's hit) holds
    # the prefix's blocks until then, and blocks released during the fillers would outlive them.
    wait_until(lambda: len(engine_leases()) == 2, 30, "the killed engine's leases expiring")
    a.start()
    # Serving before the fillers: an engine starting up takes both cores for seconds, and B, starved,
    # may renew its 2 s lease too late to write a filler's saves (it drops them rather than write
    # blocks its lease may no longer hold; 9 of 16 fillers went unsaved once here).
    a.wait_ready()
    # 31 blocks each: the pool holds 160, the host 128. 16 of them push the prefix down with a margin
    # of five (a filler that finished before its pool blocks were answered is not saved).
    fillers = [prompt(100 + i, 1000) for i in range(16)]
    filler_outputs = []
    for tokens in fillers:
        filler_outputs.append(b.complete(tokens))
        # The disk writer keeps up on a loaded machine too: a block offered while its queue is full
        # is skipped (counted), and the prefix must reach the disk whole.
        wait_until(lambda: disk_drained(cache_tiers(stack)), 60, "the disk writer's queue drained")
    held: list = []  # (device, host, disk) tokens of the prefix, last seen: named if it never gets there

    def on_disk() -> bool:
        held[:] = [held_tokens(stack, PREFIX), tier_rows(stack)]
        return held[0][2] >= 1088

    try:
        wait_until(on_disk, 60, "the long prefix written to the disk tier")
    except AssertionError as e:
        saved = [sum(held_tokens(stack, tokens)) for tokens in fillers]
        said = "\n".join([line for line in b.log().splitlines() if "kvtier" in line][-20:])
        raise AssertionError(
            f"{e}; its (device, host, disk) tokens, the tiers (medium, blocks, skipped): {held}; "
            f"the fillers' tokens held: {saved}; B's last kvtier lines:\n{said}"
        ) from None
    before = a.external_hits()
    assert a.complete(PREFIX, max_tokens=16) == OUTPUTS["prefix"]
    assert a.external_hits() - before == 1088, "the prefix on disk was not loaded"
    # Promoting the prefix moved blocks down a tier again; the newest filler the host cache holds
    # whole now (promoting it evicts pool blocks into the host cache, whose oldest entries go):
    in_host = wait_until(
        lambda: [i for i, tokens in enumerate(fillers) if held_tokens(stack, tokens)[1:] == (992, 0)],
        60,
        "a filler prompt whole in the host cache",
    )
    assert a.complete(fillers[in_host[-1]]) == filler_outputs[in_host[-1]]
    assert a.external_hits() - before == 1088 + 992, "the prompt in the host cache was not loaded"

    # B's two leases and the new A's two are all that is left.
    wait_until(lambda: len(engine_leases()) == 4 and len(old_leases & engine_leases()) == 2, 30,
               "the killed engine's leases expiring")  # fmt: skip
    wait_until(lambda: all(lease.num_sequences == 0 for lease in leases(stack)), 30, "every sequence freed")


def cache_tiers(stack):
    """GetStats' tiers of the cache service."""
    client = cache_client(stack)
    try:
        return client.get_stats().tiers
    finally:
        client.close()


def tier_rows(stack) -> list[tuple[str, int, int]]:
    """(medium, blocks, skipped blocks) of each tier below the pool."""
    return [(t.medium, t.num_blocks, t.num_skipped_blocks) for t in cache_tiers(stack)]


def leases(stack):
    client = cache_client(stack)
    try:
        return list(client.get_stats().leases)
    finally:
        client.close()


def test_sigkill_cache_service_requests_complete_and_loads_resume(stack):
    a, b, cache = stack["A"], stack["B"], stack["cache"]
    prompts = [prompt(200 + i, 300) for i in range(6)]
    expected = [a.complete(tokens, max_tokens=24) for tokens in prompts]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = b.complete(prompts[i], max_tokens=24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # a fault injected mid-run: the requests are in flight
    cache.stop(signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    assert [results.get(i) for i in range(len(prompts))] == expected
    # With the service down, a new request is computed by vLLM alone, correctly.
    lonely = prompt(300, 200)
    lonely_expected = b.complete(lonely)
    assert a.complete(lonely) == lonely_expected
    cache.restart()
    wait_serving(cache)
    wait_until(lambda: sum(lease.client_name.startswith("vllm") for lease in leases(stack)) == 4, 60,
               "both engines' scheduler and worker re-attached")  # fmt: skip
    fresh = prompt(400, 300)
    fresh_expected = a.complete(fresh)
    wait_saved(stack, fresh)
    before = b.external_hits()
    assert b.complete(fresh) == fresh_expected
    assert b.external_hits() - before == 288, "loads did not resume after the cache service came back"


def test_engine_for_another_model_dtype_and_block_size_is_refused(stack):
    refused = stack["refused"]
    wait_until(lambda: refused.proc.poll() is not None, ENGINE_START_S, "the mismatched vLLM engine to exit")
    assert refused.proc.returncode != 0
    lines = [line for line in refused.log().splitlines() if "this vLLM engine cannot use the pool" in line]
    assert lines, refused.log()[-6000:]
    line = lines[-1]
    for part in (
        "model_fingerprint",
        "dtype bfloat16 (vLLM) != float32 (pool)",
        "block_size 64 (vLLM) != 32 (pool)",
    ):
        assert part in line, line


def test_saves_go_into_the_pool_blocks_allocated_on_arrival_and_are_published_once_written(
    model_dirs, tmp_path
):
    """An engine that saves: each arriving prompt gets its pool blocks (within max_reserved_share of
    the pool; past it, when the scheduler asks); the worker writes a request's full prompt blocks
    into them in the step that computed them (or the next one that runs the request, when the
    answer came late), and the scheduler side publishes exactly the blocks reported written, each
    in the pool block the cache now serves for it, equal to vLLM's. A save that could not be
    written (its lease's deadline too near) publishes nothing past the blocks before it."""
    import torch
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from kvtier.sequence_types import AllocateItem
    from kvtier.vllm.block_layout import BlockCopier, probe_layout
    from kvtier.vllm.worker import WorkerSide

    with own_cache_service(model_dirs, tmp_path) as cache:  # 64 pool blocks
        link, side = scheduler_side(cache.address, tmp_path, max_reserved_share=0.25, save_batch_ms=0)
        client = CacheClient.connect(cache.address, TOKEN, timeout_s=10.0)
        client.attach("test-reader")
        _, num_layers, _, _, heads, head_dim = client.pool.shape
        caches = [torch.randn(32, heads, BLOCK_SIZE, 2 * head_dim) for _ in range(num_layers)]
        layer = CpuWrite(torch.float32, BLOCK_SIZE, head_dim)
        copier = BlockCopier(caches, [probe_layout(layer, c, BLOCK_SIZE, heads, head_dim) for c in caches],
                             (2, BLOCK_SIZE, heads, head_dim))  # fmt: skip
        worker = WorkerSide(copier)
        worker.map_pool(link.client)
        # 5 + 5 + 6 blocks: the third is past a quarter of the 64-block pool, allocated when asked.
        prompts = {f"r{i}": prompt(500 + i, n * BLOCK_SIZE + 5) for i, n in enumerate((5, 5, 6))}
        requests = {rid: vllm_request(rid, tokens) for rid, tokens in prompts.items()}
        vllm_ids = {"r0": list(range(0, 6)), "r1": list(range(8, 14)), "r2": list(range(20, 27))}
        try:
            for request in requests.values():
                side.on_new_request(request)
            assert side.stats["deferred"] == 1 and set(side._tracks) == {"r0", "r1"}, side.stats
            for request in requests.values():
                wait_until(lambda r=request: side.num_new_matched_tokens(r, 0) == (0, False)
                           and side._tracks[r.request_id].allocation.done(), 60, "the pool blocks")  # fmt: skip
                side.update_state_after_alloc(request, vllm_ids[request.request_id], 0)
            step = SchedulerOutput.make_empty()
            step.scheduled_new_reqs = [
                NewRequestData.from_request(r, (vllm_ids[rid],)) for rid, r in requests.items()
            ]
            step.num_scheduled_tokens = {rid: len(tokens) for rid, tokens in prompts.items()}
            saves = side.build_meta(step).saves
            assert [(s.req_id, s.vllm_block_ids, s.end_block) for s in saves] == [
                ("r0", vllm_ids["r0"][:5], 5), ("r1", vllm_ids["r1"][:5], 5), ("r2", vllm_ids["r2"][:6], 6)
            ]  # fmt: skip
            saves[1].write_by = time.monotonic() - 1  # r1's lease "could lapse": not written
            worker.save(saves)
            side.update_connector_output(set(), worker.take_saves_done())
            assert worker.stats["saved_blocks"] == 11 and worker.stats["dropped_blocks"] == 5, worker.stats
            for rid, n in (("r0", 5), ("r2", 6)):
                tokens = prompts[rid]
                wait_until(lambda t=tokens, n=n: client.lookup_prefix([t])[0].num_cached_tokens == n * BLOCK_SIZE,
                           60, f"{rid}'s blocks published")  # fmt: skip
                [seq] = client.allocate([AllocateItem(tokens)])
                published = client_pool(worker)[torch.tensor(seq.block_table[:n])].view(n, num_layers, -1)
                assert torch.equal(
                    published, copier.read_blocks(vllm_ids[rid][:n]).reshape(n, num_layers, -1)
                )
                client.free([seq.sequence_id])
            assert client.lookup_prefix([prompts["r1"]])[0].total == 0  # nothing of r1 published
            assert side._reserved == 0 and side._tracks.keys() == prompts.keys()  # released, not finished
            for request in requests.values():
                side.request_finished(request)
            assert not side._tracks
        finally:
            side.close()
            worker.close()
            link.close()
            client.close()


def test_closing_the_scheduler_side_publishes_the_saves_it_was_gathering_with_a_long_save_batch(
    model_dirs, tmp_path
):
    """Saves reported written wait up to save_batch_ms to be published in one Free; closing the
    scheduler side (vLLM's connector shutdown, which runs when vLLM stops with --shutdown-timeout
    above 0) publishes them at once. (The batch is raised from its default so none goes out before.)"""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    with own_cache_service(model_dirs, tmp_path) as cache:
        link, side = scheduler_side(cache.address, tmp_path, save_batch_ms=600_000)
        client = CacheClient.connect(cache.address, TOKEN, timeout_s=10.0)
        tokens, vllm_ids = prompt(700, 4 * BLOCK_SIZE + 3), [0, 1, 2, 3, 4]
        request = vllm_request("r", tokens)
        try:
            side.on_new_request(request)
            wait_until(lambda: side.num_new_matched_tokens(request, 0) == (0, False)
                       and side._tracks["r"].allocation.done(), 60, "the pool blocks")  # fmt: skip
            side.update_state_after_alloc(request, vllm_ids, 0)
            step = SchedulerOutput.make_empty()
            step.scheduled_new_reqs = [NewRequestData.from_request(request, (vllm_ids,))]
            step.num_scheduled_tokens = {"r": len(tokens)}
            [save] = side.build_meta(step).saves
            side.update_connector_output(set(), [("r", save.end_block, True)])  # the worker's report
            side.request_finished(request)
            assert client.lookup_prefix([tokens])[0].num_cached_tokens == 0  # gathered, not yet published
        finally:
            side.close()  # what vLLM's shutdown calls: the gathered Free goes out before it returns
            link.close()
        try:
            assert client.lookup_prefix([tokens])[0].num_cached_tokens == 4 * BLOCK_SIZE
        finally:
            client.close()


def test_vllm_s_layers_in_one_allocation_are_copied_through_one_view(stack):
    """vLLM 0.32 keeps every layer's KV cache in one allocation a constant stride apart: the
    connector's copies then take all layers in one view per part (block_layout.layer_stride)."""
    assert "one view spans the layers" in stack["A"].log()


def test_an_engine_that_saves_says_at_startup_what_vllm_s_abort_shutdown_skips(stack):
    """vLLM's default --shutdown-timeout 0 kills its engine core before the connector's shutdown
    runs: an engine that saves says so when it starts, with the flag that avoids it."""
    assert "vLLM's --shutdown-timeout is 0" in stack["A"].log()


def test_a_prefill_only_request_waits_for_its_pool_blocks_in_its_last_step_with_a_long_last_step_wait(
    model_dirs, tmp_path, monkeypatch
):
    """A request with max_tokens 1 ends in the step that computes its prompt: if its pool sequence
    is not answered by then (here the cache service is stopped for a moment), that step waits for
    it (up to LAST_STEP_WAIT_S, raised here so a loaded machine cannot miss it) and plans the save;
    a request with more tokens to generate is not waited for (saved in a later step), except in
    the step that generates its last token by max_tokens."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from kvtier.vllm import saving

    monkeypatch.setattr(saving, "LAST_STEP_WAIT_S", 60.0)
    with own_cache_service(model_dirs, tmp_path) as cache:
        link, side = scheduler_side(cache.address, tmp_path, "kv_producer")
        short = vllm_request("short", prompt(700, 2 * BLOCK_SIZE))
        long = Request("long", prompt(701, 2 * BLOCK_SIZE), SamplingParams(max_tokens=8), None)
        try:
            for request, blocks, wakes in ((short, [1, 2], True), (long, [3, 4], False)):
                os.kill(cache.proc.pid, signal.SIGSTOP)
                side.on_new_request(request)
                assert side.num_new_matched_tokens(request, 0) == (0, False)  # a producer never waits here
                timer = threading.Timer(0.3, os.kill, (cache.proc.pid, signal.SIGCONT))
                if wakes:
                    timer.start()
                step = SchedulerOutput.make_empty()
                step.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
                step.num_scheduled_tokens = {request.request_id: 2 * BLOCK_SIZE}
                started = time.monotonic()
                saves = [(s.req_id, s.vllm_block_ids) for s in side.build_meta(step).saves]
                took = time.monotonic() - started
                os.kill(cache.proc.pid, signal.SIGCONT)
                if wakes:  # waited for the stopped cache's answer, then planned
                    assert saves == [("short", blocks)] and took >= 0.1, (saves, took)
                else:  # not waited for: planned in a later step that runs it
                    assert saves == [] and took < 5, (saves, took)
                timer.cancel()
                wait_until(lambda: not side._stuck(), 60, "the cache to answer")
            # A request of 8 tokens whose answer is still out when its 8th token is generated.
            last = Request("last", prompt(702, 2 * BLOCK_SIZE), SamplingParams(max_tokens=8), None)
            os.kill(cache.proc.pid, signal.SIGSTOP)
            side.on_new_request(last)
            side.num_new_matched_tokens(last, 0)
            step = SchedulerOutput.make_empty()
            step.scheduled_new_reqs = [NewRequestData.from_request(last, ([5, 6],))]
            step.num_scheduled_tokens = {"last": 2 * BLOCK_SIZE}
            assert side.build_meta(step).saves == []  # 7 tokens to go: not waited for
            timer = threading.Timer(0.3, os.kill, (cache.proc.pid, signal.SIGCONT))
            timer.start()
            step = SchedulerOutput.make_empty()
            cached = step.scheduled_cached_reqs
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = (
                ["last"],
                [None],
                [2 * BLOCK_SIZE + 6],
            )
            step.num_scheduled_tokens = {"last": 1}
            started = time.monotonic()
            saves = [(s.req_id, s.vllm_block_ids) for s in side.build_meta(step).saves]
            took = time.monotonic() - started
            assert saves == [("last", [5, 6])] and took >= 0.1, (saves, took)
            timer.cancel()
        finally:
            os.kill(cache.proc.pid, signal.SIGCONT)
            side.close()
            link.close()


def test_a_burst_that_does_not_fit_the_pool_is_allocated_prompt_by_prompt(model_dirs, tmp_path):
    """Allocate is all or nothing: arriving prompts that do not fit the pool together are asked
    again alone, so the ones that fit get their pool blocks (64 here: 40 + 30 do not fit, 40 does)."""
    from concurrent.futures import Future

    from kvtier.sequence_types import AllocateItem
    from kvtier.vllm.prefix_queries import PoolAllocations

    with own_cache_service(model_dirs, tmp_path) as cache:
        link, side = scheduler_side(cache.address, tmp_path)
        allocations = PoolAllocations(link)
        try:
            jobs = [(AllocateItem(prompt(800 + n, n * BLOCK_SIZE)), Future()) for n in (40, 30)]
            allocations._answer(jobs)
            first, second = (future.result(timeout=0) for _, future in jobs)
            assert first is not None and len(first.block_table) == 40 and second is None
        finally:
            allocations.close()
            side.close()
            link.close()


def client_pool(worker):
    """The pool tensor the worker has mapped."""
    return worker.pool(next(iter(worker._pools))).tensor


class ScrambledLayer:
    """A KV write that moves each element of a block to a random place: no strided view (the
    copier's element-by-element path)."""

    def __init__(self, heads: int, head_dim: int):
        self.heads, self.head_dim, self.impl = heads, head_dim, self
        self.perm = torch_perm(2 * BLOCK_SIZE * heads * head_dim)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        import torch

        blocks, offsets = slot_mapping // BLOCK_SIZE, slot_mapping % BLOCK_SIZE
        heads, dims = torch.arange(self.heads)[None, :, None], torch.arange(self.head_dim)[None, None, :]
        flat = kv_cache.view(kv_cache.shape[0], -1)
        for part, rows in enumerate((key, value)):
            index = ((part * BLOCK_SIZE + offsets)[:, None, None] * self.heads + heads) * self.head_dim + dims
            flat[blocks[:, None, None].expand_as(index), self.perm[index]] = rows


class SplitLayer:
    """A cache ``[blocks, 2, block_size, heads, head_dim]`` viewed on K and V planes apart in
    memory (``[2, blocks, ...]``): a block is not one piece (scattered blocks go through kvtier's layout)."""

    impl = property(lambda self: self)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        blocks, offsets = slot_mapping // BLOCK_SIZE, slot_mapping % BLOCK_SIZE
        kv_cache[blocks, 0, offsets] = key
        kv_cache[blocks, 1, offsets] = value


def torch_perm(n: int):
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(n))


LAYOUTS = ["cpu-float32", "cpu-bfloat16", "scrambled", "split", "one-buffer", "one-buffer-interleaved"]


def layout_caches(layout: str, num_layers: int, heads: int, head_dim: int):
    """(the backend's write per layer, the caches) of ``layout``, 64 blocks each."""
    import torch

    dtype = torch.bfloat16 if layout == "cpu-bfloat16" else torch.float32
    if layout.startswith("one-buffer"):
        # vLLM 0.32's allocate_kv_cache: every layer a view of one buffer, layer l of block b at
        # l * layer_stride + b * block_stride (layer after layer, or a block's layers side by side).
        block = heads * BLOCK_SIZE * 2 * head_dim
        interleaved = layout.endswith("interleaved")
        layer_stride, block_stride = (block, num_layers * block) if interleaved else (64 * block, block)
        buffer = torch.zeros(64 * num_layers * block)
        strides = (block_stride, BLOCK_SIZE * 2 * head_dim, 2 * head_dim, 1)
        caches = [buffer.as_strided((64, heads, BLOCK_SIZE, 2 * head_dim), strides, i * layer_stride)
                  for i in range(num_layers)]  # fmt: skip
        write = FlashWrite(head_dim) if interleaved else CpuWrite(dtype, BLOCK_SIZE, head_dim)
        return [write] * num_layers, caches
    if layout == "split":
        planes = [torch.zeros(2, 64, BLOCK_SIZE, heads, head_dim) for _ in range(num_layers)]
        return [SplitLayer() for _ in planes], [p.transpose(0, 1) for p in planes]
    caches = [torch.zeros(64, heads, BLOCK_SIZE, 2 * head_dim, dtype=dtype) for _ in range(num_layers)]
    if layout == "scrambled":
        return [ScrambledLayer(heads, head_dim) for _ in caches], caches
    return [CpuWrite(dtype, BLOCK_SIZE, head_dim) for _ in caches], caches


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_copies_match_the_backend_s_own_writes(layout):
    # The copier's runs of consecutive ids, its scattered-id paths (more than MAX_RUNS runs, on
    # either side) and a reversed order, against the backend's own KV write op (vLLM's CPU one in
    # float32 and bfloat16; a scrambled one, no strided view; one whose blocks are not one piece;
    # every layer a view of one buffer as vLLM 0.32 allocates them, its layers then copied through
    # one view), byte for byte in both directions.
    import torch

    from kvtier.vllm.block_layout import MAX_RUNS, BlockCopier, probe_layout

    heads, head_dim, num_layers = 2, 64, 3
    layers, caches = layout_caches(layout, num_layers, heads, head_dim)
    dtype = caches[0].dtype
    gathers = [
        probe_layout(layer, cache, BLOCK_SIZE, heads, head_dim)
        for layer, cache in zip(layers, caches, strict=True)
    ]
    copier = BlockCopier(caches, gathers, (2, BLOCK_SIZE, heads, head_dim))
    strided = layout != "scrambled"
    assert (copier.parts[0] is not None) == strided and copier.raw == (layout != "split")
    assert (copier.layer_stride is not None) == layout.startswith("one-buffer")  # one view spans the layers
    pool = torch.zeros(80, num_layers, 2, BLOCK_SIZE, heads, head_dim, dtype=dtype)
    for ids in (
        [5, 6, 7, 8],
        [9, 3, 4, 20, 21, 1],
        list(range(59, 39, -1)),
        [2 * i + 1 for i in range(MAX_RUNS + 4)],
    ):
        n = len(ids)
        kv = torch.randn(n, num_layers, 2, BLOCK_SIZE, heads, head_dim).to(dtype)  # kvtier's layout
        slots = torch.tensor([b * BLOCK_SIZE + t for b in ids for t in range(BLOCK_SIZE)])
        written = [torch.zeros_like(c) for c in caches]
        for layer, cache in enumerate(written):
            key, value = (
                kv[:, layer, i].reshape(n * BLOCK_SIZE, heads, head_dim).contiguous() for i in (0, 1)
            )
            layers[layer].do_kv_cache_update(None, key, value, cache, slots)
        for cache, by_vllm in zip(caches, written, strict=True):
            cache.copy_(by_vllm)
        assert torch.equal(copier.read_blocks(ids), kv), f"read {ids}"
        for targets in (list(range(10, 10 + n)), [70 - i for i in range(n)]):
            saved = torch.zeros_like(pool)
            copier.save(saved, targets, ids)
            assert torch.equal(saved[torch.tensor(targets)], kv), f"save {ids} -> {targets}"
            pool[torch.tensor(targets)] = kv
            for cache in caches:
                cache.zero_()
            copier.load(pool, targets, ids)
            assert all(torch.equal(c, w) for c, w in zip(caches, written, strict=True)), (
                f"load {targets} -> {ids}"
            )
