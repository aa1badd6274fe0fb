"""Running programs: each state has a `StreamExecutor` — a thread with a queue of expressions —
so `s += gen(...)` returns at once and independent states (fork children, batch items) overlap.

A program's body (the Python function) may run on another thread than the one reading its state
(streaming, `run_async`, nested calls started on their own): the executor records which thread
runs the body, so readers elsewhere wait for the body to finish submitting before they sync."""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator

from . import context, stopping
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
    SeparateReasoning,
    VarScopeBegin,
    VarScopeEnd,
    contains_call,
)
from .reasoning import split_reasoning, think_format
from .speculation import ChatSpeculation, CompletionSpeculation, stop_list

CHOICES_METHODS = ("token_length_normalized", "greedy_token", "unconditional_likelihood_normalized")


class ProgramError(RuntimeError):
    """A program's executor failed; `__cause__` is the original error."""


class StreamExecutor:
    """Runs one state's expressions, in order, on a thread of its own."""

    def __init__(
        self,
        backend: BaseBackend,
        default_sampling: dict,
        default_logprob: dict,
        stream: bool = False,
        num_api_spec_tokens: int | None = None,
    ):
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
        self.var_spans: dict[str, tuple[int, int]] = {}  # where each gen/select's text lies in text_
        self.num_api_spec_tokens = num_api_spec_tokens
        self._spec = CompletionSpeculation(num_api_spec_tokens) if num_api_spec_tokens else None
        self._chat_spec: ChatSpeculation | None = None  # an assistant role held for one chat call
        self.error_: BaseException | None = None
        self.children: list[StreamExecutor] = []
        self._defaults_stack: list[tuple[dict, dict]] = []  # nested calls' own sampling settings
        self._body_done = threading.Event()
        self._body_done.set()  # no body yet: nothing more will come
        self._body_thread: int | None = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._events: list[tuple[str | None, str | None]] = []  # (var or None, piece) for text_iter
        self._finished = threading.Event()
        self._ended = False  # end() queued the last item
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, daemon=True, name="plait-executor")
        self._thread.start()

    # --- queue ------------------------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        with self._lock:
            if self._ended:
                raise RuntimeError("this program state has finished; it takes no more expressions")
            self._queue.put(expr)

    def assign(self, name: str, value: Any) -> None:
        """`state[name] = value`: in order with the expressions before it while the program runs;
        once the program has ended, at once (as SGLang sets it), e.g. to convert a result."""
        with self._lock:
            if not self._ended:
                self._queue.put(lambda ex: ex.set_var(name, value))
                return
        self.wait_finished()
        self.set_var(name, value)

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
            except RuntimeError:  # that loop is closed; its task is gone
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
        with self._lock:
            if self._ended:
                return
            self._ended = True
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
            except BaseException as e:  # noqa: BLE001 - recorded, surfaced to the program
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
    def append_text(self, piece: str, var: str | None = None, keep_speculation: bool = False) -> None:
        """Append to the text (and the stream). Text that API speculation did not account for
        (`keep_speculation=False`) drops what it wrote ahead."""
        if not piece:
            return
        if self._spec is not None and not keep_speculation:
            self._spec.reset()
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

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
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
        if self._chat_spec is not None and self._hold(expr):
            return
        if isinstance(expr, str):
            self._fill(expr)
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
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.set_var(expr.name, self.text_[self.var_scopes.pop(expr.name) :])
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, ProgramState):
            self._splice(expr.stream_executor)
        elif callable(expr):  # internal ops (join, nested calls' settings)
            expr(self)
        elif isinstance(expr, (int, float)):
            self._fill(str(expr))
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _fill(self, piece: str) -> None:
        """Constant text: it consumes what API speculation wrote ahead if it is the same."""
        if self._spec is not None:
            self._spec.fill(piece)
        self.append_text(piece, keep_speculation=True)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, first_message=not self.messages_)
        self._fill(prefix)
        self.cur_role, self.cur_role_begin_pos = role, len(self.text_)
        if role == "assistant" and self.num_api_spec_tokens and self.backend.is_chat_model:
            self._chat_spec = ChatSpeculation(self.num_api_spec_tokens)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        if self._chat_spec is not None:
            self._release_chat_speculation()
        content = self.text_[self.cur_role_begin_pos :]
        _, suffix = self.chat_template.get_prefix_and_suffix(role)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    # --- API speculation in a chat assistant role ---------------------------------------------------
    def _hold(self, expr: Any) -> bool:
        """Inside an assistant role held for one chat call: keep `expr` for the role's end
        (True), or let it run now (False: lists, roles, internal ops)."""
        spec = self._chat_spec
        if isinstance(expr, (str, int, float)):
            spec.add_fill(str(expr))
        elif isinstance(expr, Gen) and expr.params.get("choices") is None:
            spec.add_gen(expr, self._sampling(expr)[0])
        elif isinstance(expr, (Select, Gen)):
            raise NotImplementedError(
                "select inside an assistant role with num_api_spec_tokens on a chat "
                "backend: a chat API gives no choice logprobs"
            )
        elif isinstance(expr, (VarScopeBegin, VarScopeEnd, SeparateReasoning, ProgramState)):
            spec.add_expr(expr)
        else:
            return False
        return True

    def _release_chat_speculation(self) -> None:
        """The held role's one chat call, then its text, variables and other expressions in order."""
        spec, self._chat_spec = self._chat_spec, None
        messages = list(self.messages_)
        for item in spec.resolve(lambda sp: self.backend.chat(messages, sp)):
            if item[0] == "fill":
                self._fill(item[1])
            elif item[0] == "value":
                _, gen, value, meta = item
                start = len(self.text_)
                self.append_text(value, gen.name)
                self._record(gen.name, value, meta, start)
            else:
                self._execute(item[1])

    # --- gen ----------------------------------------------------------------------------------------
    def _sampling(self, gen: Gen) -> tuple[dict, dict]:
        sp = dict(self.default_sampling)
        sp.update({k: v for k, v in gen.params.items() if v is not None})
        sp = {k: v for k, v in sp.items() if v is not None}
        if gen.extra_stop:
            sp["stop"] = stop_list(sp.get("stop")) + list(gen.extra_stop)
        lp = dict(self.default_logprob)
        lp.update({k: v for k, v in gen.logprob.items() if v is not None})
        return sp, {k: v for k, v in lp.items() if v is not None}

    def _gen(self, gen: Gen) -> None:
        if gen.params.get("choices") is not None:
            self._select(Select(gen.name, list(gen.params["choices"])))
            return
        sp, lp = self._sampling(gen)
        sp.pop("choices", None)
        start = len(self.text_)
        if (sp.get("n") or 1) > 1:
            value, meta = self._gen_n(sp, lp)
            self.append_text(value[0], gen.name)  # the text goes on with the first sample (SGLang)
        elif self._spec is not None and self._spec.serves(sp):
            value, meta = self._spec.take(self.text_, sp, lp, self.backend.generate)
            self.append_text(value, gen.name, keep_speculation=True)
        else:
            value, meta = self._gen_one(gen.name, sp, lp)
        self._record(gen.name, value, meta, start)

    def _chat_turn(self) -> bool:
        """Whether a gen here is a chat backend's whole assistant reply (not a continuation)."""
        return (
            self.backend.is_chat_model and self.cur_role == "assistant" and self.cur_role_begin_pos == len(self.text_)
        )

    def _gen_one(self, name: str | None, sp: dict, lp: dict) -> tuple[str, dict]:
        """One sample, appended to the text as it comes (streamed, or where stop_regex applies)."""
        regexes = stopping.patterns(sp.get("stop_regex"))
        if self._chat_turn():
            text, meta = stopping.cut(*self.backend.chat(list(self.messages_), sp), regexes)
        elif self.stream or regexes:
            return self._gen_streamed(name, sp, lp, regexes)
        else:
            text, meta = self.backend.generate(self.text_, sp, lp)
        self.append_text(text, name)
        return text, meta

    def _gen_streamed(self, name: str | None, sp: dict, lp: dict, regexes: list[str]) -> tuple[str, dict]:
        """Stream one sample into the text; stop reading (which aborts the request) where a
        stop_regex pattern first matches."""
        text, meta = "", {}
        with contextlib.closing(self.backend.generate_stream(self.text_, sp, lp)) as pieces:
            for cumulative, meta in pieces:
                found = stopping.first_match_end(cumulative, regexes, since=len(text)) if regexes else None
                if found is not None:
                    cumulative, meta = cumulative[: found[0]], stopping.matched(meta, found[1])
                if name is not None:
                    self.meta_info[name] = meta  # what text_async_iter(return_meta_data) reports
                self.append_text(cumulative[len(text) :], name)
                text = cumulative
                if found is not None:
                    break
        return text, meta

    def _gen_n(self, sp: dict, lp: dict) -> tuple[list[str], list[dict]]:
        """n samples of one gen, in one request where the backend can (they share the prompt's KV)."""
        regexes = stopping.patterns(sp.get("stop_regex"))
        if self._chat_turn():
            outs = self.backend.chat_n(list(self.messages_), sp)
        else:
            outs = self.backend.generate_n(self.text_, sp, lp)
        outs = [stopping.cut(text, meta, regexes) for text, meta in outs]
        return [t for t, _ in outs], [m for _, m in outs]

    def _record(self, name: str | None, value: Any, meta: Any, start: int) -> None:
        """A gen or select that wrote text_[start:] sets its variable (if named)."""
        if name is None:
            return
        self.var_spans[name] = (start, len(self.text_))
        self.set_var(name, value, meta)
        self._var_done(name)

    # --- select -------------------------------------------------------------------------------------
    def _select(self, sel: Select) -> None:
        if not sel.choices:
            raise ValueError("select needs at least one choice")
        if not self.backend.supports_logprobs:
            raise NotImplementedError(
                f"{type(self.backend).__name__} cannot select by logprobs "
                "(use a native backend: RuntimeEndpoint or EngineBackend)"
            )
        method = sel.choices_method or "token_length_normalized"
        if callable(method):
            choice, meta = self._select_by_callable(sel, method)
        else:
            choice, meta = self._select_by_name(sel, method)
        start = len(self.text_)
        self.append_text(choice, sel.name)
        self._record(sel.name, choice, meta, start)

    def _select_by_name(self, sel: Select, method: str) -> tuple[str, dict]:
        method = {"greedy_token_selection": "greedy_token"}.get(method, method)
        if method not in CHOICES_METHODS:
            raise ValueError(f"unknown choices_method {method!r}; use one of {CHOICES_METHODS}")
        res = self.backend.score_choices(
            self.text_, list(sel.choices), unconditional=method == "unconditional_likelihood_normalized"
        )
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
        meta = {
            "normalized_prompt_logprobs": normalized,
            "scores": scores,
            "choices_method": method,
            "input_token_logprobs": res["input_token_logprobs"],
            "output_token_logprobs": [[]] * len(lps),
        }
        if "unconditional_token_logprobs" in res:
            meta["unconditional_token_logprobs"] = res["unconditional_token_logprobs"]
        return sel.choices[best], meta

    def _select_by_callable(self, sel: Select, method: Callable) -> tuple[str, dict]:
        """An SGLang-style choices method: called with the choices' logprobs, it returns an object
        with `decision` and `meta_info` (sglang.lang.choices.ChoicesDecision)."""
        unconditional = bool(getattr(method, "requires_unconditional_logprobs", False))
        res = self.backend.score_choices(self.text_, list(sel.choices), unconditional=unconditional)
        lps = [[t[0] for t in triples if t[0] is not None] for triples in res["input_token_logprobs"]]
        decision = method(
            choices=list(sel.choices),
            normalized_prompt_logprobs=[sum(x) / len(x) if x else -math.inf for x in lps],
            input_token_logprobs=res["input_token_logprobs"],
            output_token_logprobs=[[]] * len(lps),
            unconditional_token_logprobs=res.get("unconditional_token_logprobs"),
        )
        return decision.decision, dict(decision.meta_info or {})

    # --- separate_reasoning -------------------------------------------------------------------------
    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        """Split each named output of `expr` into answer and reasoning; the text keeps the answer."""
        fmt = think_format(expr.model_type)
        names = [n for n in named_outputs(expr.expr) if n in self.variables]
        for name in sorted(names, key=lambda n: self.var_spans.get(n, (-1, -1))[0], reverse=True):
            value = self.variables[name]
            parts = [split_reasoning(v, fmt) for v in (value if isinstance(value, list) else [value])]
            answers, reasonings = [a for _, a in parts], [r for r, _ in parts]
            self._replace_span(name, answers[0])
            many = isinstance(value, list)
            self.set_var(name, answers if many else answers[0], self.meta_info.get(name))
            self.set_var(f"{name}_reasoning_content", reasonings if many else reasonings[0])

    def _replace_span(self, name: str, new: str) -> None:
        """Put `new` where variable `name`'s text is; later positions move with it."""
        if name not in self.var_spans:
            return
        start, end = self.var_spans[name]
        self.text_ = self.text_[:start] + new + self.text_[end:]
        delta = len(new) - (end - start)
        self.var_spans[name] = (start, start + len(new))
        for other, (a, b) in self.var_spans.items():
            if other != name and a >= end:
                self.var_spans[other] = (a + delta, b + delta)
        self.var_scopes = {k: (p + delta if p >= end else p) for k, p in self.var_scopes.items()}

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


def named_outputs(expr: Any) -> list[str]:
    """The variable names of the gens and selects in `expr` (through lists and roles)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, ExprList):
        return [n for it in expr.items for n in named_outputs(it)]
    if isinstance(expr, Role):
        return named_outputs(expr.content)
    return []


class ProgramState:
    """What a program sees as `s`, and what `run` returns."""

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self._program_error: BaseException | None = None
        self.ret_value: Any = None  # what the program's body returned (SGLang's name)

    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:  # (None is also the executor's own end-of-program mark)
            raise ValueError("Tried to append None to state.")
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
        else:  # a role around a call
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
        """`with s.var_scope("v"):` sets variable v to the text appended inside the block."""
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
        """Set a variable: in order with the program while it runs, at once after it has ended."""
        self.stream_executor.assign(name, value)

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

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> "ProgramStateGroup":
        """`size` copies of this state that run concurrently until `join()`."""
        if position_ids_offset is not None:
            raise NotImplementedError(
                "fork(position_ids_offset=...): plait forks continue the text as "
                "it is; it does not shift the forks' position ids"
            )
        context.start_pending()
        return ProgramStateGroup([ProgramState(c) for c in self.stream_executor.fork(int(size))], self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator["ProgramState"]:
        """`with s.copy() as c:` a fork of one, joined (gather_variable) when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

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
    """The states made by `s.fork(n)` (from `src_state`); they run concurrently until `join`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None):
        self.states, self.src_state = states, src_state
        src = src_state.stream_executor if src_state is not None else None
        self._fork_text_len = len(src.text_) if src is not None else 0
        self._fork_vars = dict(src.variables) if src is not None else {}

    @property
    def parent(self) -> ProgramState | None:
        """The state the group was forked from (SGLang calls it `src_state`)."""
        return self.src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        """What `forks[i] += expr` does after appending to fork i: it puts the same state back;
        a group's states cannot be replaced."""
        if value is not self.states[i]:
            raise TypeError("a fork group's states cannot be replaced; append to them with forks[i] += ...")

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        """`forks += expr` appends the same expression (or one per state, from a list) to each."""
        if isinstance(other, (list, tuple)):
            items = other
        elif callable(other) and not isinstance(other, Expr):  # SGLang's `forks += lambda i: ...`
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
        if self.src_state is None:
            raise ValueError("this group has no source state to join into")
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
                parent.set_var(name, [ex.variables.get(name) for ex in execs], [ex.meta_info.get(name) for ex in execs])
            if mode == "concate_and_append":
                parent.append_text("".join(ex.text_[start:] for ex in execs))
            for ex in execs:
                ex.end()

        self.src_state.stream_executor.submit(do_join)
