"""GrammarCache: compiles specs off-thread, once per (backend, options, kind, spec)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from .base import Grammar, GrammarBackend, GrammarError, GrammarSpec


def _settle(fut: Future, result=None, exc: BaseException | None = None) -> bool:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:  # already settled (timed out first)
        return False


class GrammarCache:
    """`submit(spec)` returns a Future[Grammar] at once; the compile runs in a worker thread (the
    outlines backend builds its index in a child process under memory / time limits).

    - Equal specs share one Future (and so one compiled Grammar); failures are cached too, so a
      bad spec is rejected at once the next time.
    - A compile running past `compile_timeout_s` fails its Future with GrammarError("compiling
      took longer than N s"). The outlines backend kills its worker then; for the in-process
      backends the compile finishes in the background and its late result replaces the cached
      error (a later request for the same spec gets it).
    - At most `max_entries` specs are kept (least recently used are dropped first).
    Do not cancel the returned Futures: they are shared between requests."""

    def __init__(
        self, backend: GrammarBackend, *, max_workers: int = 2, compile_timeout_s: float = 30.0, max_entries: int = 1024
    ) -> None:
        self.backend = backend
        self.compile_timeout_s = float(compile_timeout_s)
        self.max_entries = int(max_entries)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="plait-grammar")
        self._entries: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def key(self, spec: GrammarSpec) -> tuple:
        return (*self.backend.cache_key, spec.kind, spec.spec)

    def submit(self, spec: GrammarSpec) -> "Future[Grammar]":
        key = self.key(spec)
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None and not fut.cancelled():
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = Future()
            self._entries[key] = fut
            self._evict()
        self._pool.submit(self._run, key, spec, fut)
        return fut

    def get(self, spec: GrammarSpec, timeout: float | None = None) -> Grammar:
        """Blocking convenience: the compiled grammar, or GrammarError."""
        return self.submit(spec).result(timeout)

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self._entries.pop(oldest)

    def _run(self, key: tuple, spec: GrammarSpec, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        limit = self.compile_timeout_s
        timer = threading.Timer(
            limit,
            lambda: _settle(fut, exc=GrammarError(f"{self.backend.name}: compiling took longer than {limit:g} s")),
        )
        timer.daemon = True
        timer.start()
        t0 = time.perf_counter()
        try:
            grammar = self.backend.compile(spec, timeout_s=limit)
            outcome: tuple = (grammar, None)
        except GrammarError as e:
            outcome = (None, e)
        except Exception as e:  # noqa: BLE001 — a backend bug must not leave the Future pending
            outcome = (None, GrammarError(f"{self.backend.name}: compiling failed: {type(e).__name__}: {e}"))
        finally:
            timer.cancel()
        if outcome[0] is not None:
            outcome[0].compile_time_s = time.perf_counter() - t0
        if not _settle(fut, outcome[0], outcome[1]):
            # the Future timed out while this compile ran on: cache its late outcome instead
            late: Future = Future()
            late.set_running_or_notify_cancel()
            _settle(late, outcome[0], outcome[1])
            with self._lock:
                if self._entries.get(key) is fut:
                    self._entries[key] = late

    def stats(self) -> dict:
        with self._lock:
            n = len(self._entries)
        return {"entries": n, "hits": self.hits, "misses": self.misses}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def shutdown(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            pending = [f for f in self._entries.values() if not f.done()]
        for f in pending:
            if not f.running():
                _settle(f, exc=GrammarError("the grammar cache was shut down"))
