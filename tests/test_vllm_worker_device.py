"""The vLLM connector's worker side on each pool backend, without a vLLM build: a real cache service
(a subprocess owning the pool: POSIX shared memory, or on a GPU raw device memory mapped here
through a CUDA IPC handle), two ``WorkerSide``s as two engines' workers, each with its own lease.

Engine A saves blocks of its KV cache (written straight into the pool blocks its lease allocated,
then published by a Free with their commit, as the scheduler side does); engine B
asks the cache for the prompt, pins the hit and loads it into different blocks of its own cache:
byte for byte A's. On a GPU every copy is device to device. vLLM's CUDA build cannot be installed
on the GPU machine, so the caches are in the block-first layout vLLM 0.32's FlashAttention backend
writes (``[blocks, heads, block_size, 2 x head_dim]``, keys then values in the last dimension, its
``do_kv_cache_update``), and the connector learns it as it does inside vLLM: by probing the write.
tests/test_vllm_connector.py runs the same path inside real vLLM engines on CPU.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from servers import TOKEN, cache_service

from kvtier.kv_dtypes import torch_dtype
from kvtier.sequence_types import AllocateItem, CommitItem
from kvtier.vllm.backend_writes import FlashWrite
from kvtier.vllm.block_layout import BlockCopier, probe_layout
from kvtier.vllm.cache_link import CacheLink
from kvtier.vllm.config import ConnectorConfig
from kvtier.vllm.transfers import LoadItem, SaveItem, pool_name
from kvtier.vllm.worker import WorkerSide

VLLM_BLOCKS = 16  # blocks in each engine's own KV cache

BACKENDS = [
    "cpu-shm",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="no CUDA device here (scripts/gpu_evidence.sh runs it on a GPU machine)",
        ),
    ),
]


class Engine:
    """One engine's worker side: its lease, its KV cache (random), its copier."""

    def __init__(self, address: str, token_file: str, device: str, one_allocation: bool = False):
        cfg = ConnectorConfig.from_extra_config({"cache_address": address, "token_file": token_file})
        self.link = CacheLink(cfg, "worker")
        self.client = self.link.start()
        spec = self.client.pool
        _, num_layers, _, self.block_size, heads, head_dim = spec.shape
        shape = (VLLM_BLOCKS, heads, self.block_size, 2 * head_dim)
        dtype = torch_dtype(spec.dtype)
        if one_allocation:  # as vLLM 0.32 allocates them: every layer a view of one buffer
            self.caches = list(torch.randn((num_layers, *shape), device=device).to(dtype).unbind(0))
        else:
            self.caches = [torch.randn(shape, device=device).to(dtype) for _ in range(num_layers)]
        layer = FlashWrite(head_dim)
        gathers = [probe_layout(layer, c, self.block_size, heads, head_dim) for c in self.caches]
        self.copier = BlockCopier(self.caches, gathers, (2, self.block_size, heads, head_dim))
        self.worker = WorkerSide(self.copier)
        self.worker.map_pool(self.client)

    def blocks(self, ids: list[int]) -> list[torch.Tensor]:
        return [cache[ids] for cache in self.caches]

    def close(self) -> None:
        self.worker.close()
        self.link.close()


@pytest.mark.parametrize("one_allocation", ["saver", "loader"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_engine_s_saved_blocks_load_into_another_s_cache_byte_for_byte(
    backend, one_allocation, tiny_model_dir, tmp_path
):
    device = "cuda" if backend == "cuda" else "cpu"
    args = ["--model", str(tiny_model_dir), "--backend", backend, "--num-blocks", "64", "--lease-ttl", "60"]
    with cache_service(tmp_path / "run", *args) as cache:
        (tmp_path / "token").write_text(TOKEN)
        # One engine's layers in one allocation (copied through one view of all of them, as vLLM 0.32
        # allocates them), the other's apart (a copy per layer): A saves, B loads.
        token = str(tmp_path / "token")
        a = Engine(cache.address, token, device, one_allocation=one_allocation == "saver")
        b = Engine(cache.address, token, device, one_allocation=one_allocation == "loader")
        try:
            assert a.client.pool.backend == backend and a.copier.gathers[0] is not None  # a real relayout
            assert (a.copier.layer_stride is not None, b.copier.layer_stride is not None) == (
                one_allocation == "saver",
                one_allocation == "loader",
            )
            rng = random.Random(7)
            bs = a.block_size
            # Consecutive vLLM blocks (a copy per part, or per layer and part), then scattered ones (index ops).
            cases = [([3, 4, 5], [9, 10, 11]), ([12, 2, 7, 0], [15, 1, 6, 4])]
            prompts = [[rng.randrange(200) for _ in range(len(ids) * bs)] for ids, _ in cases]
            held = a.client.allocate(prompts)  # the pool blocks A's scheduler side would allocate
            name = pool_name(a.client.pool)
            saves = [
                SaveItem(f"save-{i}", name, s.block_table[: len(ids)], ids, len(ids), time.monotonic() + 30)
                for i, (s, (ids, _)) in enumerate(zip(held, cases, strict=True))
            ]
            # A save whose lease could lapse before it is written is not written (its blocks could be
            # another sequence's by then), and reported so: never published.
            late = SaveItem("late", name, held[0].block_table[:1], [1], 1, time.monotonic() - 1)
            a.worker.save([*saves, late])
            assert a.worker.take_saves_done() == [
                ("save-0", 3, True),
                ("save-1", 4, True),
                ("late", 1, False),
            ]
            assert a.worker.stats["saved_blocks"] == 7, a.worker.stats
            a.client.free(
                [s.sequence_id for s in held],
                [CommitItem(s.sequence_id, [], len(p)) for s, p in zip(held, prompts, strict=True)],
            )

            seqs = b.client.allocate([AllocateItem(p + [1]) for p in prompts])  # pins the hits
            assert [s.num_cached_tokens for s in seqs] == [len(p) for p in prompts]
            loads = [
                LoadItem(
                    f"req-{i}",
                    pool_name(b.client.pool),
                    s.block_table[: len(into)],
                    into,
                    time.monotonic() + 30,
                )  # fmt: skip
                for i, (s, (_, into)) in enumerate(zip(seqs, cases, strict=True))
            ]
            b.worker.load(loads)
            if device == "cuda":
                torch.cuda.synchronize()
            assert b.worker.take_failed_blocks() == set() and b.worker.stats["loaded_blocks"] == 7
            for saved, loaded in cases:
                for ours, theirs in zip(b.blocks(loaded), a.blocks(saved), strict=True):
                    assert torch.equal(ours, theirs)
            # A load whose lease deadline has passed is reported as failed blocks: vLLM recomputes.
            b.worker.load([LoadItem("late", loads[0].pool_name, loads[0].pool_block_ids, [13], 0.0)])
            assert b.worker.take_failed_blocks() == {13}
            b.client.free([s.sequence_id for s in seqs])
        finally:
            a.close()
            b.close()


def test_the_worker_side_imports_without_vllm():
    # The GPU machine has no vLLM build: this file must collect there (the module above imports
    # the worker side at the top), so nothing it needs may import vLLM.
    import subprocess
    import sys

    code = "import sys; sys.modules['vllm'] = None; import kvtier.vllm.worker, kvtier.vllm.transfers, kvtier.vllm.backend_writes"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
