"""In-process Hugging Face baselines for bench/serve.py: serving the same model without kvtier.

  PreallocatedServer           what `model.generate` does: static batches, each request's KV in a
                               contiguous `StaticCache` row preallocated to max_model_len tokens.
  ContinuousBatchingServer     transformers' own continuous batching (`init_continuous_batching`):
                               a paged KV cache with prefix sharing, in this process.

Both run the model in a background thread and stream tokens to asyncio consumers through the
same small interface the kvtier stack gets in bench/serve.py (`stream`, `sample_memory`), so one
load generator drives every system. Their KV memory is read from what they allocate, never from
a model of it: the StaticCache rows of the batch in flight, the paged cache's block tables.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Reply:
    """What a system streams back for one request: new token ids, in order.

    cached_prompt_tokens: prompt tokens served from a prefix cache, set on the request's last reply
    (None on the others).
    """

    token_ids: list[int]
    cached_prompt_tokens: int | None = None


@dataclass
class MemorySample:
    """A system's KV memory at one instant.

    used_bytes: KV bytes held for live sequences (distinct blocks of a paged pool, or the
    preallocated rows of the batch in flight). slots: token slots in that memory. unused_slots:
    slots of it holding no token (partial last blocks, reserved lookahead, preallocated tail),
    None where it cannot be told at this instant. num_seqs: sequences holding KV now.
    """

    t: float
    used_bytes: int
    slots: int
    unused_slots: int | None
    num_seqs: int


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers: layers x 2 x kv_heads x head_dim x itemsize."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = config.num_key_value_heads or num_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * num_kv_heads * head_dim * itemsize


# --------------------------------------------------------------------------- preallocated


@dataclass
class _StaticRequest:
    prompt: list[int]
    max_tokens: int
    deliver: Callable[[object], None]  # thread-safe: int token, None (finished) or an Exception
    num_delivered: int = 0

    @property
    def finished(self) -> bool:
        return self.num_delivered >= self.max_tokens


class _BatchStreamer:
    """`generate` streamer: hands row i's new token to request i until it has its max_tokens.

    generate calls put() once with the prompt ids, then once per step with [batch] new tokens.
    Rows whose request is done keep decoding (a static batch runs until its longest request
    ends); their tokens are dropped.
    """

    def __init__(self, batch: list[_StaticRequest]):
        self.batch = batch
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for req, token in zip(self.batch, value.reshape(len(self.batch), -1)[:, -1].tolist(), strict=True):
            if req.finished:
                continue
            req.num_delivered += 1
            req.deliver(int(token))
            if req.finished:
                req.deliver(None)

    def end(self) -> None:
        pass


class PreallocatedServer:
    """Static batching over `model.generate` with a contiguous KV cache per request.

    Requests queue up; whenever the model is idle it takes up to `max_batch_size` of them, left-pads
    their prompts and runs one greedy `generate` with a `StaticCache(max_cache_len=max_model_len)`:
    every request owns max_model_len x kv_bytes_per_token bytes for its whole life, whatever its
    length. max_batch_size = KV budget / that, so this baseline gets the same KV memory as kvtier.
    """

    name = "hf-static-prealloc"

    def __init__(self, model, max_model_len: int, max_batch_size: int, pad_token_id: int = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.bytes_per_token = kv_bytes_per_token(model.config, model.dtype)
        self._pending: queue.Queue[_StaticRequest | None] = queue.Queue()
        self._batch: list[_StaticRequest] = []  # the batch in flight; replaced whole, never mutated
        self._thread: threading.Thread | None = None
        self.checked_cache_bytes = False  # set once a live StaticCache was seen to match our accounting

    def start(self) -> None:
        # The first generate call pays one-off costs (kernels, mask code paths): not the workload's.
        self._generate([[1, 2, 3, 4]], max_new_tokens=2, streamer=None)
        self._thread = threading.Thread(target=self._serve, name="prealloc-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join()
            self._thread = None

    async def stream(self, prompt: list[int], max_tokens: int, cache_salt: str = "") -> AsyncIterator[Reply]:
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"{len(prompt)} + {max_tokens} tokens exceed max_model_len {self.max_model_len}")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._pending.put(
            _StaticRequest(prompt, max_tokens, lambda x: loop.call_soon_threadsafe(items.put_nowait, x))
        )
        while True:
            item = await items.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                yield Reply([], cached_prompt_tokens=0)  # no prefix cache
                return
            yield Reply([item])

    async def sample_memory(self, records=None) -> MemorySample:
        batch = self._batch
        slots = len(batch) * self.max_model_len
        # KV of prompt + delivered tokens but the newest (its KV is written by the next step).
        held = sum(len(r.prompt) + max(0, r.num_delivered - 1) for r in batch)
        return MemorySample(
            time.perf_counter(), slots * self.bytes_per_token, slots, slots - held, len(batch)
        )

    def _serve(self) -> None:
        while True:
            first = self._pending.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._pending.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._run(batch)
            if stop:
                return

    def _run(self, batch: list[_StaticRequest]) -> None:
        self._batch = batch
        try:
            cache = self._generate(
                [r.prompt for r in batch], max(r.max_tokens for r in batch), _BatchStreamer(batch)
            )
            self._check_cache_bytes(cache, len(batch))
        except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, not the server
            for r in batch:
                if not r.finished:
                    r.deliver(e)
        finally:
            self._batch = []

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, streamer):
        from transformers import StaticCache

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token lines up
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        cache = StaticCache(config=self.model.config, max_cache_len=self.max_model_len)
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # no early EOS: every system makes exactly max_tokens
                do_sample=False,
                streamer=streamer,
                pad_token_id=self.pad_token_id,
            )
        return cache

    def _check_cache_bytes(self, cache, batch_size: int) -> None:
        """The accounting above must be what generate allocated: B x max_model_len x bytes per token."""
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        allocated = sum(t.numel() * t.element_size() for t in tensors)
        expected = batch_size * self.max_model_len * self.bytes_per_token
        if allocated != expected:
            raise RuntimeError(f"StaticCache holds {allocated} bytes, accounting says {expected}")
        self.checked_cache_bytes = True


# --------------------------------------------------------------------------- continuous batching


class _NoPsutilNoise(logging.Filter):
    """transformers logs an ERROR when psutil is missing on CPU; with num_blocks given it is moot."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


@dataclass
class _PrefixHits:
    """Prompt tokens each request got from transformers' prefix sharing (first lookup only)."""

    tokens: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ContinuousBatchingServer:
    """transformers' continuous batching with its paged cache, sized to the same KV budget.

    num_blocks blocks of block_size tokens (the same block size as kvtier, not transformers'
    default page of 256 tokens, which would waste far more on these short sequences), prefix
    sharing on, greedy, no EOS. Prefix hits are counted by wrapping the cache's own
    `search_prefix_match` (transformers reports none).
    """

    name = "hf-continuous-batching"

    def __init__(self, model, num_blocks: int, block_size: int, max_batch_tokens: int = 2048):
        self.model = model.eval()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.bytes_per_token = kv_bytes_per_token(model.config, model.dtype)
        self.manager = None
        self.pool_bytes = 0
        self._hits = _PrefixHits()
        self._ids = itertools.count()

    def start(self) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        logging.getLogger("ContinuousBatchingLogger").addFilter(_NoPsutilNoise())
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)
        cb_config = ContinuousBatchingConfig(
            page_size=self.block_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            allow_block_sharing=True,
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        self.manager.warmup()  # creates the batch processor and its cache now, so we can wrap it
        cache = self.manager.batch_processor.cache
        self.pool_bytes = cache.num_blocks * self.block_size * self.bytes_per_token
        search = cache.search_prefix_match
        hits = self._hits

        def counted_search(request_id: str, prompt_ids: list[int]) -> int:
            matched = search(request_id, prompt_ids)
            with hits.lock:
                hits.tokens.setdefault(request_id, matched)
            return matched

        cache.search_prefix_match = counted_search
        self.manager.start()
        self._run_one_warmup()

    def _run_one_warmup(self) -> None:
        async def one():
            async for _ in self.stream([1, 2, 3, 4, 5], 2):
                pass

        asyncio.run(one())

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30)
            self.manager.destroy()
            self.manager = None

    async def stream(self, prompt: list[int], max_tokens: int, cache_salt: str = "") -> AsyncIterator[Reply]:
        request_id = f"bench-{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(request_id, outputs.put_nowait)
        if (
            self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=True)
            is None
        ):
            raise RuntimeError(
                f"transformers continuous batching refused request {request_id} (not accepting)"
            )
        seen = 0
        while True:
            out = await outputs.get()
            if out.error:
                raise RuntimeError(
                    f"transformers continuous batching failed request {request_id}: {out.error}"
                )
            new = list(out.generated_tokens[seen:])
            seen += len(new)
            if out.is_finished():
                with self._hits.lock:
                    cached = self._hits.tokens.pop(request_id, 0)
                yield Reply(new, cached_prompt_tokens=cached)
                return
            if new:
                yield Reply(new)

    async def sample_memory(self, records=None) -> MemorySample:
        processor = self.manager.batch_processor
        for _ in range(10):  # the generation thread mutates these dicts: retry a torn snapshot
            try:
                allocator = next(iter(processor.cache.cache_allocators.values()))
                tables = {rid: list(t) for rid, t in list(allocator.block_table.items())}
                states = dict(processor.scheduler.active_requests)
                break
            except RuntimeError:
                continue
        else:
            return MemorySample(time.perf_counter(), 0, 0, None, 0)
        live = {rid: t for rid, t in tables.items() if t}
        blocks = {b for t in live.values() for b in t}
        slots = len(blocks) * self.block_size
        # Shared (prefix) blocks are full; a sequence's empty slots are in its own tail blocks.
        unused = 0
        for rid, table in live.items():
            state = states.get(rid)
            if state is None:  # finishing: its table outlives its state for a moment
                return MemorySample(time.perf_counter(), slots * self.bytes_per_token, slots, None, len(live))
            unused += max(0, len(table) * self.block_size - state.position_offset)
        return MemorySample(time.perf_counter(), slots * self.bytes_per_token, slots, unused, len(live))
