"""Backend-neutral grammar types: specs, compiled grammars, per-request matchers, backends.

Nothing here imports torch or a grammar library, so `import plait.grammar` stays cheap (and the
outlines compile worker, a separate process, never pays for torch).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")


class GrammarError(ValueError):
    """A bad grammar spec: invalid schema / regex / EBNF, an unsupported keyword or kind, or a
    compile that went over a limit (time, memory). The message names the problem."""


def canonical_json(value: Any) -> str:
    """A canonical JSON string for a schema: keys sorted everywhere, except inside a
    `properties` mapping, whose order is kept (it is the order in which grammar backends make
    the model write the object's keys, so it is part of the meaning)."""

    def canon(v: Any, keep_order: bool = False) -> Any:
        if isinstance(v, dict):
            items = list(v.items()) if keep_order else sorted(v.items())
            return {k: canon(x, keep_order=(k == "properties" and isinstance(x, dict))) for k, x in items}
        if isinstance(v, (list, tuple)):
            return [canon(x) for x in v]
        return v

    return json.dumps(canon(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain generation to.

    kind: "json_schema" | "json_object" | "regex" | "ebnf" | "choice" | "structural_tag"
    spec: the JSON schema as a JSON string; None for json_object; the regex; the EBNF (GBNF-style,
    root rule "root"); for choice a JSON list of strings; for structural_tag xgrammar's structural
    tag (`{"type": "structural_tag", "format": {...}}`) as a JSON string: free text with
    constrained sections, such as tool calls that open with a trigger. Use the `from_*` constructors to build
    canonical specs (so that equal specs share a cache entry)."""

    kind: str
    spec: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            if self.spec not in (None, ""):
                raise GrammarError("a json_object grammar takes no spec")
            object.__setattr__(self, "spec", None)
        elif not isinstance(self.spec, str):
            raise GrammarError(f"a {self.kind} grammar needs its spec as a string, got {type(self.spec).__name__}")

    @classmethod
    def from_json_schema(cls, schema: dict | bool | str) -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object", None)

    @classmethod
    def from_regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def from_ebnf(cls, grammar: str) -> "GrammarSpec":
        return cls("ebnf", grammar)

    @classmethod
    def from_structural_tag(cls, tag: dict | str) -> "GrammarSpec":
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError as e:
                raise GrammarError(f"the structural tag is not valid JSON: {e}") from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
            raise GrammarError('a structural tag must be {"type": "structural_tag", "format": {...}}')
        return cls("structural_tag", canonical_json(tag))

    @classmethod
    def from_choices(cls, choices: Sequence[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    def choices(self) -> list[str]:
        """The choice list of a `choice` spec (validated)."""
        try:
            items = json.loads(self.spec or "")
        except ValueError as e:
            raise GrammarError(f"a choice spec must be a JSON list of strings: {e}") from None
        if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
            raise GrammarError("a choice spec must be a non-empty JSON list of strings")
        return items

    def schema(self) -> Any:
        """The parsed JSON schema of a `json_schema` spec (validated as JSON)."""
        try:
            value = json.loads(self.spec or "")
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(value).__name__}")
        return value


class Matcher(ABC):
    """Per-request grammar state. Every method is on the per-token hot path: each is a few calls
    into a native library, never a Python loop over the vocabulary."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and the state unchanged) if the grammar does not allow it.
        An EOS token is accepted exactly when `can_end()`; after it the matcher is finished."""

    @abstractmethod
    def fill_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [B, ceil(V/32)] on CPU, bit
        t & 31 of word t >> 5 = token t allowed). EOS bits are set iff `can_end()`."""

    @abstractmethod
    def is_finished(self) -> bool:
        """The grammar is complete: EOS was accepted, or nothing but EOS is allowed now."""

    @abstractmethod
    def can_end(self) -> bool:
        """The text so far is a complete match (EOS is allowed now, unless already accepted)."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (EOS included). ValueError if n is more than accepted."""

    @abstractmethod
    def forced_text(self) -> str:
        """Jump-forward: the text that every continuation starts with ('' if none), whole UTF-8
        characters only."""

    @property
    @abstractmethod
    def num_accepted(self) -> int:
        """Tokens accepted so far (net of rollbacks)."""

    def defer_mask(self, row: int, jobs: "MaskJobs") -> bool:
        """`fill_masks`' first half: where this matcher's mask is computed natively together with
        other rows' (llguidance's thread pool), add it to `jobs` for bitmask[row] and return True;
        `finish_mask` then completes the row once the jobs ran. False (the default): `fill_mask`
        fills the row instead."""
        return False

    def finish_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        """`fill_masks`' second half, after a True `defer_mask`: what `fill_mask` does to the row
        after the native mask (a wrapper's narrowing); nothing by default."""


class MaskJobs:
    """Native mask computations collected by `Matcher.defer_mask`: per runner (a function that fills
    the rows of many native matchers of one library at once), its (native matcher, row) pairs."""

    def __init__(self) -> None:
        self.by_runner: dict[Any, list[tuple[Any, int]]] = {}

    def add(self, runner, native: Any, row: int) -> None:
        self.by_runner.setdefault(runner, []).append((native, row))


def fill_masks(matchers: Sequence[Matcher], bitmask: "torch.Tensor") -> None:
    """bitmask[j] = matchers[j]'s mask, for every j: the rows a native library computes in
    parallel (llguidance, GIL released) go to it in one call, the rest are filled one by one.
    The same masks as `fill_mask` row by row, in a fraction of the time at a batch of many."""
    jobs = MaskJobs()
    deferred = [m.defer_mask(j, jobs) for j, m in enumerate(matchers)]
    for runner, pairs in jobs.by_runner.items():
        runner(pairs, bitmask)
    for j, (m, d) in enumerate(zip(matchers, deferred)):
        if d:
            m.finish_mask(bitmask, j)
        else:
            m.fill_mask(bitmask, j)


class Grammar(ABC):
    """A compiled grammar: immutable, shareable across requests and threads, cached by spec."""

    spec: GrammarSpec
    backend_name: str
    compile_time_s: float = 0.0
    # True where the backend relaxed keywords it cannot enforce (a finished document may break them;
    # the engine's output check validates every JSON-schema output against the real schema)
    approximate: bool = False

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        """Compile a spec (blocking; GrammarCache runs this off-thread). Raises GrammarError for a
        bad spec. `timeout_s` is a hard limit where the backend can enforce one (outlines: its
        worker process is killed); GrammarCache enforces a soft one for all backends."""

    @property
    def cache_key(self) -> tuple:
        """What distinguishes this backend's compiled grammars (name and options)."""
        return (self.name,)


def decode_forced(data: bytes) -> str:
    """The longest prefix of `data` made of whole UTF-8 characters ('' if it starts inside one)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")


def clean_error(e: BaseException) -> str:
    """A native library's error message without its log prefix ("[time] /path/file.cc:123: ")."""
    msg = str(e).strip()
    if msg.startswith("[") and "] " in msg:
        rest = msg.split("] ", 1)[1]
        if ": " in rest and rest.split(": ", 1)[0].rsplit(":", 1)[-1].isdigit():
            rest = rest.split(": ", 1)[1]
        msg = rest
    return msg.replace("Check failed: (error.empty()) is false: ", "").strip()
