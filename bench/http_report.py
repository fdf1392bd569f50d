"""bench/http_api.py's figures: per path (grpc, http, floor) the throughput, TTFTs and server CPU,
the comparisons against the targets, the table and the headline."""

from __future__ import annotations

import statistics


def _p50_ms(values) -> float:
    values = list(values)
    return 1000 * statistics.median(values) if values else float("nan")


def summarize(raw: dict) -> dict:
    s = {}
    for name in ("grpc", "http", "floor"):
        results = raw[name]["results"]
        good = [x for x in results if not x.error]
        s[name] = {
            "requests": len(results),
            "errors": len(results) - len(good),
            "first_error": next((x.error for x in results if x.error), ""),
            "tokens": sum(x.tokens for x in results),
            "tok_per_s": sum(x.tokens for x in results) / raw[name]["seconds"],
            # The server's own CPU (the gateway's, the floor's) per request and per streamed token.
            "server_cpu_ms_per_request": 1000 * raw[name]["cpu_s"] / max(1, len(results)),
            "server_cpu_us_per_token": 1e6 * raw[name]["cpu_s"] / max(1, sum(x.tokens for x in results)),
            "ttft_p50_ms": _p50_ms(x.ttft_s for x in good),
            # The path's share of each TTFT (client-side TTFT minus the replica's own), which the
            # shared prefill queue does not blur: the gateway's cost under the same load.
            "path_ttft_p50_ms": _p50_ms(x.path_s for x in good),
            "probe_ttft_p50_ms": _p50_ms(x.ttft_s for x in raw["probe"].get(name, ())),
        }
    return s


def compare(s: dict, params: int) -> dict:
    """s with the HTTP-vs-gRPC figures the targets are about (ratio of tok/s, TTFT overhead in ms)."""
    return s | {
        "ratio": s["http"]["tok_per_s"] / s["grpc"]["tok_per_s"],
        "ttft_overhead_ms": s["http"]["path_ttft_p50_ms"] - s["grpc"]["path_ttft_p50_ms"],
        "floor_ttft_p50_ms": s["floor"]["ttft_p50_ms"],
        "raw_ttft_difference_ms": s["http"]["ttft_p50_ms"] - s["grpc"]["ttft_p50_ms"],
        "probe_ttft_overhead_ms": s["http"]["probe_ttft_p50_ms"] - s["grpc"]["probe_ttft_p50_ms"],
        "params": params,
    }


def print_table(s: dict) -> None:
    print(
        f"{'path':>5} {'requests':>9} {'errors':>7} {'tokens':>7} {'tok/s':>8} {'TTFT p50 ms':>12} "
        f"{'path share p50 ms':>18} {'probe TTFT p50 ms':>18} {'server CPU us/token':>20}"
    )
    for name in ("grpc", "http", "floor"):
        r = s[name]
        print(
            f"{name:>5} {r['requests']:>9} {r['errors']:>7} {r['tokens']:>7} {r['tok_per_s']:>8.1f} "
            f"{r['ttft_p50_ms']:>12.1f} {r['path_ttft_p50_ms']:>18.2f} {r['probe_ttft_p50_ms']:>18.2f} "
            f"{r['server_cpu_us_per_token']:>20.1f}"
        )
        if r["errors"]:
            print(f"      first error: {r['first_error']}")


def print_headline(s: dict) -> int:
    """Print the headline (the last line); return the number of failed requests over all paths."""
    ratio, overhead = s["ratio"], s["ttft_overhead_ms"]
    met = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    errors = sum(s[name]["errors"] for name in ("grpc", "http", "floor"))
    print(
        f"headline: HTTP {s['http']['tok_per_s']:.1f} tok/s vs gRPC {s['grpc']['tok_per_s']:.1f} = {ratio:.3f}x "
        f"(target >= 0.95: {met(ratio >= 0.95)}); TTFT p50 overhead {overhead:+.2f} ms (the path's share: HTTP "
        f"{s['http']['path_ttft_p50_ms']:.2f} vs gRPC {s['grpc']['path_ttft_p50_ms']:.2f} ms; target <= 5: "
        f"{met(overhead <= 5)}; the floor, a trivial FastAPI SSE endpoint under the same burst: TTFT p50 "
        f"{s['floor_ttft_p50_ms']:.2f} ms); raw TTFT p50 {s['http']['ttft_p50_ms']:.1f} vs "
        f"{s['grpc']['ttft_p50_ms']:.1f} ms; sequential probe {s['probe_ttft_overhead_ms']:+.2f} ms; errors {errors}"
    )
    return errors
