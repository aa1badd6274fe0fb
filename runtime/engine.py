"""`plait.Engine`: the runtime in process — tokenize, schedule, detokenize — without HTTP.

The scheduler runs on its own thread; callers submit requests and receive result objects shaped
as in the native protocol (`shared/protocol.md`), whole, streamed, or awaited.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from .detokenizer import IncrementalDetokenizer, stop_holdback, trim_stop
from .request import GenerateInput, TokenOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .server_args import ServerArgs

logger = logging.getLogger(__name__)


class RequestState:
    """Consumer-side state of one request: detokenized text, logprobs, meta info."""

    def __init__(self, rid: str, params: SamplingParams, tokenizer, return_text_in_logprobs: bool):
        self.rid = rid
        self.params = params
        self.tokenizer = tokenizer
        self.with_text = return_text_in_logprobs
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                            params.spaces_between_special_tokens)
        self.output_ids: list[int] = []
        self.finish_reason: dict | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.meta_logprobs: dict[str, list] = {}
        self.start = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: TokenOutput) -> None:
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.output_ids += out.new_ids
        reason = out.finish_reason
        new = out.new_ids
        # EOS / stop-token ids are counted but never shown as text.
        if reason is not None and isinstance(reason.get("matched"), int) and new and new[-1] == reason["matched"]:
            new = new[:-1]
        self.detok.add(new, final=reason is not None)
        for key in ("input_logprobs", "input_top_logprobs", "output_logprobs", "output_top_logprobs"):
            val = getattr(out, key)
            if val is not None:
                self.meta_logprobs.setdefault(_meta_key(key), []).extend(val)
        self.finish_reason = reason

    def text(self, streaming: bool = False) -> str:
        text = self.detok.text
        stops = self.params.stop
        if not stops:
            return text
        if self.finished:
            return text if self.params.no_stop_trim else trim_stop(text, stops)
        return text[:len(text) - stop_holdback(text, stops)] if streaming else text

    def result(self, streaming: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.start,
        }
        for key, val in self.meta_logprobs.items():
            meta[key] = [self._triples(v) for v in val] if key.endswith("top_logprobs") else self._triples(val)
        return {"text": self.text(streaming), "output_ids": list(self.output_ids), "meta_info": meta}

    def _triples(self, pairs: list | None) -> list | None:
        if pairs is None:
            return None
        if not self.with_text:
            return [[lp, tid, None] for lp, tid in pairs]
        return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in pairs]


def _meta_key(key: str) -> str:
    # input_logprobs -> input_token_logprobs, output_top_logprobs -> output_top_logprobs
    return key.replace("_logprobs", "_token_logprobs") if "top" not in key else key


class Engine:
    """The inference engine in this process.

    >>> with plait.Engine(model="smollm2") as engine:
    ...     engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    """

    def __init__(self, model: str = "smollm2", **server_args: Any):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.args = ServerArgs.from_kwargs(model=model, **server_args)
        logging.getLogger("plait").setLevel(self.args.log_level.upper())
        self.scheduler = Scheduler(self.args)
        self.tokenizer = self.scheduler.tokenizer
        self._rng = random.Random(self.args.random_seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[TokenOutput], None]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="plait-scheduler", daemon=True)
        self._thread.start()

    # --- public API ------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False,
                 rid: str | list[str] | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a result dict), a list (a list of results, n per item), or stream
        one prompt (an iterator of cumulative results)."""
        batch, states, inputs = self._submit(prompt, sampling_params, input_ids, return_logprob,
                                             logprob_start_len, top_logprobs_num, return_text_in_logprobs,
                                             rid, stream, strict=True)
        channel: queue.SimpleQueue = queue.SimpleQueue()
        self._register(inputs, channel.put)
        if stream:
            return self._stream_sync(states[0], channel)
        pending = len(states)
        by_rid = {s.rid: s for s in states}
        while pending:
            out = channel.get()
            st = by_rid[out.rid]
            st.update(out)
            pending -= st.finished
        results = [s.result() for s in states]
        return results if batch else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None,
                             strict: bool = True) -> dict | list[dict] | AsyncIterator[dict]:
        """Like `generate`, awaited; with `stream=True` returns an async iterator. `strict=False`
        ignores unknown sampling keys (the HTTP protocol's rule) instead of raising."""
        batch, states, inputs = self._submit(prompt, sampling_params, input_ids, return_logprob,
                                             logprob_start_len, top_logprobs_num, return_text_in_logprobs,
                                             rid, stream, strict=strict)
        loop = asyncio.get_running_loop()
        channel: asyncio.Queue = asyncio.Queue()
        self._register(inputs, lambda out: loop.call_soon_threadsafe(channel.put_nowait, out))
        if stream:
            return self._stream_async(states[0], channel)
        pending = len(states)
        by_rid = {s.rid: s for s in states}
        while pending:
            out = await channel.get()
            st = by_rid[out.rid]
            st.update(out)
            pending -= st.finished
        results = [s.result() for s in states]
        return results if batch else results[0]

    def abort(self, rid: str) -> None:
        """Abort a request by id; its KV is released and its result ends with reason `abort`."""
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        """Empty the prefix cache (only succeeds when no request is running)."""
        return self._call(self.scheduler.flush_cache)

    def kv_slots_in_use(self) -> int:
        """KV slots held by requests (neither free nor cached); 0 when idle."""
        return self._call(self.scheduler.kv_slots_in_use)

    def get_server_info(self) -> dict[str, Any]:
        """Arguments and counters."""
        def info():
            s = self.scheduler
            return {"server_args": dict(vars(self.args)), "num_prompt_tokens": s.num_prompt_tokens,
                    "num_cached_tokens": s.num_cached_tokens, "num_generated_tokens": s.num_generated_tokens,
                    "num_retractions": s.num_retractions, "max_total_num_tokens": s.num_slots,
                    "cache_size": s.cache.total_size(), "free_slots": s.allocator.available(),
                    "context_length": s.context_len, "num_running": len(s.running), "num_waiting": len(s.waiting)}
        return self._call(info)

    def shutdown(self) -> None:
        """Stop the scheduler thread; pending requests end with reason `abort`."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # --- internals -------------------------------------------------------------------------
    def _submit(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, return_text_in_logprobs, rid, stream, strict):
        if self._stopped.is_set():
            raise RuntimeError("the engine has been shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            batch = isinstance(prompt, list)
            texts = prompt if batch else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a str or a list of str")
            ids_list = [self.tokenizer(t).input_ids for t in texts]
        else:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list = input_ids if batch else [input_ids]
            if not all(isinstance(i, int) and not isinstance(i, bool) for ids in ids_list for i in ids):
                raise ValueError("input_ids must be a list of int or a list of lists of int")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts")
            param_list = sampling_params
        else:
            param_list = [sampling_params] * len(ids_list)
        if logprob_start_len is None or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be >= -1, got {logprob_start_len}")
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        states, inputs = [], []
        for ids, raw, item_rid in zip(ids_list, param_list, rids):
            params = SamplingParams.from_dict(raw, strict=strict)
            params.validate(self.scheduler.runner.vocab_size)
            start = logprob_start_len
            if return_logprob and start == -1 and params.max_new_tokens == 0:
                start = 0   # protocol: prefill-only calls score the whole prompt
            base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
            for i in range(params.n):
                r = item_rid if item_rid and params.n == 1 else (f"{item_rid}-{i}" if item_rid else uuid.uuid4().hex)
                inputs.append(GenerateInput(rid=r, input_ids=list(ids), params=params, seed=base_seed + i,
                                            return_logprob=return_logprob,
                                            logprob_start_len=start if return_logprob else -1,
                                            top_logprobs_num=top_logprobs_num if return_logprob else 0))
                states.append(RequestState(r, params, self.tokenizer, return_text_in_logprobs))
        if stream and len(states) != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        for inp in inputs:
            self._validate_size(inp)
        return batch, states, inputs

    def _validate_size(self, inp: GenerateInput) -> None:
        n = len(inp.input_ids)
        s = self.scheduler
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= s.context_len:
            raise ValueError(f"the prompt has {n} tokens, more than the context length allows ({s.context_len})")
        if n + 1 > s.num_slots:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({s.num_slots})")

    def _register(self, inputs: list[GenerateInput], sink: Callable[[TokenOutput], None]) -> None:
        for inp in inputs:
            self._inbox.put(("add", inp, sink))

    def _stream_sync(self, state: RequestState, channel: queue.SimpleQueue) -> Iterator[dict]:
        try:
            while not state.finished:
                state.update(channel.get())
                yield state.result(streaming=True)
        finally:
            if not state.finished:
                self.abort(state.rid)

    async def _stream_async(self, state: RequestState, channel: asyncio.Queue) -> AsyncIterator[dict]:
        try:
            while not state.finished:
                state.update(await channel.get())
                yield state.result(streaming=True)
        finally:
            if not state.finished:
                self.abort(state.rid)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the scheduler thread (no races with a step) and return its result."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("call", fn, done))
        ok, val = done.get()
        if not ok:
            raise val
        return val

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, inp, sink = msg
            try:
                self.scheduler.add_request(inp)
                self._sinks[inp.rid] = sink
            except ValueError as e:
                sink(TokenOutput(rid=inp.rid, new_ids=[], finish_reason={"type": "abort", "message": str(e)}))
        elif kind == "abort":
            out = self.scheduler.abort_request(msg[1])
            if out is not None:
                self._deliver([out])
        elif kind == "call":
            _, fn, done = msg
            try:
                done.put((True, fn()))
            except Exception as e:  # handed back to the caller
                done.put((False, e))

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.rid)
            if sink is None:
                continue
            if out.finish_reason is not None:
                del self._sinks[out.rid]
            sink(out)

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stopped.is_set():
            try:   # block only when there is nothing to step
                msg = self._inbox.get_nowait() if sched.has_work() else self._inbox.get()
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self._stopped.is_set():
                break
            try:
                self._deliver(sched.step())
            except Exception as e:  # never leave callers hanging on a dead loop
                logger.exception("scheduler step failed")
                self._fail_all(f"internal error: {e}")
        self._fail_all("the engine was shut down")

    def _fail_all(self, message: str) -> None:
        for rid in list(self._sinks):
            out = self.scheduler.abort_request(rid) or TokenOutput(rid=rid, new_ids=[])
            out.finish_reason = {"type": "abort", "message": message}
            self._deliver([out])
