"""The DSL's public functions: `function`, `gen`, `select`, roles, default backend."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import inspect
import os
import threading
from typing import Any, Callable

from . import context
from .backends import BaseBackend, as_backend
from .interpreter import ProgramState, StreamExecutor
from .ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Call, ExprList, Gen, Role, RoleBegin, RoleEnd,
                 Select, schema_to_str)

token_length_normalized = "token_length_normalized"
greedy_token = "greedy_token"
greedy_token_selection = greedy_token          # SGLang's name
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"

_default_backend: BaseBackend | None = None
_backend_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` is not given one: a backend object or a `plait.Engine`."""
    global _default_backend
    with _backend_lock:
        _default_backend = as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    return _default_backend


def _resolve_backend(backend: Any) -> BaseBackend:
    if backend is None:
        backend = _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call plait.set_default_backend(...)")
    return as_backend(backend)


# --- expressions -----------------------------------------------------------------------------------
_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL}


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, repetition_penalty: float | None = None,
        ignore_eos: bool | None = None, regex: str | None = None, json_schema: Any = None,
        ebnf: str | None = None, choices: list[str] | None = None, dtype: type | None = None,
        seed: int | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        max_new_tokens: int | None = None, choices_method: str | None = None) -> Gen | Select:
    """Generate into variable `name`. One of regex / json_schema (dict, JSON string or pydantic
    model class) / ebnf / choices / dtype (int, float, bool: by regex) constrains the output."""
    if choices is not None:
        return Select(name, list(choices), choices_method or token_length_normalized)
    if dtype is not None:
        if dtype in _DTYPE_REGEX:
            regex = regex or _DTYPE_REGEX[dtype]
        elif dtype is not str:
            raise ValueError(f"dtype must be int, float, bool or str, got {dtype!r}")
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"give at most one of regex, json_schema, ebnf (got {constraints})")
    params = {"max_new_tokens": max_new_tokens if max_new_tokens is not None else max_tokens,
              "min_new_tokens": min_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
              "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
              "repetition_penalty": repetition_penalty, "ignore_eos": ignore_eos, "regex": regex,
              "json_schema": schema_to_str(json_schema), "ebnf": ebnf, "seed": seed}
    logprob = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
               "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs}
    return Gen(name, params, logprob)


def gen_int(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Gen:
    """A double-quoted string of word characters and spaces (SGLang's REGEX_STR)."""
    return gen(name, regex=REGEX_STR, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None,
           choices_method: str = token_length_normalized, temperature: float = 0.0) -> Select:
    """Pick one of `choices` by its likelihood after the text so far (prefill-only scoring)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices), choices_method, temperature)


def system(expr: Any = None) -> Role:
    return Role("system", expr)


def user(expr: Any = None) -> Role:
    return Role("user", expr)


def assistant(expr: Any = None) -> Role:
    return Role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> None:
    _resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return _resolve_backend(backend).get_server_info()


# --- programs --------------------------------------------------------------------------------------
_DEFAULTS = dict(max_new_tokens=128, stop=None, stop_token_ids=None, temperature=1.0, top_p=1.0, top_k=-1,
                 min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False, seed=None,
                 return_logprob=None, logprob_start_len=None, top_logprobs_num=None,
                 return_text_in_logprobs=None)
_LOGPROB = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class Function:
    """A program: `@plait.function def prog(s, ...)`; run it with `prog.run(...)` or `run_batch`."""

    def __init__(self, func: Callable, bind_arguments: dict | None = None):
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError("a plait function takes the state as its first argument")
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "Function":
        unknown = set(kwargs) - set(self.arg_names)
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in inspect.signature(self.func).parameters.values()):
            raise TypeError(f"{self.func.__name__}() has no arguments {sorted(unknown)}")
        return Function(self.func, {**self.bind_arguments, **kwargs})

    @staticmethod
    def _settings(kwargs: dict) -> tuple[dict, dict, dict]:
        """Split keyword arguments into the sampling and logprob settings given and the rest."""
        kwargs = dict(kwargs)
        kwargs.pop("use_thread", None)       # SGLang's flag: states always run on their own thread here
        if "max_tokens" in kwargs and "max_tokens" not in _DEFAULTS:   # gen's spelling, also accepted here
            kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in _DEFAULTS}
        sampling = {k: v for k, v in given.items() if k not in _LOGPROB}
        logprob = {k: v for k, v in given.items() if k in _LOGPROB}
        return sampling, logprob, kwargs

    def _split(self, kwargs: dict) -> tuple[dict, dict, dict]:
        """Like `_settings`, with SGLang's defaults filled in."""
        sampling, logprob, rest = self._settings(kwargs)
        sampling = {**{k: v for k, v in _DEFAULTS.items() if k not in _LOGPROB}, **sampling}
        logprob = {**{k: _DEFAULTS[k] for k in _LOGPROB}, **logprob}
        return sampling, logprob, rest

    def _new_state(self, backend, sampling, logprob, stream) -> ProgramState:
        return ProgramState(StreamExecutor(backend, sampling, logprob, stream))

    def _body(self, state: Any, args: tuple, kwargs: dict) -> Any:
        """Run the Python body on `state` (this thread), as the innermost running program."""
        with context.running(state, tracing=isinstance(state, _TraceState)):
            return self.func(state, *args, **{**self.bind_arguments, **kwargs})

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        """The body, then the end of the state's input; the body's own error is kept in the state
        (and stops the rest of the program) instead of being raised."""
        ex = state.stream_executor
        ex.begin_body()
        try:
            state.ret_value = self._body(state, args, kwargs)
        except BaseException as e:   # noqa: BLE001 - kept in the state
            state._program_error = e
            ex.fail(e)
        finally:
            ex.end_body()
            ex.end()

    def _start(self, state: ProgramState, args: tuple, kwargs: dict) -> threading.Thread:
        """Run the body on a thread of its own (so the caller can stream or await the state)."""
        t = threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True,
                             name=f"plait-program-{self.func.__name__}")
        t.start()
        return t

    def run(self, *args, stream: bool = False, backend: Any = None, **kwargs) -> ProgramState:
        """Run once; returns the state when done (or at once with `stream=True`: read it with
        `state.text_iter()`). Errors, the program's own or a backend's, are raised."""
        sampling, logprob, kwargs = self._split(kwargs)
        state = self._new_state(_resolve_backend(backend), sampling, logprob, stream)
        if stream:      # the body runs on its own thread, so it may read its own variables
            self._start(state, args, kwargs)
            return state
        self._execute(state, args, kwargs)
        return _finished(state)

    async def run_async(self, *args, stream: bool = False, backend: Any = None, **kwargs) -> ProgramState:
        """`run` for asyncio: awaits the program without blocking the event loop (its body and its
        calls run on threads of their own). With `stream=True` returns at once: read the state
        with `async for piece in state.text_async_iter(): ...`."""
        sampling, logprob, kwargs = self._split(kwargs)
        state = self._new_state(_resolve_backend(backend), sampling, logprob, stream)
        self._start(state, args, kwargs)
        if stream:
            return state
        await state.wait_async()
        return _finished(state)

    def run_batch(self, batch_kwargs: list[dict], *, backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, **kwargs) -> list[ProgramState]:
        """Run the program once per dict of arguments, concurrently on `num_threads` threads. A
        program that fails keeps its error in its own state (`state.error()`); the others go on.
        As in SGLang, the program's constant prefix is sent once first, so the batch shares it."""
        sampling, logprob, rest = self._split(dict(kwargs))
        if rest:
            raise TypeError(f"run_batch got unexpected arguments {sorted(rest)}; program arguments go in batch_kwargs")
        be = _resolve_backend(backend)
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), 64, 4 * (os.cpu_count() or 1) + 8))
        if len(batch_kwargs) > 1:
            self.cache(be)

        def one(args: dict) -> ProgramState:
            state = self._new_state(be, sampling, logprob, False)
            self._execute(state, (), args)
            state.stream_executor.wait_finished()
            return state

        states: list[ProgramState | None] = [None] * len(batch_kwargs)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(batch_kwargs), desc=self.func.__name__)
        with cf.ThreadPoolExecutor(max_workers=int(num_threads) or 1) as pool:
            futures = {pool.submit(one, a): i for i, a in enumerate(batch_kwargs)}
            for fut in cf.as_completed(futures):
                states[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states  # type: ignore[return-value]

    def cache(self, backend: Any = None) -> None:
        """Warm the cache with the program's constant prefix: the text before the first call
        that needs an argument or the model (traced with placeholder arguments)."""
        be = _resolve_backend(backend)
        prefix = _trace_prefix(self, be)
        if len(prefix) > 64:      # shorter ones are not worth a request (SGLang's threshold)
            be.cache_prefix(prefix)

    def __call__(self, *args, **kwargs) -> Any:
        """Outside a program: `run`. Inside one (SGLang's nested call):

        - `inner(s, ...)` runs inner's body on the state `s` now, as a helper function would, and
          returns what the body returns;
        - `s += inner(...)` (also in a list, a role or a fork: `f += inner(...)`) runs inner's
          body on that state, in order with the text around it: inner's text continues the
          outer program's text and the variables inner sets are the outer state's variables;
        - `x = inner(...)` not appended is a program of its own on the same backend (SGLang's
          `branch = expand(tip=...)`), started as soon as the caller reads any value, so that
          several run concurrently; `x["var"]`, `x.text()` wait for it.

        Keyword sampling settings (`inner(..., temperature=0)`) apply to inner's calls only.
        """
        if args and isinstance(args[0], (ProgramState, _TraceState)):
            sampling, logprob, rest = self._settings(kwargs)
            return _inline(self, args[0], args[1:], rest, sampling, logprob)
        frame = context.current()
        if frame is None:
            return self.run(*args, **kwargs)
        call = ProgramCall(self, args, kwargs, frame)
        frame.pending.append(call)
        return call


def _finished(state: ProgramState) -> ProgramState:
    """A finished state, or the error that stopped it raised (the program's own as it is)."""
    ex = state.stream_executor
    ex.wait_finished()
    if state._program_error is not None:
        raise state._program_error
    ex.raise_error()
    return state


def _inline(fn: Function, state: Any, args: tuple, kwargs: dict, sampling: dict, logprob: dict) -> Any:
    """Run `fn`'s body on `state`; its own sampling settings apply to the expressions it appends."""
    if not (sampling or logprob) or isinstance(state, _TraceState):
        return fn._body(state, args, kwargs)
    ex = state.stream_executor
    ex.submit(lambda e: e.push_defaults(sampling, logprob))
    try:
        return fn._body(state, args, kwargs)
    finally:
        ex.submit(lambda e: e.pop_defaults())


class ProgramCall(Call):
    """`inner(...)` inside a running program: run inline where it is appended, else a program of
    its own (see `Function.__call__`). Reading it (`call["var"]`, `call.text()`, ...) reads the
    state it ran on."""

    def __init__(self, fn: Function, args: tuple, kwargs: dict, frame: context.Frame):
        self._fn, self._args, self._frame = fn, args, frame
        self._sampling, self._logprob, self._kwargs = fn._settings(kwargs)
        self._state: ProgramState | None = None      # where it ran last
        self._own = False                             # started as a program of its own
        self._lock = threading.Lock()

    def _unpend(self) -> None:
        with self._lock:
            if self in self._frame.pending:
                self._frame.pending.remove(self)

    def inline_into(self, state: Any) -> None:
        self._unpend()
        if self._own:       # already running as a program of its own: append what it produces
            state.stream_executor.submit(self._state)
            return
        _inline(self._fn, state, self._args, self._kwargs, self._sampling, self._logprob)
        if isinstance(state, ProgramState):
            self._state = state

    def start(self) -> None:
        """Start as a program of its own (once), on the caller's backend and settings."""
        self._unpend()
        with self._lock:
            if self._state is not None:
                return
            if self._frame.tracing:
                raise _Stop
            outer = self._frame.state.stream_executor
            self._own = True
            self._state = ProgramState(StreamExecutor(
                outer.backend, {**outer.default_sampling, **self._sampling},
                {**outer.default_logprob, **self._logprob}, outer.stream))
        self._fn._start(self._state, self._args, self._kwargs)

    def _resolve(self) -> ProgramState:
        self.start()
        return self._state   # type: ignore[return-value]

    def __getitem__(self, name: str) -> Any:
        return self._resolve()[name]

    def __contains__(self, name: str) -> bool:
        return name in self._resolve()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._resolve(), name)

    def __repr__(self) -> str:
        return f"ProgramCall({self._fn.func.__name__}, started={self._state is not None})"


class _Stop(Exception):
    pass


class _TraceState:
    """Collects leading constant text until anything else is appended."""

    def __init__(self):
        self.text = ""

    def __iadd__(self, other):
        self._add(other)
        return self

    def _add(self, other):
        if isinstance(other, str):
            self.text += other
        elif isinstance(other, ExprList):
            for it in other.items:
                self._add(it)
        elif isinstance(other, Call):
            other.inline_into(self)
        else:
            raise _Stop

    def __getattr__(self, name):
        raise _Stop


def _trace_prefix(fn: Function, backend: BaseBackend) -> str:
    st = _TraceState()
    args = {n: _Arg() for n in fn.arg_names if n not in fn.bind_arguments}
    try:
        fn._body(st, (), args)
    except Exception:
        pass
    return st.text


class _Arg:
    """A placeholder argument: any use of it stops the trace."""

    def __getattr__(self, name):
        raise _Stop

    def __str__(self):
        raise _Stop

    def __add__(self, other):
        raise _Stop

    __radd__ = __add__


def function(func: Callable | None = None, **_ignored) -> Function | Callable[[Callable], Function]:
    """Decorator: `@plait.function` (also `@plait.function()`)."""
    if func is None:
        return lambda f: Function(f)
    return Function(func)
