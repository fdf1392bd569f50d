"""bench/serve.py's figures and report: per-run and per-system metrics, the markdown tables,
the plots and the headline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from serve_load import RunResult
from serve_workloads import WORKLOADS

SYSTEMS = ("kvtier", "kvtier-prefix-off", "hf-static-prealloc", "hf-continuous-batching")

# The metrics every run and every system summary carries (the test checks them all).
RUN_METRICS = (
    "throughput_rps",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "prefix_hit_rate",
    "peak_kv_bytes",
    "kv_waste",
)
SUMMARY_METRICS = (*RUN_METRICS, "max_concurrent_seqs")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_metrics(r: RunResult) -> dict:
    ok = [x for x in r.records if x.error is None and x.token_times]
    ttft = [x.token_times[0] - x.sent_at for x in ok]
    # Inter-token latency: gaps between consecutive tokens of a request (tokens that arrive in
    # one reply share its gap evenly).
    itl: list[float] = []
    for x in ok:
        times = x.token_times
        k = 1
        while k < len(times):
            j = k
            while j < len(times) and times[j] == times[k]:
                j += 1
            itl += [(times[k] - times[k - 1]) / (j - k)] * (j - k)
            k = j
    duration = max(1e-9, r.t_end - r.t0)
    prompt = sum(x.prompt_len for x in ok)
    measured = [s for s in r.samples if s.unused_slots is not None and s.slots > 0]
    slots = sum(s.slots for s in measured)
    return {
        "workload": r.workload,
        "rate": r.rate,
        "num_requests": len(r.records),
        "num_errors": sum(x.error is not None for x in r.records),
        "errors": sorted({x.error for x in r.records if x.error})[:3],
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(len(x.token_times) for x in ok) / duration,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(x.cached_prompt_tokens for x in ok),
        "prefix_hit_rate": sum(x.cached_prompt_tokens for x in ok) / prompt if prompt else 0.0,
        "peak_kv_bytes": max((s.used_bytes for s in r.samples), default=0),
        "waste_slots": sum(s.unused_slots for s in measured),
        "waste_total_slots": slots,
        "kv_waste": sum(s.unused_slots for s in measured) / slots if slots else float("nan"),
        "waste_samples": len(measured),
        "memory_samples": len(r.samples),
        "memory_timeline": [[round(s.t - r.t0, 4), s.used_bytes, s.num_seqs] for s in r.samples],
        "_ttft": ttft,
        "_itl": itl,
    }


def summarize(runs: list[dict], max_concurrent_seqs: float) -> dict:
    """One system over all its runs: rates pooled over busy time, percentiles over all requests."""
    busy = sum(r["duration_s"] for r in runs)
    done = sum(r["num_requests"] - r["num_errors"] for r in runs)
    ttft = [v for r in runs for v in r["_ttft"]]
    itl = [v for r in runs for v in r["_itl"]]
    prompt = sum(r["prompt_tokens"] for r in runs)
    slots = sum(r["waste_total_slots"] for r in runs)
    return {
        "throughput_rps": done / busy,
        "output_tokens_per_s": sum(r["output_tokens_per_s"] * r["duration_s"] for r in runs) / busy,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "prefix_hit_rate": sum(r["cached_prompt_tokens"] for r in runs) / prompt if prompt else 0.0,
        "peak_kv_bytes": max(r["peak_kv_bytes"] for r in runs),
        "kv_waste": sum(r["waste_slots"] for r in runs) / slots if slots else float("nan"),
        "max_concurrent_seqs": max_concurrent_seqs,
        "num_requests": sum(r["num_requests"] for r in runs),
        "num_errors": sum(r["num_errors"] for r in runs),
    }


def _ms(v: float) -> str:
    return f"{1000 * v:.1f}" if math.isfinite(v) else "-"


def _pc(v: float) -> str:
    return f"{v:.1%}" if math.isfinite(v) else "-"


def json_safe(value):
    """NaN/inf (a metric with no sample, e.g. waste when no instant was measurable) -> null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def markdown(report: dict) -> str:
    lines = [
        f"KV budget M = {report['config']['kv_budget_bytes'] / 2**20:.2f} MiB for every system "
        f"({report['config']['budget_seqs']} x max_model_len {report['config']['max_model_len']} x "
        f"{report['config']['kv_bytes_per_token']} B/token); model: {report['config']['model']}",
        "",
        "| system | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | prefix hit "
        "| peak KV MiB | KV waste | max concurrent seqs on M |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in report["systems"].items():
        m = s["summary"]
        lines.append(
            f"| {name} | {m['throughput_rps']:.2f} | {m['output_tokens_per_s']:.1f} | {_ms(m['ttft_p50_s'])} | "
            f"{_ms(m['ttft_p99_s'])} | {_ms(m['itl_p50_s'])} | {_ms(m['itl_p99_s'])} | "
            f"{_pc(m['prefix_hit_rate'])} | {m['peak_kv_bytes'] / 2**20:.2f} | {_pc(m['kv_waste'])} | "
            f"{m['max_concurrent_seqs']} |"
        )
    lines += [
        "",
        "| system | workload | rate/s | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| prefix hit | peak KV MiB | KV waste | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in report["systems"].items():
        for r in s["runs"]:
            lines.append(
                f"| {name} | {r['workload']} | {r['rate']:g} | {r['throughput_rps']:.2f} | "
                f"{r['output_tokens_per_s']:.1f} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                f"{_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} | {_pc(r['prefix_hit_rate'])} | "
                f"{r['peak_kv_bytes'] / 2**20:.2f} | {_pc(r['kv_waste'])} | {r['num_errors']} |"
            )
    if report["skipped"]:
        lines += ["", *[f"- skipped {k}: {v}" for k, v in report["skipped"].items()]]
    return "\n".join(lines)


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(SYSTEMS, ("C0", "C1", "C2", "C3"), strict=True))
    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 8), squeeze=False)
    for col, workload in enumerate(WORKLOADS):
        for row, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("itl", "inter-token latency (ms)"))):
            ax = axes[row][col]
            for name, s in report["systems"].items():
                runs = [r for r in s["runs"] if r["workload"] == workload]
                rates = [r["rate"] for r in runs]
                for q, style in (("p50", "-o"), ("p99", "--x")):
                    ax.plot(
                        rates,
                        [1000 * r[f"{metric}_{q}_s"] for r in runs],
                        style,
                        color=colors.get(name),
                        label=f"{name} {q}",
                    )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("offered load (sessions/s)")
            ax.set_ylabel(label)
            ax.set_title(workload)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Latency vs load (same model, same KV budget)")
    fig.tight_layout()
    latency_png = out / "latency_vs_load.png"
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)

    budget_mib = report["config"]["kv_budget_bytes"] / 2**20
    fig, axes = plt.subplots(1, len(WORKLOADS) + 1, figsize=(5 * (len(WORKLOADS) + 1), 4), squeeze=False)
    for col, workload in enumerate(WORKLOADS):
        ax = axes[0][col]
        for name, s in report["systems"].items():
            runs = [r for r in s["runs"] if r["workload"] == workload]
            if runs:
                r = runs[-1]  # the highest rate
                tl = r["memory_timeline"]
                ax.plot([p[0] for p in tl], [p[1] / 2**20 for p in tl], color=colors.get(name), label=name)
        ax.axhline(budget_mib, color="k", linestyle=":", label="budget M")
        ax.set_title(f"{workload} @ {report['config']['rates'][-1]:g}/s")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV memory in use (MiB)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    for name, c in report["concurrency"].items():
        if "timeline" in c:
            tl = c["timeline"]
            ax.plot([p[0] for p in tl], [p[1] for p in tl], color=colors.get(name), label=name)
        else:
            ax.axhline(
                c["max_concurrent_seqs"], color=colors.get(name), linestyle="--", label=f"{name} (computed)"
            )
    ax.set_title(f"burst: sequences holding KV on M = {budget_mib:.1f} MiB")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    memory_png = out / "memory_over_time.png"
    fig.savefig(memory_png, dpi=110)
    plt.close(fig)
    return [latency_png, memory_png]


def headline(report: dict) -> dict:
    systems = report["systems"]
    kv = systems["kvtier"]["summary"]
    prealloc = systems["hf-static-prealloc"]["summary"]
    low = report["config"]["rates"][0]

    def ttft(name: str) -> float:
        return next(
            r["ttft_p50_s"]
            for r in systems[name]["runs"]
            if r["workload"] == "shared-prefix" and r["rate"] == low
        )

    return {
        "kvtier_kv_waste": kv["kv_waste"],
        "concurrency_ratio_vs_prealloc": kv["max_concurrent_seqs"] / prealloc["max_concurrent_seqs"],
        "kvtier_concurrent_seqs": kv["max_concurrent_seqs"],
        "prealloc_concurrent_seqs": prealloc["max_concurrent_seqs"],
        "shared_prefix_rate": low,
        "shared_prefix_ttft_p50_kvtier_s": ttft("kvtier"),
        "shared_prefix_ttft_p50_prefix_off_s": ttft("kvtier-prefix-off"),
        "shared_prefix_ttft_ratio": ttft("kvtier-prefix-off") / ttft("kvtier"),
    }
