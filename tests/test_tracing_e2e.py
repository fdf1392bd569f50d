"""Every request's trace shows its own work, across client -> compute -> cache.

Every process appends its spans to one file (KVTIER_TRACE_FILE); the tests read them back and
check trace ids, parent links and span links. One test runs `kvtier generate` (its client span,
the services it starts keep their own names); one sends eight concurrent requests, whose batched
steps serve several at once, and also exports over OTLP/HTTP to a receiver in the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from servers import REPO, TOKEN, child_env, local_stack
from test_telemetry import otlp_http  # noqa: F401 (a fixture)

from kvtier import __version__

# Eight concurrent requests from an untraced client: each request's trace starts at its
# Generate server span in the replica. Prints {request_id: completion tokens}.
CLIENT = """
import asyncio, json, sys
from kvtier.compute_client import ComputeClient

async def main():
    client = ComputeClient([sys.argv[1]], sys.argv[2])
    reqs = [client.request(prompt_token_ids=[1 + (7 * i + j) % 250 for j in range(40)], max_tokens=40,
                           temperature=0, request_id=f"r{i}") for i in range(8)]
    done = await asyncio.gather(*(client.complete(r) for r in reqs))
    await client.close()
    print(json.dumps({d.request_id: d.completion_tokens for d in done}))

asyncio.run(main())
"""


def load_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(spans: list[dict], root: dict) -> str:
    """An indented text view of the trace under `root` (used for the README's example)."""
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] or "", []).append(s)
    lines = []

    def walk(span, depth):
        service = span["resource"]["attributes"]["service.name"]
        ms = (_ns(span["end_time"]) - _ns(span["start_time"])) / 1e6
        lines.append(f"{'  ' * depth}{span['name']}  [{service}]  {ms:.1f} ms")
        for child in sorted(children.get(span["context"]["span_id"], []), key=lambda c: c["start_time"]):
            walk(child, depth + 1)

    walk(root, 0)
    return "\n".join(lines)


def _ns(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1e9


class Trace:
    """The spans of one trace file, indexed."""

    def __init__(self, spans: list[dict]) -> None:
        self.spans = spans
        self.by_id = {s["context"]["span_id"]: s for s in spans}

    @staticmethod
    def service(span: dict) -> str:
        return span["resource"]["attributes"]["service.name"]

    def parent(self, span: dict) -> dict | None:
        return self.by_id.get(span["parent_id"]) if span["parent_id"] else None

    def children(self, span: dict) -> list[dict]:
        return [s for s in self.spans if s["parent_id"] == span["context"]["span_id"]]

    def in_trace(self, span: dict) -> list[dict]:
        return [s for s in self.spans if s["context"]["trace_id"] == span["context"]["trace_id"]]

    def linked(self, span: dict) -> list[dict]:
        return [self.by_id[link["context"]["span_id"]] for link in span["links"]]


def check_request_trace(t: Trace, server: dict, completion_tokens: int) -> None:
    """`server` (a Generate server span) has its request's own spans under it: one prefill, decode
    spans with an event per decode step, and a span for each cache call made for it, each linked
    to the step that made the real RPC (whose cache-service span is its child) and parent of the
    cache service's span for this request's share of that call: the request's trace holds its
    cache calls on both sides, however many requests each call served."""
    rid = server["attributes"]["kvtier.request_id"]
    # (The steps it parented, as the oldest request in flight, are its children too.)
    own = [s for s in t.children(server) if s["name"] != "scheduler.step"]
    assert all(s["attributes"]["kvtier.request_id"] == rid for s in own), own
    names = Counter(s["name"] for s in own)
    assert names["prefill"] == 1, names
    assert names["decode"] >= 1, names
    # The first token comes from the prefill, every other from one decode step.
    steps = [e for s in own if s["name"] == "decode" for e in s["events"] if e["name"] == "step"]
    assert len(steps) == completion_tokens - 1, (rid, len(steps))
    for method in ("Allocate", "Commit", "Free"):
        calls = [s for s in own if s["name"] == f"cache.{method}"]
        assert len(calls) >= 1, (rid, method, names)
        for call in calls:
            (step,) = t.linked(call)
            assert step["name"] == "scheduler.step"
            rpc = [c for c in t.children(step) if c["name"] == f"/kvtier.v1.CacheService/{method}"]
            assert rpc and t.service(rpc[0]) == "kvtier-compute", (rid, method)
            (served,) = t.children(rpc[0])
            assert t.service(served) == "kvtier-cache"
            # The cache service's span for this request, in this request's trace, linked to the
            # server span of the batched RPC (a child of the step's client span), and back.
            (share,) = t.children(call)
            assert t.service(share) == "kvtier-cache", (rid, method)
            assert share["name"] == f"/kvtier.v1.CacheService/{method}", share["name"]
            assert share["context"]["trace_id"] == server["context"]["trace_id"]
            (batch,) = t.linked(share)
            assert t.service(batch) == "kvtier-cache" and t.parent(t.parent(batch)) is step, (rid, method)
            assert share["context"]["span_id"] in {link["context"]["span_id"] for link in batch["links"]}
            assert share["status"]["status_code"] == call["status"]["status_code"], (rid, method)
    # The prompt's commit: its own Commit call after the prefill; every later token's rides on an
    # Extend, SwapOut or Free, and each token with KV (all but the last sampled) is committed once
    # (a refused call, an Extend that found no room, applies none of its commits).
    prompt_tokens = server["attributes"]["kvtier.prompt_tokens"]
    (commit,) = [s for s in own if s["name"] == "cache.Commit"]
    assert commit["attributes"]["kvtier.commit_tokens"] == prompt_tokens
    committed = sum(
        s["attributes"].get("kvtier.commit_tokens", 0)
        for s in own
        if s["name"].startswith("cache.") and s["status"]["status_code"] != "ERROR"
    )
    assert committed == prompt_tokens + completion_tokens - 1, (rid, committed)
    # Each of its phases links to the batched forward that did it.
    for phase in ("prefill", "decode"):
        span = next(s for s in own if s["name"] == phase)
        (batch,) = t.linked(span)
        assert batch["name"] == f"batch.{phase}"
        assert server["context"]["span_id"] in {link["context"]["span_id"] for link in batch["links"]}


def test_each_request_trace_holds_its_own_work_and_otlp_http_gets_the_same(tmp_path, otlp_http):  # noqa: F811
    """Eight concurrent requests (preempted in turn by a small pool), then `kvtier generate` against
    the same stack."""
    receiver, endpoint = otlp_http
    spans_file = tmp_path / "spans.jsonl"
    run_dir = tmp_path / "run"
    env = child_env(
        run_dir,
        KVTIER_TRACE_FILE=str(spans_file),
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        # Nothing leaves the batch processor before shutdown: what arrives, the exit flushed.
        OTEL_BSP_SCHEDULE_DELAY="600000",
        OTEL_BSP_MAX_QUEUE_SIZE="100000",
        OTEL_BSP_MAX_EXPORT_BATCH_SIZE="100000",
        OTEL_PYTHON_GRPC_EXCLUDED_SERVICES="grpc.health.v1.Health",
        OTEL_SERVICE_NAME="my-cli",  # a caller's name: the stack's services keep their own
    )
    # 24 blocks of 16 tokens for eight 80-token sequences: some are swapped out and back in.
    # NOTE: the default "cost" policy swaps or recomputes by the rates the replica measured (on a
    # loaded machine slow calls make recompute the cheaper move); this test reads the trace of a
    # swapped request, so it takes the policy that always swaps while the host tier has room.
    with local_stack(
        run_dir,
        cache_args=["--num-blocks", "24"],
        compute_args=["--preemption-policy", "newest"],
        replicas=1,
        env=env,
    ) as stack:
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, stack.compute_addresses[0], TOKEN],
            cwd=REPO,
            env=child_env(run_dir),  # untraced: each request's trace starts in the replica
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        # `kvtier generate` finds the stack in the run dir; its spans go to the file only.
        cli = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.cli", "generate", "Once upon a time", "--max-tokens", "20"],
            cwd=REPO,
            env=child_env(run_dir, KVTIER_TRACE_FILE=str(spans_file), OTEL_SERVICE_NAME="my-cli"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert receiver.requests == 0
    tokens = json.loads(out.stdout)
    assert sorted(tokens) == [f"r{i}" for i in range(8)]
    t = Trace(load_spans(spans_file))
    assert {t.service(s) for s in t.spans} == {"my-cli", "kvtier-compute", "kvtier-cache"}

    # Each of the eight: a trace of its own, holding its own work.
    servers = {
        s["attributes"]["kvtier.request_id"]: s
        for s in t.spans
        if s["name"] == "/kvtier.v1.ComputeService/Generate"
        and t.service(s) == "kvtier-compute"
        and s["parent_id"] is None
    }
    assert sorted(servers) == sorted(tokens)
    assert len({s["context"]["trace_id"] for s in servers.values()}) == 8
    for rid, server in servers.items():
        check_request_trace(t, server, tokens[rid])  # (its links may lead to another trace)
    # The batched spans served several requests at once and link to each of them.
    widest = max(
        (s for s in t.spans if s["name"] == "batch.decode"),
        key=lambda s: s["attributes"]["kvtier.batch_size"],
    )
    assert widest["attributes"]["kvtier.batch_size"] > 1
    assert len(widest["links"]) == widest["attributes"]["kvtier.batch_size"]
    # A preempted request's decode phase ends ("preempted") and the next begins after its SwapIn.
    swapped = {
        t.parent(s)["attributes"]["kvtier.request_id"] for s in t.spans if s["name"] == "cache.SwapOut"
    }
    assert swapped, "no request was preempted"
    for rid in swapped:
        own = t.children(servers[rid])
        assert any(s["name"] == "cache.SwapIn" for s in own), rid
        decodes = [s for s in own if s["name"] == "decode"]
        if any(e["name"] == "preempted" for s in decodes for e in s["events"]):
            assert len(decodes) >= 2, rid
    # Lease heartbeats are not traced; the lease's Attach is.
    names = {s["name"] for s in t.spans}
    assert "/kvtier.v1.CacheService/Attach" in names
    assert not any("Heartbeat" in n for n in names)

    # `kvtier generate`: its client span is the root of one trace through compute and cache.
    root = next(s for s in t.spans if s["name"] == "kvtier.generate")
    assert root["parent_id"] is None
    assert root["resource"]["attributes"]["service.name"] == "my-cli"
    assert root["resource"]["attributes"]["service.version"] == __version__
    completion_tokens = root["attributes"]["kvtier.completion_tokens"]
    assert f"{completion_tokens} completion tokens" in cli.stderr
    mine = Trace(t.in_trace(root))
    assert {t.service(s) for s in mine.spans} == {"my-cli", "kvtier-compute", "kvtier-cache"}
    server = next(
        s
        for s in mine.spans
        if s["name"] == "/kvtier.v1.ComputeService/Generate" and t.service(s) == "kvtier-compute"
    )
    client = mine.parent(server)
    assert t.service(client) == "my-cli" and mine.parent(client) is root
    check_request_trace(mine, server, completion_tokens)
    decodes = [s for s in mine.spans if s["name"] == "batch.decode"]  # alone: it parents every step
    assert len(decodes) == completion_tokens - 1
    assert all(s["attributes"]["kvtier.batch_size"] == 1 for s in decodes)
    (tmp_path / "trace.txt").write_text(render(mine.spans, root))
    print(render(mine.spans, root))

    # The OTLP/HTTP exporter delivered the services' spans, all at shutdown (the last step's, the Frees).
    exported = {
        (s["trace_id"], s["span_id"], s["parent_id"], s["name"], s["service"]) for s in receiver.spans
    }
    written = {
        (
            s["context"]["trace_id"][2:],
            s["context"]["span_id"][2:],
            (s["parent_id"] or "0x")[2:],
            s["name"],
            t.service(s),
        )
        for s in t.spans
        if t.service(s) != "my-cli"
    }
    assert exported == written
    assert {s["version"] for s in receiver.spans} == {__version__}
