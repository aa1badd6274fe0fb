"""The xgrammar backend (default): a pushdown-automaton grammar engine, fast to compile, CFG-capable.

JSON is generated in json.dumps' default style (", " and ": " separators, one line) unless the
backend is built with json_whitespace="compact" (",", ":") or "any" (any whitespace: flexible
but lets small models loop on whitespace)."""

from __future__ import annotations

import json
import time

import torch

from .base import Grammar, GrammarBackend, GrammarError, GrammarSpec, Matcher, clean_error
from .bitmask import allocate_token_bitmask, bitmask_width, set_token_bits
from .tokenizer_info import TokenizerInfo

try:
    import xgrammar as xgr
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError("the xgrammar grammar backend needs the `xgrammar` package (pip install xgrammar)") from e

JSON_WHITESPACE = ("default", "compact", "any")


def _xgr_tokenizer_info(info: TokenizerInfo, as_text: frozenset[int] = frozenset()) -> "xgr.TokenizerInfo":
    """xgrammar's TokenizerInfo with our special tokens blanked out (xgrammar treats an empty
    token as special: never allowed), so that control tokens such as <|im_start|> cannot appear
    inside constrained text, except `as_text` (kept as their text); the EOS tokens are xgrammar's
    stop tokens."""
    detected = xgr.TokenizerInfo.from_huggingface(
        info.tokenizer, vocab_size=info.vocab_size, stop_token_ids=list(info.eos_token_ids)
    )
    encoded = [""] * info.vocab_size
    for token, i in info.tokenizer.get_vocab().items():
        if 0 <= i < info.vocab_size:
            encoded[i] = token
    eos = set(info.eos_token_ids)
    for i in info.special_token_ids:
        if i not in eos and i not in as_text:
            encoded[i] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=info.vocab_size,
        stop_token_ids=list(info.eos_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self,
        info: TokenizerInfo,
        *,
        max_threads: int = 2,
        json_whitespace: str = "default",
        strict_mode: bool = True,
        any_order: bool = False,
    ) -> None:
        if json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {JSON_WHITESPACE}, got {json_whitespace!r}")
        self.info = info
        self.json_whitespace = json_whitespace
        self.strict_mode = strict_mode
        self.any_order = any_order
        self.xgr_info = info.backend_state("xgrammar.tokenizer_info", lambda: _xgr_tokenizer_info(info))
        # our GrammarCache caches by spec, so xgrammar's own compile cache would only duplicate it
        self.compiler = xgr.GrammarCompiler(self.xgr_info, max_threads=max_threads, cache_enabled=False)
        self._max_threads = max_threads
        self._tag_compiler = None  # structural tags, with marker tokens as text (made on first use)
        eos_row = torch.zeros(1, bitmask_width(info.vocab_size), dtype=torch.int32)
        set_token_bits(eos_row, 0, info.eos_token_ids)
        self.eos_row = eos_row

    def tag_compiler(self) -> "xgr.GrammarCompiler":
        """The compiler of structural tags: where the tokenizer makes a tool-call marker a special
        token (Mistral's [TOOL_CALLS]), that token matches the tag's trigger as its text."""
        if not self.info.marker_token_ids:
            return self.compiler
        if self._tag_compiler is None:
            info = self.info.backend_state(
                "xgrammar.tokenizer_info.markers",
                lambda: _xgr_tokenizer_info(self.info, self.info.marker_token_ids),
            )
            self._tag_compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
        return self._tag_compiler

    @property
    def cache_key(self) -> tuple:
        return (self.name, self.json_whitespace, self.strict_mode, self.any_order)

    def _json_kwargs(self) -> dict:
        if self.json_whitespace == "any":
            return {"any_whitespace": True}
        seps = (", ", ": ") if self.json_whitespace == "default" else (",", ":")
        return {"any_whitespace": False, "separators": seps}

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        t0 = time.perf_counter()
        try:
            if spec.kind == "json_schema":
                spec.schema()  # a readable error for invalid JSON
                compiled = self.compiler.compile_json_schema(
                    spec.spec, strict_mode=self.strict_mode, any_order=self.any_order, **self._json_kwargs()
                )
            elif spec.kind == "json_object":
                compiled = self.compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.spec)
            elif spec.kind == "ebnf":
                compiled = self.compiler.compile_grammar(spec.spec)
            elif spec.kind == "choice":
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices())
                compiled = self.compiler.compile_grammar(f"root ::= {alts}")
            elif spec.kind == "structural_tag":
                compiled = self.tag_compiler().compile_structural_tag(spec.spec)
            else:  # pragma: no cover - GrammarSpec validates the kind
                raise GrammarError(f"xgrammar: unsupported grammar kind {spec.kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError / ValueError / its own
            raise GrammarError(f"xgrammar: invalid {spec.kind}: {clean_error(e)}") from None
        g = XGrammarGrammar(self, spec, compiled)
        g.compile_time_s = time.perf_counter() - t0
        return g


class XGrammarGrammar(Grammar):
    backend_name = "xgrammar"

    def __init__(self, backend: XGrammarBackend, spec: GrammarSpec, compiled) -> None:
        self.backend = backend
        self.spec = spec
        self.compiled = compiled
        self.vocab_size = backend.info.vocab_size
        # special tokens are rejected here (xgrammar would log a warning for each); a structural
        # tag may write tool-call markers
        never = backend.info.special_token_ids - set(backend.info.eos_token_ids)
        self.never = never - backend.info.marker_token_ids if spec.kind == "structural_tag" else never

    def matcher(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self, xgr.GrammarMatcher(self.compiled))

    def __repr__(self) -> str:
        return f"XGrammarGrammar({self.spec.kind}, {len(self.spec.spec or '')} chars)"


class XGrammarMatcher(Matcher):
    __slots__ = ("_g", "_m", "_n", "_version", "_only_eos_at", "_scratch")

    def __init__(self, grammar: XGrammarGrammar, m) -> None:
        self._g = grammar
        self._m = m
        self._n = 0
        self._version = 0
        self._only_eos_at = (-1, False)
        self._scratch = None

    @property
    def num_accepted(self) -> int:
        return self._n

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self._g.vocab_size or token_id in self._g.never:
            return False
        if self._m.accept_token(token_id):
            self._n += 1
            self._version += 1
            return True
        return False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():  # nothing may follow; keep EOS so that the row is not empty
            bitmask[row].copy_(self._g.backend.eos_row[0])
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def can_end(self) -> bool:
        return self._m.is_completed()

    def is_finished(self) -> bool:
        m = self._m
        if m.is_terminated():
            return True
        if not m.is_completed():
            return False
        version, only = self._only_eos_at
        if version != self._version:  # complete: is anything but EOS still allowed?
            if self._scratch is None:
                self._scratch = allocate_token_bitmask(1, self._g.vocab_size)
            m.fill_next_token_bitmask(self._scratch, 0)
            only = bool(torch.equal(self._scratch, self._g.backend.eos_row))
            self._only_eos_at = (self._version, only)
        return only

    def rollback(self, n: int) -> None:
        if n < 0 or n > self._n:
            raise ValueError(f"cannot roll back {n} tokens: {self._n} accepted")
        if n:
            self._m.rollback(n)
            self._n -= n
            self._version += 1

    def forced_text(self) -> str:
        if self._m.is_terminated():
            return ""
        return self._m.find_jump_forward_string()
