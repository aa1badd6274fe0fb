"""`plait.Engine`: the runtime as a Python object — tokenize, schedule, detokenize — without HTTP.

The scheduler (the model worker) runs in its own process, reached over ZeroMQ (see
`scheduler_client.py`); its token ids pass through a detokenizer process
(`detokenizer_process.py`), which adds each output's new text, on their way back here.
Tokenization stays in the caller's process, and so do stop-string trimming and the streaming
hold-back, which work on each request's accumulated text. Callers submit requests and receive
result objects shaped as in the native protocol (`shared/protocol.md`), whole, streamed, or
awaited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import random
import sys
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Callable, Iterator

import msgspec

from .managers.detokenizer import stop_holdback, trim_stop
from .managers.scheduler_client import SchedulerClient
from .model_executor.model_loader import load_config, load_tokenizer, read_chat_template, resolve_model
from .output_check import answer_part, schema_violation
from .request import GenerateInput, TokenOutput
from .sampling_params import SamplingParams
from .server_args import ServerArgs

logger = logging.getLogger(__name__)


class RequestState:
    """Consumer-side state of one request: its text (accumulated from the detokenizer process's
    deltas), logprobs, meta info."""

    def __init__(self, rid: str, params: SamplingParams, tokenizer, return_text_in_logprobs: bool):
        self.rid = rid
        self.params = params
        self.tokenizer = tokenizer
        self.with_text = return_text_in_logprobs
        self.full_text = ""  # detokenized, before stop trimming and hold-back
        self.output_ids: list[int] = []
        self.finish_reason: dict | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.meta_logprobs: dict[str, list] = {}
        self.embedding: list[float] | None = None
        self.start = time.perf_counter()
        self.resamples_left = 0  # set by the engine: invalid JSON documents it may sample again
        self.resampled = 0
        self.resample = False  # set when this state wants its request sent again

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _restart(self) -> None:
        """Forget the invalid attempt (its text, tokens and output logprobs) before sampling again."""
        self.full_text, self.output_ids = "", []
        self.meta_logprobs = {k: [] for k in self.meta_logprobs if k.startswith("output")}
        self.resamples_left -= 1
        self.resampled += 1
        self.resample = True

    def update(self, out: TokenOutput) -> None:
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.output_ids += out.new_ids
        if out.embedding is not None:
            self.embedding = out.embedding
        reason = out.finish_reason
        self.full_text += out.text_delta  # EOS / stop-token ids are already left out of it
        for key in ("input_logprobs", "input_top_logprobs", "output_logprobs", "output_top_logprobs"):
            val = getattr(out, key)
            if val is not None:
                self.meta_logprobs.setdefault(_meta_key(key), []).extend(val)
        if (
            reason is not None
            and reason.get("type") == "stop"
            and self.params.json_schema is not None
            and not isinstance(reason.get("matched"), str)
        ):  # not cut by the caller's own stop string
            p = self.params
            problem = schema_violation(p.json_schema, answer_part(self.text(), p.reasoning_start, p.reasoning_end))
            if problem is not None and self.resamples_left > 0:
                # a keyword the grammar only approximated: another sample, not an error, while allowed
                self._restart()
                return
            if problem is not None:
                tries = f" ({self.resampled + 1} documents sampled, none valid)" if self.resampled else ""
                reason = {"type": "abort", "message": problem + tries}
        self.finish_reason = reason

    def text(self, streaming: bool = False) -> str:
        text = self.full_text
        stops = self.params.stop
        if not stops:
            return text
        if self.finished:
            return text if self.params.no_stop_trim else trim_stop(text, stops)
        return text[: len(text) - stop_holdback(text, stops)] if streaming else text

    def result(self, streaming: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.resampled:
            meta["json_resampled"] = self.resampled  # documents discarded for breaking the schema
        for key, val in self.meta_logprobs.items():
            meta[key] = [self._triples(v) for v in val] if key.endswith("top_logprobs") else self._triples(val)
        if self.embedding is not None:
            return {"embedding": self.embedding, "meta_info": meta}
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
    """The inference engine: a handle in this process on a scheduler process that runs the model.

    Shut it down (or use it as a context manager) to stop that process; it is also stopped when
    the engine is garbage-collected, at interpreter exit, and when this process dies.

    >>> with plait.Engine(model="smollm2") as engine:
    ...     engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    """

    def __init__(self, model: str = "smollm2", **server_args: Any):
        me = mp.current_process()
        # `_inheriting`: a spawned process is importing the main module; an unguarded script that
        # makes an Engine at import time would otherwise try to start a scheduler from inside ours.
        if me.daemon or getattr(me, "_inheriting", False):
            raise RuntimeError(
                "plait.Engine cannot be created in a daemonic process or while a spawned "
                "process imports the main module; if a script creates it at import time, "
                "put that under `if __name__ == '__main__':`"
            )
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.args = ServerArgs.from_kwargs(model=model, **server_args)
        logging.getLogger("plait").setLevel(self.args.log_level.upper())
        self._stopped = False
        # Resolved here, once (a GGUF is converted once), and checked before any process starts,
        # so an unknown path or an unsupported architecture raises its ValueError directly.
        self.model_path: str = resolve_model(self.args.model, revision=self.args.revision, float_weights=False)
        from .models import get_model_class  # imports torch: only when an engine is made

        config = load_config(self.model_path)
        get_model_class(config)
        if self.args.speculative_draft_model:  # the draft model too, before the target loads
            from .speculative.draft_model import check_vocab_size

            draft_config = load_config(resolve_model(self.args.speculative_draft_model, float_weights=False))
            get_model_class(draft_config)
            check_vocab_size(self.args.speculative_draft_model, draft_config.vocab_size, config.vocab_size)
        chat_template = read_chat_template(self.args.chat_template) if self.args.chat_template else None
        _no_torch_threads_here()
        self._client = SchedulerClient(self.args, self.model_path)
        # Stops the process when the engine is collected or at exit; refers to the client only.
        self._finalizer = weakref.finalize(self, self._client.close)
        try:
            self.tokenizer = load_tokenizer(self.model_path)  # while the child loads the model
            if chat_template is not None:
                self.tokenizer.chat_template = chat_template
            self._info: dict[str, Any] = self._client.wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self._rng = random.Random(self.args.random_seed)

    # --- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        _embed: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a result dict), a list (a list of results, n per item), or stream
        one prompt (an iterator of cumulative results)."""
        batch, states, inputs = self._submit(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            stream,
            strict=True,
            embed=_embed,
        )
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
            self._resubmit(st, inputs, channel.put)
        results = [s.result() for s in states]
        # a single prompt gives one result, or a list of n when it asks for n > 1
        return results if batch or len(results) > 1 else results[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        strict: bool = True,
        _embed: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """Like `generate`, awaited; with `stream=True` returns an async iterator. `strict=False`
        ignores unknown sampling keys (the HTTP protocol's rule) instead of raising."""
        batch, states, inputs = self._submit(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            stream,
            strict=strict,
            embed=_embed,
        )
        loop = asyncio.get_running_loop()
        channel: asyncio.Queue = asyncio.Queue()
        self._register(inputs, lambda out: loop.call_soon_threadsafe(channel.put_nowait, out))
        if stream:
            return self._stream_async(states[0], channel)
        pending = len(states)
        by_rid = {s.rid: s for s in states}
        sink = lambda out: loop.call_soon_threadsafe(channel.put_nowait, out)  # noqa: E731
        while pending:
            out = await channel.get()
            st = by_rid[out.rid]
            st.update(out)
            pending -= st.finished
            self._resubmit(st, inputs, sink)
        results = [s.result() for s in states]
        # a single prompt gives one result, or a list of n when it asks for n > 1
        return results if batch or len(results) > 1 else results[0]

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict]:
        """Embeddings (SGLang's `encode`): for each prompt `{"embedding": [float], "meta_info"}`, the last
        prompt token's final hidden state, L2-normalized. Prefill-only requests through the same
        scheduler, batches and prefix cache as generation."""
        return self.generate(prompt, {"max_new_tokens": 0}, input_ids, rid=rid, _embed=True)

    async def async_encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict]:
        """`encode`, awaited."""
        return await self.async_generate(prompt, {"max_new_tokens": 0}, input_ids, rid=rid, _embed=True)

    def abort(self, rid: str) -> None:
        """Abort a request by id; its KV is released and its result ends with reason `abort`."""
        if not self._stopped:
            self._client.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the prefix cache (only succeeds when no request is running)."""
        return self._call("flush_cache")

    def kv_slots_in_use(self) -> int:
        """KV slots held by requests (neither free nor cached); 0 when idle."""
        return self._call("kv_slots_in_use")

    def get_server_info(self) -> dict[str, Any]:
        """Arguments and counters; with tensor parallelism, each local rank's process and liveness."""
        info = {"server_args": dict(vars(self.args)), **self._call("get_server_info")}
        if self.args.tp_size > 1:
            procs = [self._client.process, *self._client.tp_workers]
            info["tp_ranks"] = [{"rank": i, "pid": p.pid, "alive": p.is_alive()} for i, p in enumerate(procs)]
        return info

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings (`encode`)."""
        return self._info["hidden_size"]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (unless `ignore_eos`): the config's and the tokenizer's."""
        return frozenset(self._info["eos_ids"])

    @property
    def failure(self) -> str | None:
        """Why the engine's processes can no longer be used (the scheduler or the detokenizer died
        or failed), or None while healthy."""
        return self._client.error

    @property
    def scheduler_pid(self) -> int:
        """Process id of the scheduler (model worker) process."""
        return self._client.process.pid

    @property
    def tp_worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel ranks > 0 on this node (empty at tp_size 1)."""
        return [proc.pid for proc in self._client.tp_workers]

    @property
    def detokenizer_pid(self) -> int:
        """Process id of the detokenizer process."""
        return self._client.detokenizer.pid

    @property
    def ipc_dir(self) -> str:
        """The private directory holding the ZeroMQ sockets (removed at shutdown)."""
        return self._client.ipc_dir

    def shutdown(self) -> None:
        """Stop the scheduler and detokenizer processes; pending requests end with reason `abort`."""
        self._stopped = True
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- internals -------------------------------------------------------------------------
    def _submit(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        rid,
        stream,
        strict,
        embed=False,
    ):
        self._check_running()
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
            params.validate(self._info["vocab_size"])
            params.grammar_spec()  # a malformed spec (e.g. a schema that is not JSON) fails here, as a ValueError
            start = logprob_start_len
            if return_logprob and start == -1 and params.max_new_tokens == 0:
                start = 0  # protocol: prefill-only calls score the whole prompt
            base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
            for i in range(params.n):
                r = item_rid if item_rid and params.n == 1 else (f"{item_rid}-{i}" if item_rid else uuid.uuid4().hex)
                inputs.append(
                    GenerateInput(
                        rid=r,
                        input_ids=list(ids),
                        params=params,
                        seed=base_seed + i,
                        return_logprob=return_logprob,
                        logprob_start_len=start if return_logprob else -1,
                        top_logprobs_num=top_logprobs_num if return_logprob else 0,
                        stream=stream,
                        return_embedding=embed,
                    )
                )
                state = RequestState(r, params, self.tokenizer, return_text_in_logprobs)
                if params.json_schema and not stream and params.temperature > 0 and params.top_k != 1:
                    state.resamples_left = self.args.json_resample
                if return_logprob:  # protocol: one triple per generated token, so [] for none
                    state.meta_logprobs["output_token_logprobs"] = []  # (SGLang's select reads it)
                    if top_logprobs_num:
                        state.meta_logprobs["output_top_logprobs"] = []
                states.append(state)
        if stream and len(states) != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        for inp in inputs:
            self._validate_size(inp)
        return batch, states, inputs

    def _validate_size(self, inp: GenerateInput) -> None:
        n = len(inp.input_ids)
        context_len, num_slots = self._info["context_len"], self._info["num_slots"]
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= context_len:
            raise ValueError(f"the prompt has {n} tokens, more than the context length allows ({context_len})")
        if n + 1 > num_slots:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({num_slots})")
        vocab = self._info["vocab_size"]
        if min(inp.input_ids) < 0 or max(inp.input_ids) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")

    def _check_running(self) -> None:
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        if self._client.error is not None:
            raise RuntimeError(f"the engine cannot serve: {self._client.error}")

    def _resubmit(self, state: RequestState, inputs: list[GenerateInput], sink: Callable[[TokenOutput], None]) -> None:
        """Send a request again, under its rid and a new seed, when its state asked to resample."""
        if not state.resample:
            return
        state.resample = False
        inp = next(i for i in inputs if i.rid == state.rid)
        seed = (inp.seed + state.resampled * 0x9E3779B97F4A7C15) % 2**62  # another stream, reproducibly
        logger.info(
            "request %s: its JSON document broke the schema; sampling again (%d left)", state.rid, state.resamples_left
        )
        self._register([msgspec.structs.replace(inp, seed=seed)], sink)

    def _register(self, inputs: list[GenerateInput], sink: Callable[[TokenOutput], None]) -> None:
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        self._client.submit(inputs, sink)

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

    def _call(self, method: str) -> Any:
        """Run a scheduler method in the scheduler process, between steps."""
        self._check_running()
        return self._client.call(method)


def run_worker_node(args: ServerArgs) -> int:
    """`plait serve --node-rank K` (K > 0): run this node's tensor-parallel ranks, which join rank 0
    at `args.dist_init_addr` and follow its batches, until they exit; 0 when all stopped cleanly."""
    from .managers.scheduler_process import openmp_environ, tp_worker_processes

    args = dataclasses.replace(args, model=resolve_model(args.model, revision=args.revision, float_weights=False))
    procs = tp_worker_processes(args, None, os.getpid())
    with openmp_environ(args):
        for proc in procs:
            proc.start()
    try:
        for proc in procs:
            proc.join()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


def _no_torch_threads_here() -> None:
    """The model runs in the scheduler process; this one only tokenizes. Transformers imports
    torch anyway, so keep its (unused) thread pool from competing for cores."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
