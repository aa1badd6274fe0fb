"""The llguidance backend (optional extra): Earley parser over a lazily built lexer; compiles JSON
schemas, regexes (Rust syntax), Lark and GBNF grammars almost instantly."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import torch

from .base import Grammar, GrammarBackend, GrammarError, GrammarSpec, Matcher, decode_forced
from .bitmask import bitmask_width, checked_row, eos_only_row
from .schema_keywords import lenient_conditionals
from .schema_repair import repair
from .schema_rewrite import strict_schema
from .tokenizer_info import TokenizerInfo

try:
    import llguidance
    import llguidance.hf
    from llguidance import LLMatcher
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError(
        "the llguidance grammar backend needs the `llguidance` package "
        "(pip install 'plait[llguidance]' or pip install llguidance)"
    ) from e

JSON_OPTIONS = {
    "default": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "any": {"whitespace_flexible": True},
}

# What a schema llguidance refuses for its oneOf or unimplemented keywords compiles with: oneOf read
# as anyOf, the unimplemented keywords (not, if/then/else, dependencies, uniqueItems, ...) ignored.
LENIENT = {"coerce_one_of": True, "lenient": True}
_APPROXIMABLE = re.compile(
    r"oneOf constraints are not supported|Unimplemented keys|Unknown format|min/maxProperties only supported"
)
REPAIRS = 8  # schema_repair passes, at most (each relaxes what one error names)
_UNSATISFIABLE = "unsatisfiable"
_TOO_LARGE = "schema too large"


_EXECUTOR: list = []


def _executor() -> "llguidance.LLExecutor":
    """llguidance's thread pool for batched masks, made once: as many threads as torch's (the
    cores the model's ops use, idle while the masks are computed between forward passes)."""
    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor(max(1, torch.get_num_threads())))
    return _EXECUTOR[0]


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, info: TokenizerInfo, *, json_whitespace: str = "default", strict_mode: bool = True) -> None:
        """strict_mode: objects with `properties` and no word on other keys forbid them (see
        `strict_schema`), as in xgrammar; False follows JSON Schema (other keys allowed)."""
        if json_whitespace not in JSON_OPTIONS:
            raise ValueError(f"json_whitespace must be one of {tuple(JSON_OPTIONS)}, got {json_whitespace!r}")
        self.info = info
        self.json_whitespace = json_whitespace
        self.strict_mode = strict_mode
        self.tokenizer = info.backend_state(
            "llguidance.tokenizer",
            lambda: llguidance.hf.from_tokenizer(
                info.tokenizer, n_vocab=info.vocab_size, eos_token=list(info.eos_token_ids)
            ),
        )
        self.width = bitmask_width(info.vocab_size)
        self.eos_row = eos_only_row(info.vocab_size, info.eos_token_ids)

    @property
    def cache_key(self) -> tuple:
        return (self.name, self.json_whitespace, self.strict_mode)

    def fill_rows(self, pairs: list[tuple[LLMatcher, int]], bitmask: torch.Tensor) -> None:
        """The masks of many matchers at once, each into its bitmask row, on llguidance's own
        threads with the GIL released (`fill_masks`' runner for this backend)."""
        if len(pairs) == 1:
            m, row = pairs[0]
            m.unsafe_compute_mask_ptr(checked_row(bitmask, row, self.width).data_ptr(), self.width * 4)
            return
        if not bitmask.is_contiguous() or bitmask.dim() != 2:
            raise ValueError("a batched mask fill needs a contiguous 2-D bitmask")
        checked_row(bitmask, 0, self.width)
        _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.width * 4, bitmask.shape[0])

    def _grammar_text(
        self,
        spec: GrammarSpec,
        lenient: bool = False,
        close: bool | None = None,
        presence_cases: bool = True,
        schema: Any = None,
    ) -> str:
        """The grammar of `spec` (JSON: of `schema` instead where given, a repaired one)."""
        try:
            if spec.kind == "json_schema":
                schema = spec.schema() if schema is None else schema
                close = self.strict_mode if close is None else close
                if isinstance(schema, dict):
                    schema = strict_schema(schema, close=close, presence_cases=presence_cases)
                    text = json.dumps(lenient_conditionals(schema) if lenient else schema)
                else:
                    text = spec.spec
                options = {**JSON_OPTIONS[self.json_whitespace], **(LENIENT if lenient else {})}
                return LLMatcher.grammar_from_json_schema(text, overrides=options)
            if spec.kind == "json_object":
                return LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', overrides=JSON_OPTIONS[self.json_whitespace]
                )
            if spec.kind == "regex":
                return LLMatcher.grammar_from_regex(spec.spec)
            if spec.kind == "ebnf":
                return llguidance.grammar_from("gbnf", spec.spec)
            if spec.kind == "choice":
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices())
                return LLMatcher.grammar_from_lark(f"start: {alts}")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"llguidance: invalid {spec.kind}: {e}") from None
        raise GrammarError(f"llguidance: unsupported grammar kind {spec.kind!r}")  # pragma: no cover

    def _template(self, spec: GrammarSpec, **how) -> tuple[str, LLMatcher]:
        text = self._grammar_text(spec, **how)
        return text, LLMatcher(self.tokenizer, text, log_level=0)

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        t0 = time.perf_counter()
        text, template = self._template(spec)
        approximate, last = False, ""  # (last: the lenient mode's error, where it was tried)

        def error() -> str:
            return template.get_error() if template.is_error() else ""

        if spec.kind == "json_schema":
            how = {"close": self.strict_mode}
            if self.strict_mode and _UNSATISFIABLE in error().lower():
                # strict mode closed an object some other part adds keys to: the schema as written
                how["close"] = False
                text, template = self._template(spec, **how)
            if _TOO_LARGE in error():
                # an `if` on a key's presence doubled a large object: its case without the key instead
                how["presence_cases"] = False
                text, template = self._template(spec, **how)
            if _APPROXIMABLE.search(error()):
                # oneOf / keywords llguidance does not implement: the same schema with those relaxed
                # (oneOf as anyOf, the others ignored), exact everywhere else; the output check validates
                relaxed, lenient = self._template(spec, lenient=True, **how)
                if lenient.is_error() and _TOO_LARGE in lenient.get_error():
                    how["presence_cases"] = False
                    relaxed, lenient = self._template(spec, lenient=True, **how)
                if not lenient.is_error():
                    text, template, approximate = relaxed, lenient, True
                else:
                    last = lenient.get_error()
            if template.is_error() and (fixed := self._repaired(spec, how, last or error())) is not None:
                (text, template), approximate = fixed, True
        if template.is_error():
            raise GrammarError(f"llguidance: invalid {spec.kind}: {template.get_error()}")
        g = LLGuidanceGrammar(self, spec, text, template)
        g.approximate = approximate
        g.compile_time_s = time.perf_counter() - t0
        return g

    def _repaired(self, spec: GrammarSpec, how: dict, error: str) -> tuple[str, LLMatcher] | None:
        """The lenient grammar of the schema relaxed where llguidance's errors point, one repair
        after another (`schema_repair`), the first that compiles; None where none does."""
        schema = spec.schema()
        for _ in range(REPAIRS):
            schema = repair(schema, error)
            if schema is None:
                return None
            try:
                text, template = self._template(spec, lenient=True, schema=schema, **how)
            except GrammarError as e:
                error = str(e)
                continue
            if not template.is_error():
                return text, template
            error = template.get_error()
        return None


class LLGuidanceGrammar(Grammar):
    backend_name = "llguidance"

    def __init__(self, backend: LLGuidanceBackend, spec: GrammarSpec, text: str, template) -> None:
        self.backend = backend
        self.spec = spec
        self.text = text
        self.template = template
        self.eos_set = frozenset(backend.info.eos_token_ids)
        self.vocab_size = backend.info.vocab_size

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self, self.template.deep_copy())


class LLGuidanceMatcher(Matcher):
    __slots__ = ("_g", "_m", "_n", "_terminated")

    def __init__(self, grammar: LLGuidanceGrammar, m) -> None:
        self._g = grammar
        self._m = m
        self._n = 0
        self._terminated = False

    @property
    def num_accepted(self) -> int:
        return self._n

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._g.vocab_size:
            return False
        if token_id in self._g.eos_set:
            # EOS is kept out of llguidance's matcher (rolling it back there loses the
            # accepting state): it only marks this matcher finished
            if not self._m.is_accepting():
                return False
            self._terminated = True
            self._n += 1
            return True
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._n += 1
        return True

    def defer_mask(self, row: int, jobs) -> bool:
        if self._terminated:
            return False
        jobs.add(self._g.backend.fill_rows, self._m, row)
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        b = self._g.backend
        if self._terminated:
            bitmask[row].copy_(b.eos_row[0])
            return
        r = checked_row(bitmask, row, b.width)
        self._m.unsafe_compute_mask_ptr(r.data_ptr(), b.width * 4)

    def can_end(self) -> bool:
        return self._terminated or self._m.is_accepting()

    def is_finished(self) -> bool:
        return self._terminated or self._m.is_stopped()

    def rollback(self, n: int) -> None:
        if n < 0 or n > self._n:
            raise ValueError(f"cannot roll back {n} tokens: {self._n} accepted")
        if n:
            k = n - 1 if self._terminated else n
            if k and not self._m.rollback(k):
                raise RuntimeError(f"llguidance: rollback failed: {self._m.get_error()}")
            self._n -= n
            self._terminated = False

    def forced_text(self) -> str:
        if self._terminated:
            return ""
        return decode_forced(self._m.compute_ff_bytes())
