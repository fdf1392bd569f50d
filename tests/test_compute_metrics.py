"""A compute replica's Prometheus endpoint, scraped over HTTP after real requests."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from servers import TOKEN, local_stack

from kvtier.compute_client import ComputeClient


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_compute_metrics_count_tokens_ttft_hits_and_cache_calls(tmp_path):
    with local_stack(tmp_path / "run", compute_args=["--metrics-port", "0"], replicas=1) as stack:
        port = int(
            re.search(
                r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics", stack.replicas[0].log()
            ).group(1)
        )

        async def two_requests():
            client = ComputeClient(stack.compute_addresses, TOKEN)
            prompt = list(range(1, 41))  # 40 tokens: the second request hits 32
            done = [
                await client.complete(
                    client.request(prompt_token_ids=prompt, max_tokens=6, temperature=0, ignore_eos=True)
                )
                for _ in range(2)
            ]
            await client.close()
            return done

        done = asyncio.run(two_requests())
        # The replica records a stream's end and updates its gauges just after the last reply
        # reaches us: poll until it has, with a deadline.
        generate_ok = ("kvtier_compute_rpc_duration_seconds_count", (("code", "OK"), ("method", "Generate")))
        deadline = time.monotonic() + 10
        running = ("kvtier_compute_running_sequences", ())

        def settled(samples):
            return samples.get(generate_ok) == 2 and samples.get(running) == 0

        while not settled(samples := scrape(port)) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [d.cached_prompt_tokens for d in done] == [0, 32]
    assert samples[("kvtier_compute_generation_tokens_total", ())] == 12
    assert samples[("kvtier_compute_prompt_tokens_total", ())] == 80
    assert samples[("kvtier_compute_cached_prompt_tokens_total", ())] == 32
    assert samples[("kvtier_compute_time_to_first_token_seconds_count", ())] == 2
    assert samples[("kvtier_compute_inter_token_latency_seconds_count", ())] == 10
    assert samples[("kvtier_compute_finished_requests_total", (("finish_reason", "length"),))] == 2
    assert samples[("kvtier_compute_cache_calls_total", (("method", "allocate"),))] == 2
    # One Commit per prefill (the prompt, before its first token); the final commit rides on the
    # Free (issue 13: no standalone Commit on the decode path), and 6 tokens fit the lookahead.
    assert samples[("kvtier_compute_cache_calls_total", (("method", "commit"),))] == 2
    assert samples[("kvtier_compute_cache_calls_total", (("method", "free"),))] == 2
    assert samples.get(("kvtier_compute_cache_calls_total", (("method", "extend"),)), 0) == 0
    assert (
        samples[("kvtier_compute_rpc_duration_seconds_count", (("code", "OK"), ("method", "Generate")))] == 2
    )
    assert samples[("kvtier_compute_running_sequences", ())] == 0
    # Without --vllm-metrics only the kvtier_ (and process_) names.
    assert not [name for name, _ in samples if name.startswith("vllm:")]
    assert samples[("process_resident_memory_bytes", ())] > 0
