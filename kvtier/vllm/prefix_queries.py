"""How much of each arriving prompt the cache holds, asked as requests arrive, many per call.

vLLM hands the connector every new request (``on_new_request``) before its scheduler first asks
how many of the request's tokens the cache holds, and requests often arrive in bursts. Each
arriving prompt is queued here; one thread asks the cache service about every prompt queued since
its last call in one ``LookupPrefix`` per (salt, adapter). By the time the scheduler asks, the
answer is usually there, and a miss then costs the scheduler no call and no wait.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from concurrent.futures import Future

from kvtier.cache_errors import CacheCallError
from kvtier.vllm import LOGGER
from kvtier.vllm.cache_link import CacheDown, CacheLink, name_os_thread

log = logging.getLogger(LOGGER)

MAX_PROMPTS_PER_CALL = 64


class PrefixQueries:
    """``submit(tokens, salt, adapter)`` -> a Future of the leading tokens the cache holds on any
    tier (whole blocks, uncapped); 0 when the cache could not answer (down, refused: no hit)."""

    def __init__(self, link: CacheLink):
        self.link = link
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-prefix", daemon=True)
        self._thread.start()

    def submit(self, tokens: list[int], salt: str, adapter: str) -> Future:
        future: Future = Future()
        self._queue.put((tokens, salt, adapter, future))
        return future

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        name_os_thread("kvtier-prefix")
        while True:
            jobs = [self._queue.get()]
            while jobs[-1] is not None and len(jobs) < MAX_PROMPTS_PER_CALL:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = jobs[-1] is None
            groups = defaultdict(list)
            for job in jobs[:-1] if closing else jobs:
                groups[job[1], job[2]].append(job)
            for (salt, adapter), group in groups.items():
                self._answer(salt, adapter, group)
            if closing:
                return

    def _answer(self, salt: str, adapter: str, group: list) -> None:
        held = [0] * len(group)
        try:
            hits = self.link.call(
                lambda c: c.lookup_prefix([job[0] for job in group], tenant_salt=salt, adapter_id=adapter)
            )
            held = [hit.total for hit in hits]
        except CacheDown as e:
            log.debug("kvtier: LookupPrefix of %d prompts: no answer (%s)", len(group), e)
        except CacheCallError as e:
            log.warning("kvtier: LookupPrefix of %d prompts refused: %s: %s", len(group), e.code, e.details)
        except Exception:
            log.exception("kvtier: LookupPrefix of %d prompts failed", len(group))
        for job, tokens in zip(group, held, strict=True):
            job[3].set_result(tokens)
