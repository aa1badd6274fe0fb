"""The DSL's public functions: `function`, `gen`, `select`, roles, default backend.

The names and parameters are SGLang 0.5.5's frontend API (`sglang/lang/api.py`), with the same
meaning; the few that plait does not do (images, video, `Runtime`, `trace`, `compile`) raise
NotImplementedError naming what is missing. `tests/frontend/test_dsl_sglang_api.py` compares the
signatures with the installed sglang wheel.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import inspect
import os
import threading
import warnings
from typing import Any, Callable, Iterator

from . import context
from .backends import BaseBackend, as_backend
from .interpreter import ProgramState, StreamExecutor
from .ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Call,
    ExprList,
    Gen,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    schema_to_str,
)
from .reasoning import think_format

token_length_normalized = "token_length_normalized"
greedy_token = "greedy_token"
greedy_token_selection = greedy_token  # SGLang's name
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"

_default_backend: BaseBackend | None = None
_backend_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` is not given one: a backend object or a `plait.Engine`
    (None: no default)."""
    global _default_backend
    with _backend_lock:
        _default_backend = None if backend is None else as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    """The backend set by `set_default_backend`, or None."""
    return _default_backend


def _resolve_backend(backend: Any) -> BaseBackend:
    if backend is None:
        backend = _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call plait.set_default_backend(...)")
    return as_backend(backend)


class GlobalConfig:
    """SGLang's `sgl.global_config`: settings every program shares.

    - `default_backend`: the same as `set_default_backend` / `get_default_backend`;
    - `verbosity`: 2 or more prints each finished `run`'s text;
    - `enable_precache_with_tracing`: `run_batch` first sends the program's constant prefix;
    - `skip_special_tokens_in_output`, `spaces_between_special_tokens_in_out`: the detokenizer
      settings sent with every gen (native backends);
    - `enable_parallel_encoding`: SGLang joins `concate_and_append` forks by their KV cache where
      the backend can; plait joins them by text whatever it says (same result, more prefill).
    """

    def __init__(self):
        self.verbosity = 0
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True

    @property
    def default_backend(self) -> BaseBackend | None:
        return get_default_backend()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        set_default_backend(backend)


global_config = GlobalConfig()


# --- expressions -----------------------------------------------------------------------------------
# gen(dtype=...): the regex, and whether the number also ends at a blank (SGLang adds " " and "\n"
# to its stop strings, and its regexes allow them).
_DTYPES = {
    "int": (REGEX_INT, True),
    "float": (REGEX_FLOAT, True),
    "bool": (REGEX_BOOL, False),
    "str": (REGEX_STR, False),
}
_DTYPE_NAMES = {
    int: "int",
    float: "float",
    bool: "bool",
    str: "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "string": "str",
}
_NUMBER_STOPS = [" ", "\n"]


def _dtype(dtype: Any, regex: str | None) -> tuple[str | None, list[str] | None]:
    """The regex and extra stop strings of gen(dtype=...); dtype wins over regex, as in SGLang."""
    if dtype is None:
        return regex, None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be int, float, bool or str, got {dtype!r}")
    dtype_regex, ends_at_blank = _DTYPES[_DTYPE_NAMES[dtype]]
    if regex is not None:
        warnings.warn(
            f"Both dtype and regex are set. Only dtype will be used. dtype: {dtype}, regex: {regex}", stacklevel=3
        )
    return dtype_regex, (_NUMBER_STOPS if ends_at_blank else None)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: Any = None,
    regex: str | None = None,
    json_schema: Any = None,
    *,
    repetition_penalty: float | None = None,
    ebnf: str | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
) -> Gen | Select:
    """Generate into variable `name` (None: text only), SGLang's parameters in SGLang's order.

    One of regex / json_schema (dict, JSON string or pydantic model class) / ebnf / dtype (int,
    float, bool, str: by SGLang's regexes; int and float also stop at " " and "\\n") constrains the
    output; `choices` makes it a `select`. `n` > 1 makes the variable the list of n samples (one
    request: they share the prompt's KV), the text going on with the first. `stop_regex`: stop
    where the text first matches one of these patterns (the match is kept). Keyword-only: plait's
    own `repetition_penalty`, `ebnf`, `seed`, and `max_new_tokens` (the protocol's name of max_tokens).
    """
    if choices:
        return Select(
            name, list(choices), choices_method or token_length_normalized, 0.0 if temperature is None else temperature
        )
    regex, extra_stop = _dtype(dtype, regex)
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"give at most one of regex, json_schema, ebnf (got {constraints})")
    params = {
        "max_new_tokens": max_new_tokens if max_new_tokens is not None else max_tokens,
        "min_new_tokens": min_tokens,
        "n": n,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "stop_regex": stop_regex,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "repetition_penalty": repetition_penalty,
        "ignore_eos": ignore_eos,
        "regex": regex,
        "json_schema": schema_to_str(json_schema),
        "ebnf": ebnf,
        "seed": seed,
    }
    logprob = {
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
        "return_text_in_logprobs": return_text_in_logprobs,
    }
    return Gen(name, params, logprob, extra_stop)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    **kwargs: Any,
) -> Gen:
    """`gen(dtype=int)`: an integer (the variable is its text). `kwargs`: gen's keyword-only ones."""
    return gen(
        name,
        max_tokens,
        None,
        n,
        stop,
        stop_token_ids,
        stop_regex,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        ignore_eos,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        dtype=int,
        **kwargs,
    )


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    **kwargs: Any,
) -> Gen:
    """`gen(dtype=str)`: a double-quoted string of word characters and blanks (SGLang's REGEX_STR)."""
    return gen(
        name,
        max_tokens,
        None,
        n,
        stop,
        stop_token_ids,
        stop_regex,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        ignore_eos,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        dtype=str,
        **kwargs,
    )


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: Any = token_length_normalized,
) -> Select:
    """Pick one of `choices` by its likelihood after the text so far (prefill-only scoring).
    `choices_method`: a method's name (`token_length_normalized`, `greedy_token_selection`,
    `unconditional_likelihood_normalized`) or an SGLang-style `ChoicesSamplingMethod` callable."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices), choices_method, temperature)


def image(expr: Any) -> Any:
    """SGLang's image input: not in plait (its models take text only)."""
    raise NotImplementedError("sgl.image: plait's models take text only; it has no image input")


def video(path: str, num_frames: int) -> Any:
    """SGLang's video input: not in plait (its models take text only)."""
    raise NotImplementedError("sgl.video: plait's models take text only; it has no video input")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ExprList:
    """Run `expr`, then split each named gen/select in it into its answer (the variable, and the
    text) and its reasoning (variable `<name>_reasoning_content`), by `model_type`'s think markers
    (SGLang's reasoning-parser names: 'deepseek-r1', 'qwen3', 'kimi', ...)."""
    think_format(model_type)  # an unknown model_type fails here, where it is written
    if _has_unnamed_output(expr):
        raise ValueError("name must be provided: separate_reasoning needs named gen/select")
    return ExprList([expr, SeparateReasoning(model_type, expr)])


def _has_unnamed_output(expr: Any) -> bool:
    if isinstance(expr, (Gen, Select)):
        return expr.name is None
    if isinstance(expr, ExprList):
        return any(_has_unnamed_output(it) for it in expr.items)
    if isinstance(expr, Role):
        return _has_unnamed_output(expr.content)
    return False


def system(expr: Any = None) -> Role:
    """A system message (its content: `expr`)."""
    return Role("system", expr)


def user(expr: Any = None) -> Role:
    """A user message (its content: `expr`)."""
    return Role("user", expr)


def assistant(expr: Any = None) -> Role:
    """An assistant message (its content: `expr`, usually a gen)."""
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


def flush_cache(backend: Any = None) -> Any:
    """Empty the backend's prefix cache (False when there is no backend, as in SGLang)."""
    if backend is None and _default_backend is None:
        return False
    return _resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict | None:
    """The backend's server info (None when there is no backend, as in SGLang)."""
    if backend is None and _default_backend is None:
        return None
    return _resolve_backend(backend).get_server_info()


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name
    """SGLang's server-in-a-subprocess handle: not in plait."""
    raise NotImplementedError(
        "sgl.Runtime: plait does not start a server for a program; run "
        "`plait serve --model ...` and use plait.RuntimeEndpoint(url), or plait.Engine(...) "
        "in process"
    )


# --- programs --------------------------------------------------------------------------------------
# run()'s sampling settings and their defaults: SGLang's (SglFunction.run), plus plait's `seed`.
_DEFAULTS = dict(
    max_new_tokens=128,
    n=1,
    stop=None,
    stop_token_ids=None,
    stop_regex=None,
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    ignore_eos=False,
    seed=None,
    return_logprob=None,
    logprob_start_len=None,
    top_logprobs_num=None,
    return_text_in_logprobs=None,
)
_LOGPROB = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class Function:
    """A program: `@plait.function def prog(s, ...)`; run it with `prog.run(...)` or `run_batch`.
    `num_api_spec_tokens`: API speculation (see `plait.frontend.speculation`)."""

    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError("a plait function takes the state as its first argument")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not p.empty]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "Function":
        """The same program with some arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in inspect.signature(self.func).parameters.values()):
            raise TypeError(f"{self.func.__name__}() has no arguments {sorted(unknown)}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    @staticmethod
    def _settings(kwargs: dict) -> tuple[dict, dict, dict]:
        """Split keyword arguments into the sampling and logprob settings given and the rest."""
        kwargs = dict(kwargs)
        kwargs.pop("use_thread", None)  # SGLang's flag: states always run on their own thread here
        if "max_tokens" in kwargs and "max_tokens" not in _DEFAULTS:  # gen's spelling, also accepted here
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in _DEFAULTS}
        sampling = {k: v for k, v in given.items() if k not in _LOGPROB}
        logprob = {k: v for k, v in given.items() if k in _LOGPROB}
        return sampling, logprob, kwargs

    def _split(self, kwargs: dict) -> tuple[dict, dict, dict]:
        """Like `_settings`, with SGLang's defaults filled in."""
        sampling, logprob, rest = self._settings(kwargs)
        sampling = {**{k: v for k, v in _DEFAULTS.items() if k not in _LOGPROB}, **sampling}
        logprob = {**{k: _DEFAULTS[k] for k in _LOGPROB}, **logprob}
        # the detokenizer's settings go only where they differ from every server's default
        if not global_config.skip_special_tokens_in_output:
            sampling["skip_special_tokens"] = False
        if not global_config.spaces_between_special_tokens_in_out:
            sampling["spaces_between_special_tokens"] = False
        return sampling, logprob, rest

    def _new_state(self, backend, sampling, logprob, stream) -> ProgramState:
        if stream and self.num_api_spec_tokens:
            raise NotImplementedError(
                "stream=True with num_api_spec_tokens: API speculation writes several "
                "gens at once, so it does not stream (as in SGLang)"
            )
        return ProgramState(StreamExecutor(backend, sampling, logprob, stream, self.num_api_spec_tokens))

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
        except BaseException as e:  # noqa: BLE001 - kept in the state
            state._program_error = e
            ex.fail(e)
        finally:
            ex.end_body()
            ex.end()

    def _start(self, state: ProgramState, args: tuple, kwargs: dict) -> threading.Thread:
        """Run the body on a thread of its own (so the caller can stream or await the state)."""
        t = threading.Thread(
            target=self._execute, args=(state, args, kwargs), daemon=True, name=f"plait-program-{self.func.__name__}"
        )
        t.start()
        return t

    def run(
        self,
        *args,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        **kwargs,
    ) -> ProgramState:
        """Run once; returns the state when done (or at once with `stream=True`: read it with
        `state.text_iter()`). Errors, the program's own or a backend's, are raised. The settings
        are every gen's defaults (SGLang's); `kwargs` are the program's arguments, and plait's
        `seed` / `max_tokens`. `use_thread` is accepted: a plait state always runs on a thread."""
        settings = {k: v for k, v in locals().items() if k in _DEFAULTS}  # the settings above
        sampling, logprob, kwargs = self._split({**settings, **kwargs})
        state = self._new_state(_resolve_backend(backend), sampling, logprob, stream)
        if stream:  # the body runs on its own thread, so it may read its own variables
            self._start(state, args, kwargs)
            return state
        self._execute(state, args, kwargs)
        state = _finished(state)
        if global_config.verbosity >= 2:
            print(state.text())
        return state

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

    def run_batch(
        self,
        batch_kwargs: list[dict] | list[tuple],
        *,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **kwargs,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per item of `batch_kwargs` (a dict of arguments, or a tuple of them in
        order), concurrently on `num_threads` threads; the states in order, as a list or (with
        `generator_style`) as an iterator that yields each as soon as it and those before it are
        done. A program that fails keeps its error in its own state (`state.error()`); the others
        go on. As in SGLang, the program's constant prefix is sent once first, so the batch shares
        it. `kwargs`: plait's `seed` / `max_tokens`."""
        settings = {k: v for k, v in locals().items() if k in _DEFAULTS}  # the settings above
        sampling, logprob, rest = self._split({**settings, **kwargs})
        if rest:
            raise TypeError(f"run_batch got unexpected arguments {sorted(rest)}; program arguments go in batch_kwargs")
        batch = self._batch_arguments(batch_kwargs)
        be = _resolve_backend(backend) if batch else None
        if num_threads == "auto":
            num_threads = max(1, min(len(batch), 64, 4 * (os.cpu_count() or 1) + 8))
        if len(batch) > 1 and global_config.enable_precache_with_tracing:
            self.cache(be)
        states = self._run_many(be, batch, sampling, logprob, int(num_threads) or 1, progress_bar)
        return states if generator_style else list(states)

    def _batch_arguments(self, batch_kwargs: list) -> list[dict]:
        """Each item as a dict of arguments (SGLang also takes tuples of them, in order)."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"batch_kwargs must be a list, got {type(batch_kwargs).__name__}")
        if not batch_kwargs or isinstance(batch_kwargs[0], dict):
            return list(batch_kwargs)
        names = [n for n in self.arg_names if n not in self.bind_arguments]
        least = len(names) - len(self.arg_defaults)
        if not all(isinstance(a, (list, tuple)) and least <= len(a) <= len(names) for a in batch_kwargs):
            raise TypeError(f"Given arguments mismatch the signature of {self.func.__name__}{tuple(names)}")
        return [dict(zip(names, a)) for a in batch_kwargs]

    def _run_many(
        self,
        be: BaseBackend | None,
        batch: list[dict],
        sampling: dict,
        logprob: dict,
        num_threads: int,
        progress_bar: bool,
    ) -> Iterator[ProgramState]:
        """Run every item on a pool; yield the states in order."""

        def one(args: dict) -> ProgramState:
            state = self._new_state(be, sampling, logprob, False)
            self._execute(state, (), args)
            state.stream_executor.wait_finished()
            return state

        if not batch:
            return
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch), desc=self.func.__name__)
        with cf.ThreadPoolExecutor(max_workers=num_threads) as pool:
            futures = [pool.submit(one, a) for a in batch]
            if bar is not None:
                for fut in futures:
                    fut.add_done_callback(lambda _: bar.update(1))
            try:
                for fut in futures:
                    yield fut.result()
            finally:
                cf.wait(futures)  # the bar's last updates happen before it closes
                if bar is not None:
                    bar.close()

    def trace(self, *, backend: Any = None, **kwargs) -> Any:
        """SGLang's program tracing into its IR graph: not in plait."""
        raise NotImplementedError(
            "Function.trace: plait does not build SGLang's traced program graph "
            "(Function.cache() traces the program's constant prefix)"
        )

    def compile(self, *, backend: Any = None) -> Any:
        """SGLang's compilation of a traced program: not in plait."""
        raise NotImplementedError(
            "Function.compile: plait runs programs as they are written; it has no "
            "compiler for SGLang's traced program graph"
        )

    def cache(self, backend: Any = None) -> None:
        """Warm the cache with the program's constant prefix: the text before the first call
        that needs an argument or the model (traced with placeholder arguments)."""
        be = _resolve_backend(backend)
        prefix = _trace_prefix(self, be)
        if len(prefix) > 64:  # shorter ones are not worth a request (SGLang's threshold)
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
        self._state: ProgramState | None = None  # where it ran last
        self._own = False  # started as a program of its own
        self._lock = threading.Lock()

    def _unpend(self) -> None:
        with self._lock:
            if self in self._frame.pending:
                self._frame.pending.remove(self)

    def inline_into(self, state: Any) -> None:
        self._unpend()
        if self._own:  # already running as a program of its own: append what it produces
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
            self._state = ProgramState(
                StreamExecutor(
                    outer.backend,
                    {**outer.default_sampling, **self._sampling},
                    {**outer.default_logprob, **self._logprob},
                    outer.stream,
                    self._fn.num_api_spec_tokens,
                )
            )
        self._fn._start(self._state, self._args, self._kwargs)

    def _resolve(self) -> ProgramState:
        self.start()
        return self._state  # type: ignore[return-value]

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


def function(
    func: Callable | None = None, num_api_spec_tokens: int | None = None
) -> Function | Callable[[Callable], Function]:
    """Decorator: `@plait.function`, `@plait.function()` or `@plait.function(num_api_spec_tokens=N)`
    (API speculation: one call writes N tokens ahead for several gens; see plait.frontend.speculation)."""
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens)
    return Function(func, num_api_spec_tokens)
