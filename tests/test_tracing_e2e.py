"""One Generate call is one trace across three processes: client -> compute -> cache.

Every process appends its spans to one file (KVTIER_TRACE_FILE); the test reads them back and
checks the trace ids and parent links.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers import REPO, TOKEN, child_env, local_stack

CLIENT = """
import asyncio, sys
from kvtier import telemetry
telemetry.setup_tracing("kvtier-client")
from kvtier.compute_client import ComputeClient

async def main():
    client = ComputeClient([sys.argv[1]], sys.argv[2])
    with telemetry.tracer("test").start_as_current_span("client.generate") as span:
        span.set_attribute("kvtier.request_id", "traced-1")
        done = await client.complete(client.request(prompt_token_ids=list(range(1, 40)), max_tokens=20,
                                                   temperature=0, request_id="traced-1"))
    await client.close()
    print(done.completion_tokens)

asyncio.run(main())
telemetry.shutdown_tracing()
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


def test_one_generate_is_one_trace_through_client_compute_and_cache(tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    env = child_env(
        tmp_path / "run",
        KVTIER_TRACE_FILE=str(spans_file),
        OTEL_PYTHON_GRPC_EXCLUDED_SERVICES="grpc.health.v1.Health",
    )
    with local_stack(tmp_path / "run", replicas=1, env=env) as stack:
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, stack.compute_addresses[0], TOKEN],
            cwd=REPO,
            env={**env, "OTEL_SERVICE_NAME": "kvtier-client"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "20"
    spans = load_spans(spans_file)
    root = next(s for s in spans if s["name"] == "client.generate")
    trace_id = root["context"]["trace_id"]
    mine = [s for s in spans if s["context"]["trace_id"] == trace_id]
    by_id = {s["context"]["span_id"]: s for s in mine}
    services = {s["resource"]["attributes"]["service.name"] for s in mine}
    assert services == {"kvtier-client", "kvtier-compute", "kvtier-cache"}, services

    def service(s):
        return s["resource"]["attributes"]["service.name"]

    def parent(s):
        return by_id.get(s["parent_id"]) if s["parent_id"] else None

    def ancestors(s):
        while (s := parent(s)) is not None:
            yield s

    # client span -> gRPC client span -> compute server span
    generate_server = next(
        s
        for s in mine
        if s["name"] == "/kvtier.v1.ComputeService/Generate" and service(s) == "kvtier-compute"
    )
    generate_client = parent(generate_server)
    assert generate_client is not None and service(generate_client) == "kvtier-client"
    assert parent(generate_client) is root
    assert generate_server["attributes"]["kvtier.request_id"] == "traced-1"

    # compute's scheduler spans and its cache calls hang under the request
    for name in ("scheduler.step", "prefill", "decode"):
        assert any(s["name"] == name and service(s) == "kvtier-compute" for s in mine), name
    allocate_server = next(
        s for s in mine if s["name"] == "/kvtier.v1.CacheService/Allocate" and service(s) == "kvtier-cache"
    )
    allocate_client = parent(allocate_server)
    assert allocate_client is not None and service(allocate_client) == "kvtier-compute"
    assert generate_server in list(ancestors(allocate_client))
    decode = next(s for s in mine if s["name"] == "decode")
    assert decode["attributes"]["kvtier.batch_size"] == 1
    (tmp_path / "trace.txt").write_text(render(mine, root))
    print(render(mine, root))
