"""Running programs: each state has a `StreamExecutor` — a thread with a queue of expressions —
so `s += gen(...)` returns at once and independent states (fork children, batch items) overlap.

A program's body (the Python function) may run on another thread than the one reading its state
(streaming, `run_async`, nested calls started on their own): the executor records which thread
runs the body, so readers elsewhere wait for the body to finish submitting before they sync."""
from __future__ import annotations

import asyncio
import math
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator

from . import context
from .backends import BaseBackend
from .ir import (
    Call,
    Expr,
    ExprList,
    Gen,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    contains_call,
)

CHOICES_METHODS = ("token_length_normalized", "greedy_token", "unconditional_likelihood_normalized")


class ProgramError(RuntimeError):
    """A program's executor failed; `__cause__` is the original error."""


class StreamExecutor:
    def __init__(self, backend: BaseBackend, default_sampling: dict, default_logprob: dict,
                 stream: bool = False):
        self.backend = backend
        self.chat_template = backend.get_chat_template()
        self.default_sampling = default_sampling
        self.default_logprob = default_logprob
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_events: dict[str, threading.Event] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.var_scopes: dict[str, int] = {}
        self.error_: BaseException | None = None
        self.children: list[StreamExecutor] = []
        self._defaults_stack: list[tuple[dict, dict]] = []   # nested calls' own sampling settings
        self._body_done = threading.Event()
        self._body_done.set()                                # no body yet: nothing more will come
        self._body_thread: int | None = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._events: list[tuple[str | None, str | None]] = []   # (var or None, piece) for text_iter
        self._finished = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, daemon=True, name="plait-executor")
        self._thread.start()

    # --- queue ------------------------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        if self._finished.is_set():
            raise RuntimeError("this program state has finished; it takes no more expressions")
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait until everything submitted ran (and, from another thread, until the body ended)."""
        if not self._in_body():
            self._body_done.wait()
        self._queue.join()

    def begin_body(self) -> None:
        """The calling thread now runs the program's body."""
        self._body_thread = threading.get_ident()
        self._body_done.clear()

    def end_body(self) -> None:
        self._body_done.set()
        self._notify()

    def _in_body(self) -> bool:
        return self._body_done.is_set() or self._body_thread == threading.get_ident()

    def fail(self, error: BaseException) -> None:
        """The program's body failed: stop running its expressions and wake every reader."""
        if self.error_ is None:
            self.error_ = error
        for ev in list(self.var_events.values()):
            ev.set()
        self._notify()

    def _notify(self) -> None:
        """Wake readers waiting for text, variables or the end (threads and asyncio tasks)."""
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:    # that loop is closed; its task is gone
                pass

    async def _wait_async(self, ready: Callable[[], bool]) -> None:
        """Wait, without blocking the event loop, until `ready()` holds (checked on each notify)."""
        if ready():
            return
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._async_waiters.append(entry)
        try:
            while not ready():
                await entry[1].wait()
                entry[1].clear()
        finally:
            with self._cond:
                self._async_waiters.remove(entry)

    def _done(self) -> bool:
        return self._finished.is_set() or (self.error_ is not None and self._body_done.is_set())

    async def wait_async(self) -> None:
        """Wait, without blocking the event loop, until the program has finished."""
        await self._wait_async(self._done)

    def push_defaults(self, sampling: dict, logprob: dict) -> None:
        """A nested call's own settings (`inner(..., temperature=0)`) apply until `pop_defaults`."""
        self._defaults_stack.append((self.default_sampling, self.default_logprob))
        self.default_sampling = {**self.default_sampling, **sampling}
        self.default_logprob = {**self.default_logprob, **logprob}

    def pop_defaults(self) -> None:
        self.default_sampling, self.default_logprob = self._defaults_stack.pop()

    def end(self) -> None:
        """No more expressions: the thread exits once the queue is drained (children end too)."""
        if not self._finished.is_set():
            self._queue.put(None)

    def wait_finished(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def _worker(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    for child in self.children:
                        child.end()
                    self._finished.set()
                    self._notify()
                    return
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as e:   # noqa: BLE001 - recorded, surfaced to the program
                self.fail(e)
            finally:
                self._queue.task_done()

    # --- variables --------------------------------------------------------------------------------
    def _event(self, name: str) -> threading.Event:
        with self._lock:
            return self.var_events.setdefault(name, threading.Event())

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        self._event(name).set()

    def get_var(self, name: str) -> Any:
        ev = self._event(name)
        while not ev.wait(0.05):
            # nothing queued and the body submits no more: the variable will never be set
            if self.error_ is not None or (self._queue.unfinished_tasks == 0 and self._in_body()):
                break
        if name in self.variables:
            return self.variables[name]
        self.raise_error()
        raise KeyError(f"program variable {name!r} is not set")

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise ProgramError(f"the program failed: {type(self.error_).__name__}: {self.error_}") from self.error_

    # --- text -------------------------------------------------------------------------------------
    def append_text(self, piece: str, var: str | None = None) -> None:
        if not piece:
            return
        self.text_ += piece
        if self.stream:
            with self._cond:
                self._events.append((var, piece))
            self._notify()

    def _var_done(self, name: str) -> None:
        if self.stream:
            with self._cond:
                self._events.append((name, None))
            self._notify()

    def _poll(self, idx: int) -> tuple[list, int, bool]:
        """Stream events from `idx` on, the next index, and whether no more will come."""
        with self._cond:
            new, idx = self._events[idx:], len(self._events)
            done = self._done()
        return new, idx, done

    @staticmethod
    def _pieces(new: list, var_name: str | None) -> tuple[list[tuple[str | None, str]], bool]:
        """The (var, piece) pairs a reader of `var_name` (None: all text) wants, and whether that
        variable is complete."""
        out = []
        for var, piece in new:
            if var_name is None:
                if piece is not None:
                    out.append((var, piece))
            elif var == var_name:
                if piece is None:
                    return out, True
                out.append((var, piece))
        return out, False

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        if not self.stream:
            self.sync()
            self.raise_error()
            yield self.text_ if var_name is None else str(self.get_var(var_name))
            return
        idx = 0
        while True:
            with self._cond:
                while idx >= len(self._events) and not self._done():
                    self._cond.wait(0.1)
            new, idx, done = self._poll(idx)
            pieces, var_done = self._pieces(new, var_name)
            for _, piece in pieces:
                yield piece
            if var_done:
                return
            if done:
                self.raise_error()
                return

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        if not self.stream:
            await self.wait_async()
            self.raise_error()
            text = self.text_ if var_name is None else str(self.get_var(var_name))
            yield (text, self.meta_info.get(var_name)) if return_meta_data else text
            return
        idx = 0
        while True:
            await self._wait_async(lambda i=idx: i < len(self._events) or self._done())
            new, idx, done = self._poll(idx)
            pieces, var_done = self._pieces(new, var_name)
            for var, piece in pieces:
                yield (piece, self.meta_info.get(var)) if return_meta_data else piece
            if var_done:
                return
            if done:
                self.raise_error()
                return

    # --- execution --------------------------------------------------------------------------------
    def _execute(self, expr: Any) -> None:
        if isinstance(expr, str):
            self.append_text(expr)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Role):
            self._execute(RoleBegin(expr.role))
            if expr.content is not None:
                self._execute(expr.content)
            self._execute(RoleEnd(expr.role))
        elif isinstance(expr, RoleBegin):
            if self.cur_role is not None:
                raise ValueError(f"role {expr.role!r} begins inside role {self.cur_role!r}")
            prefix, _ = self.chat_template.get_prefix_and_suffix(expr.role, first_message=not self.messages_)
            self.append_text(prefix)
            self.cur_role, self.cur_role_begin_pos = expr.role, len(self.text_)
        elif isinstance(expr, RoleEnd):
            if self.cur_role != expr.role:
                raise ValueError(f"role {expr.role!r} ends but the open role is {self.cur_role!r}")
            content = self.text_[self.cur_role_begin_pos:]
            _, suffix = self.chat_template.get_prefix_and_suffix(expr.role)
            self.append_text(suffix)
            self.messages_.append({"role": expr.role, "content": content})
            self.cur_role = None
        elif isinstance(expr, VarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.set_var(expr.name, self.text_[self.var_scopes.pop(expr.name):])
        elif isinstance(expr, ProgramState):
            self._splice(expr.stream_executor)
        elif callable(expr):          # internal ops (join, nested calls' settings)
            expr(self)
        elif isinstance(expr, (int, float)):
            self.append_text(str(expr))
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _sampling(self, gen: Gen) -> tuple[dict, dict]:
        sp = dict(self.default_sampling)
        sp.update({k: v for k, v in gen.params.items() if v is not None})
        sp = {k: v for k, v in sp.items() if v is not None}
        lp = dict(self.default_logprob)
        lp.update({k: v for k, v in gen.logprob.items() if v is not None})
        return sp, {k: v for k, v in lp.items() if v is not None}

    def _gen(self, gen: Gen) -> None:
        if gen.params.get("choices") is not None:
            self._select(Select(gen.name, list(gen.params["choices"])))
            return
        sp, lp = self._sampling(gen)
        sp.pop("choices", None)
        name = gen.name
        chat_turn = (self.backend.is_chat_model and self.cur_role == "assistant"
                     and self.cur_role_begin_pos == len(self.text_))
        if chat_turn:
            text, meta = self.backend.chat(list(self.messages_), sp)
            self.append_text(text, name)
        elif self.stream:
            text, meta = "", {}
            for cumulative, meta in self.backend.generate_stream(self.text_, sp, lp):
                if name is not None:
                    self.meta_info[name] = meta      # what text_async_iter(return_meta_data) reports
                self.append_text(cumulative[len(text):], name)
                text = cumulative
        else:
            text, meta = self.backend.generate(self.text_, sp, lp)
            self.append_text(text, name)
        if name is not None:
            self.set_var(name, text, meta)
            self._var_done(name)

    def _select(self, sel: Select) -> None:
        method = sel.choices_method or "token_length_normalized"
        method = {"greedy_token_selection": "greedy_token"}.get(method, method)
        if method not in CHOICES_METHODS:
            raise ValueError(f"unknown choices_method {method!r}; use one of {CHOICES_METHODS}")
        if not sel.choices:
            raise ValueError("select needs at least one choice")
        if not self.backend.supports_logprobs:
            raise NotImplementedError(f"{type(self.backend).__name__} cannot select by logprobs "
                                      "(use a native backend: RuntimeEndpoint or EngineBackend)")
        res = self.backend.score_choices(self.text_, list(sel.choices),
                                         unconditional=method == "unconditional_likelihood_normalized")
        lps = [[t[0] for t in triples if t[0] is not None] for triples in res["input_token_logprobs"]]
        normalized = [sum(x) / len(x) if x else -math.inf for x in lps]
        if method == "token_length_normalized":
            scores = normalized
            best = max(range(len(scores)), key=scores.__getitem__)
        elif method == "greedy_token":
            width = max(len(x) for x in lps)
            keys = [tuple(x + [0.0] * (width - len(x))) for x in lps]
            best = max(range(len(keys)), key=keys.__getitem__)
            scores = normalized
        else:
            unc = [[t[0] for t in triples if t[0] is not None] for triples in res["unconditional_token_logprobs"]]
            scores = [(sum(c) - sum(u)) / len(c) if c else -math.inf for c, u in zip(lps, unc)]
            best = max(range(len(scores)), key=scores.__getitem__)
        choice = sel.choices[best]
        self.append_text(choice, sel.name)
        if sel.name is not None:
            meta = {"normalized_prompt_logprobs": normalized, "scores": scores, "choices_method": method,
                    "input_token_logprobs": res["input_token_logprobs"], "output_token_logprobs": [[]] * len(lps)}
            if "unconditional_token_logprobs" in res:
                meta["unconditional_token_logprobs"] = res["unconditional_token_logprobs"]
            self.set_var(sel.name, choice, meta)
            self._var_done(sel.name)

    def _splice(self, other: "StreamExecutor") -> None:
        """`s += state`: another program's text, messages and variables, once it has finished."""
        other.sync()
        other.raise_error()
        self.append_text(other.text_)
        self.messages_.extend(dict(m) for m in other.messages_)
        for name, value in other.variables.items():
            self.set_var(name, value, other.meta_info.get(name))

    def fork(self, n: int) -> list["StreamExecutor"]:
        self.sync()
        children = []
        for _ in range(n):
            c = StreamExecutor(self.backend, self.default_sampling, self.default_logprob, self.stream)
            c.chat_template = self.chat_template
            c.text_, c.messages_ = self.text_, [dict(m) for m in self.messages_]
            c.variables, c.meta_info = dict(self.variables), dict(self.meta_info)
            for name in c.variables:
                c._event(name).set()
            c.cur_role, c.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            children.append(c)
        self.children.extend(children)
        return children


class ProgramState:
    """What a program sees as `s`, and what `run` returns."""

    def __init__(self, executor: StreamExecutor):
        self.stream_executor = executor
        self._program_error: BaseException | None = None
        self.ret_value: Any = None        # what the program's body returned (SGLang's name)

    def __iadd__(self, other: Any) -> "ProgramState":
        self._append(other)
        return self

    def _append(self, expr: Any) -> None:
        """Submit `expr`; a nested call in it runs its body here, in order with the text around it."""
        if not contains_call(expr):
            self.stream_executor.submit(expr)
        elif isinstance(expr, Call):
            expr.inline_into(self)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._append(item)
        else:   # a role around a call
            self.stream_executor.submit(RoleBegin(expr.role))
            self._append(expr.content)
            self.stream_executor.submit(RoleEnd(expr.role))

    # --- roles --------------------------------------------------------------------------------------
    def _role(self, role: str, expr: Any = None):
        if expr is not None:
            self.stream_executor.submit(Role(role, expr))
            return None
        return _RoleScope(self, role)

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        return _VarScope(self, name)

    # --- reading ------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        context.start_pending()
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.submit(lambda ex: ex.set_var(name, value))

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> "ProgramState":
        context.start_pending()
        self.stream_executor.sync()
        return self

    def error(self) -> BaseException | None:
        """The error that stopped this program (its own code or a backend call), else None."""
        return self._program_error or self.stream_executor.error_

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) as it is generated; all at once unless run with stream=True."""
        context.start_pending()
        return self.stream_executor.text_iter(var_name)

    def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio: `async for piece in state.text_async_iter(): ...` never blocks
        the event loop. With `return_meta_data`, yields (piece, meta_info of its variable)."""
        return self.stream_executor.text_async_iter(var_name, return_meta_data)

    async def wait_async(self) -> "ProgramState":
        """Wait, without blocking the event loop, until the program has finished."""
        await self.stream_executor.wait_async()
        return self

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        context.start_pending()
        return ProgramStateGroup([ProgramState(c) for c in self.stream_executor.fork(size)], self)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class _RoleScope:
    def __init__(self, state: ProgramState, role: str):
        self.state, self.role = state, role

    def __enter__(self):
        self.state.stream_executor.submit(RoleBegin(self.role))
        return self.state

    def __exit__(self, *exc):
        self.state.stream_executor.submit(RoleEnd(self.role))


class _VarScope:
    def __init__(self, state: ProgramState, name: str):
        self.state, self.name = state, name

    def __enter__(self):
        self.state.stream_executor.submit(VarScopeBegin(self.name))
        return self.state

    def __exit__(self, *exc):
        self.state.stream_executor.submit(VarScopeEnd(self.name))


class ProgramStateGroup:
    """The states made by `s.fork(n)`; they run concurrently until `join`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states, self.parent = states, parent
        self._fork_text_len = len(parent.stream_executor.text_)
        self._fork_vars = dict(parent.stream_executor.variables)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        """`forks += expr` appends the same expression (or one per state, from a list) to each."""
        if isinstance(other, (list, tuple)):
            items = other
        elif callable(other) and not isinstance(other, Expr):    # SGLang's `forks += lambda i: ...`
            items = [other(i) for i in range(len(self.states))]
        else:
            items = [other] * len(self.states)
        for st, it in zip(self.states, items):
            st += it
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork; `gather_variable` sets each variable they set in the parent to the
        list of their values; `concate_and_append` also appends each fork's new text to the parent."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}")
        for st in self.states:
            st.sync()
        execs = [st.stream_executor for st in self.states]
        start, before = self._fork_text_len, self._fork_vars

        def do_join(parent: StreamExecutor) -> None:
            for ex in execs:
                if ex.error_ is not None:
                    raise ProgramError(f"a fork failed: {type(ex.error_).__name__}: {ex.error_}") from ex.error_
            names: list[str] = []
            for ex in execs:
                for name, val in ex.variables.items():
                    if (name not in before or before[name] is not val) and name not in names:
                        names.append(name)
            for name in names:
                parent.set_var(name, [ex.variables.get(name) for ex in execs],
                               [ex.meta_info.get(name) for ex in execs])
            if mode == "concate_and_append":
                parent.append_text("".join(ex.text_[start:] for ex in execs))
            for ex in execs:
                ex.end()

        self.parent.stream_executor.submit(do_join)
