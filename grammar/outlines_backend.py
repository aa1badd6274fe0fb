"""The outlines backend: a regex (a JSON schema is first turned into one by outlines-core) is
compiled into a DFA over the vocabulary (outlines_core.Index: state x token -> state).

Strong on regexes and small schemas; the Index can blow up on large schemas (a realistic
16-property schema has used > 20 GB), so every Index is built in a child process under an
address-space limit and a time limit: a blow-up fails that one spec with GrammarError.

Regexes use Rust `regex` syntax (outlines-core), matched in full. EBNF is not supported.
JSON whitespace: outlines-core puts one whitespace pattern at every place JSON allows some, so
json.dumps' default style (", " / ": " only) cannot be expressed; "compact" (the default here)
allows none: `{"a":1,"b":[2,3]}`, the smallest DFA and the longest jump-forward text; "default"
allows one optional space at each place (both compact and json.dumps' style match); "any"
allows any run of whitespace."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from .base import Grammar, GrammarBackend, GrammarError, GrammarSpec, Matcher, decode_forced
from .bitmask import bitmask_width, checked_row, eos_only_row, set_token_bits
from .tokenizer_info import TokenizerInfo

try:
    from outlines_core import Guide, Index, Vocabulary
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError(
        "the outlines grammar backend needs the `outlines-core` package (pip install outlines-core interegular)"
    ) from e

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_outlines_worker.py")
WHITESPACE = {"default": r"[ ]?", "compact": "", "any": r"[\n\t ]*"}
# Rust regex meta characters (regex-syntax's is_meta_character): escaping anything else is an error
_META = set("\\.+*?()|[]{}^$#&-~")
_FORCED_MAX_TOKENS = 512  # a state allowing more tokens than this forces nothing
_FORCED_MAX_BYTES = 4096


def escape_regex(text: str) -> str:
    """`text` as a literal in Rust regex syntax."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch.isprintable() and not ch.isspace() or ch == " ":
            out.append(ch)
        else:
            out.append("\\x{%X}" % ord(ch))
    return "".join(out)


def choices_regex(choices: list[str]) -> str:
    return "(?:" + "|".join(escape_regex(c) for c in choices) + ")"


def _vocabulary(info: TokenizerInfo) -> Vocabulary:
    mapping: dict[bytes, list[int]] = {}
    for i, b in info.normal_tokens():
        mapping.setdefault(b, []).append(i)
    return Vocabulary(info.eos_token_ids[0], mapping)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(
        self,
        info: TokenizerInfo,
        *,
        json_whitespace: str = "compact",
        max_memory_mb: int = 4096,
        compile_timeout_s: float = 60.0,
        isolate: bool = True,
    ) -> None:
        if json_whitespace not in WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {tuple(WHITESPACE)}, got {json_whitespace!r}")
        self.info = info
        self.json_whitespace = json_whitespace
        self.max_memory_mb = max_memory_mb
        self.compile_timeout_s = compile_timeout_s
        self.isolate = isolate
        self.vocab = info.backend_state("outlines.vocabulary", lambda: _vocabulary(info))
        self._vocab_pickle = info.backend_state(
            "outlines.vocabulary.pickle", lambda: pickle.dumps(self.vocab, protocol=pickle.HIGHEST_PROTOCOL)
        )
        self.index_words = bitmask_width(
            max(i for i, _ in info.normal_tokens()) + 1 if info.tokenizer_vocab_size else 1
        )
        self.index_words = max(self.index_words, bitmask_width(info.eos_token_ids[0] + 1))
        self.width = bitmask_width(info.vocab_size)
        self.eos_row = eos_only_row(info.vocab_size, info.eos_token_ids)

    @property
    def cache_key(self) -> tuple:
        return (self.name, self.json_whitespace)

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        t0 = time.perf_counter()
        if spec.kind in ("ebnf", "structural_tag"):
            what = "EBNF grammars" if spec.kind == "ebnf" else "structural tags"
            raise GrammarError(f"the outlines grammar backend does not support {what} (use the xgrammar backend)")
        if spec.kind == "json_schema":
            spec.schema()
            req = {"kind": "json_schema", "text": spec.spec, "whitespace": WHITESPACE[self.json_whitespace]}
        elif spec.kind == "json_object":
            req = {"kind": "json_schema", "text": '{"type": "object"}', "whitespace": WHITESPACE[self.json_whitespace]}
        elif spec.kind == "choice":
            req = {"kind": "regex", "text": choices_regex(spec.choices())}
        else:
            req = {"kind": "regex", "text": spec.spec}
        timeout = self.compile_timeout_s if timeout_s is None else min(timeout_s, self.compile_timeout_s)
        reply = self._build_isolated(req, timeout) if self.isolate else self._build_here(req)
        if reply[0] != "ok":
            raise GrammarError(f"outlines: {reply[1]}")
        _, regex, index = reply
        g = OutlinesGrammar(self, spec, regex, index)
        g.compile_time_s = time.perf_counter() - t0
        return g

    def _build_here(self, req: dict) -> tuple:
        from . import _outlines_worker

        return _outlines_worker.build(dict(req, vocab=self.vocab))

    def _build_isolated(self, req: dict, timeout: float) -> tuple:
        mem = int(self.max_memory_mb) << 20
        data = pickle.dumps(dict(req, mem_limit=mem, vocab=self.vocab), protocol=pickle.HIGHEST_PROTOCOL)
        env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-s", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            payload, err = proc.communicate(data, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return ("error", f"compiling took longer than {timeout:g} s (outlines index build)")
        rc = proc.returncode
        if rc != 0:
            text = err.decode("utf-8", "replace")
            if rc in (-signal.SIGABRT, -signal.SIGKILL, 3) or "memory" in text.lower():
                return (
                    "error",
                    f"building the index went over the memory limit of {self.max_memory_mb} MiB "
                    "(the schema / regex makes too large a DFA)",
                )
            return ("error", f"the index build failed (exit code {rc}): {text.strip()[-500:]}")
        try:
            return pickle.loads(payload)
        except Exception as e:  # noqa: BLE001
            return ("error", f"could not read the index from the worker: {e}")


class OutlinesGrammar(Grammar):
    backend_name = "outlines"

    def __init__(self, backend: OutlinesBackend, spec: GrammarSpec, regex: str, index: Index) -> None:
        self.backend = backend
        self.spec = spec
        self.regex = regex
        self.index = index
        self.eos_ids = backend.info.eos_token_ids
        self.eos_set = frozenset(self.eos_ids)
        self.vocab_size = backend.info.vocab_size
        self._forced: dict[int, str] = {}
        self._only_eos: dict[int, bool] = {}

    def matcher(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self)

    def only_eos(self, state: int) -> bool:
        r = self._only_eos.get(state)
        if r is None:
            allowed = self.index.get_allowed_tokens(state)
            r = all(t in self.eos_set for t in allowed) if len(allowed) <= len(self.eos_set) else False
            self._only_eos[state] = r
        return r

    def forced_text(self, state: int) -> str:
        r = self._forced.get(state)
        if r is None:
            r = decode_forced(self._forced_bytes(state))
            if len(self._forced) < 100_000:
                self._forced[state] = r
        return r

    def _forced_bytes(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with: the common prefix of the allowed
        tokens, followed through states while that prefix is itself a whole token."""
        index, token_bytes = self.index, self.backend.info.token_bytes
        out = bytearray()
        s: Any = state
        while s is not None and len(out) < _FORCED_MAX_BYTES:
            if index.is_final_state(s):
                break
            allowed = index.get_allowed_tokens(s)
            if not allowed or len(allowed) > _FORCED_MAX_TOKENS:
                break
            toks = [(token_bytes[t], t) for t in allowed if t not in self.eos_set]
            if not toks:
                break
            prefix = os.path.commonprefix([b for b, _ in toks])
            if not prefix:
                break
            out += prefix
            whole = [t for b, t in toks if b == prefix]
            if not whole:
                break
            s = index.get_next_state(s, whole[0])
        return bytes(out)


class OutlinesMatcher(Matcher):
    __slots__ = ("_g", "_guide", "_hist", "_terminated")
    _EOS = -1

    def __init__(self, grammar: OutlinesGrammar) -> None:
        self._g = grammar
        self._guide = Guide(grammar.index, max_rollback=1 << 30)
        self._hist: list[int] = []
        self._terminated = False

    @property
    def num_accepted(self) -> int:
        return len(self._hist)

    def accept(self, token_id: int) -> bool:
        if self._terminated:
            return False
        g = self._g
        if token_id in g.eos_set:
            if g.index.is_final_state(self._guide.get_state()):
                self._terminated = True
                self._hist.append(self._EOS)
                return True
            return False
        try:
            self._guide.advance(token_id, False)
        except (ValueError, OverflowError, TypeError):
            return False
        self._hist.append(token_id)
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        g = self._g
        b = g.backend
        if self._terminated:
            bitmask[row].copy_(b.eos_row[0])
            return
        r = checked_row(bitmask, row, b.width)
        self._guide.write_mask_into(r.data_ptr(), b.width, 4)
        if b.width > b.index_words:
            r[b.index_words :].zero_()
        if len(g.eos_ids) > 1 and g.index.is_final_state(self._guide.get_state()):
            set_token_bits(bitmask, row, g.eos_ids[1:])

    def can_end(self) -> bool:
        return self._terminated or self._g.index.is_final_state(self._guide.get_state())

    def is_finished(self) -> bool:
        if self._terminated:
            return True
        s = self._guide.get_state()
        return self._g.index.is_final_state(s) and self._g.only_eos(s)

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self._hist):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._hist)} accepted")
        if not n:
            return
        undone = self._hist[-n:]
        del self._hist[-n:]
        k = n
        if undone[-1] == self._EOS:
            self._terminated = False
            k -= 1
        if k:
            self._guide.rollback_state(k)

    def forced_text(self) -> str:
        if self._terminated:
            return ""
        return self._g.forced_text(self._guide.get_state())
