"""Per-request timelines for ``bench/router.py --dump DIR``: what the router knew when it chose a
node (from the gateway's DEBUG line, ``gateway/router.py``) joined by request id with what the
client saw (when it sent the request, TTFT, actual cached tokens).

One JSON object per request and line in ``DIR/<repeat>-<policy>.jsonl``:

    {"chat": 3, "turn": 1, "sent_s": 12.41, "ttft_ms": 84.2, "end_s": 12.71, "prompt": 552,
     "cached": 528, "node": "node-1", "reason": "prefix",
     "nodes": {"node-0": {"predicted": 0, "inflight": 2, "waiting": 1, "queued": 310,
                          "tokens_per_s": 812.0, "score_ms": -690.4}, "node-1": {...}}}

``sent_s`` and ``end_s`` are seconds from the policy's start; ``queued`` is the node's waiting work
estimate (tokens) at the decision, ``waiting`` its requests without a first token yet, ``predicted``
the leading prompt tokens its pool held.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROUTE_LINE = re.compile(r"route (\S+): (\d+) prompt tokens -> (\S+) \((\w+)\); (.*)$")
NODE_PART = re.compile(
    r"(\S+): cached (\d+) \(\+\d+ host, \+\d+ disk\), (\d+) in flight \((\d+) waiting\), queued (\d+) tokens at "
    r"(\d+)/s, score (-?[\d.]+) ms"
)


def parse_routes(log_text: str) -> dict[str, dict]:
    """Each DEBUG route line of a gateway log, by request id (the completion id: the per-sample
    suffix ``-0`` dropped)."""
    routes = {}
    for line in log_text.splitlines():
        m = ROUTE_LINE.search(line)
        if m is None:
            continue
        rid, _, node, reason, rest = m.groups()
        nodes = {
            p[0]: {
                "predicted": int(p[1]),
                "inflight": int(p[2]),
                "waiting": int(p[3]),
                "queued": int(p[4]),
                "tokens_per_s": float(p[5]),
                "score_ms": float(p[6]),
            }
            for p in NODE_PART.findall(rest)
        }
        routes[rid.rsplit("-", 1)[0]] = {"node": node, "reason": reason, "nodes": nodes}
    return routes


def timeline(results: list, routes: dict[str, dict]) -> list[dict]:
    """Every request of one policy's run (``bench.router.Result``), in the order they were sent."""
    rows = []
    for r in sorted(results, key=lambda r: r.sent_s):
        row = {
            "chat": r.chat,
            "turn": r.turn,
            "sent_s": round(r.sent_s, 3),
            "ttft_ms": round(1000 * r.ttft_s, 1),
            "end_s": round(r.end_s, 3),
            "prompt": r.prompt,
            "cached": r.cached,
        }
        rows.append(row | routes.get(r.rid, {}))
    return rows


def write(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines, written whole then renamed (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def slowest(rows: list[dict], n: int = 5) -> list[str]:
    """The ``n`` requests with the longest TTFT, one line each: where they went and why, what
    was predicted against what hit, and every node's queue estimate at the decision."""
    lines = []
    for row in sorted(rows, key=lambda r: r["ttft_ms"], reverse=True)[:n]:
        chosen = row.get("nodes", {}).get(row.get("node"), {})
        figures = ", ".join(
            f"{name} queued {f['queued']} tok ({f['waiting']} waiting, {f['inflight']} open) at {f['tokens_per_s']:.0f}/s, "
            f"predicted {f['predicted']}, score {f['score_ms']:.0f} ms"
            for name, f in row.get("nodes", {}).items()
        )
        lines.append(
            f"  TTFT {row['ttft_ms']:.0f} ms at {row['sent_s']:.1f} s: chat {row['chat']} turn {row['turn']} "
            f"-> {row.get('node', '?')} ({row.get('reason', '?')}), predicted {chosen.get('predicted', '?')} "
            f"cached {row['cached']} of {row['prompt']}; {figures}"
        )
    return lines
