"""Per-request sampling parameters (SGLang protocol names and semantics).

`temperature == 0` (or `top_k == 1`) means greedy; `top_k == -1` means no top-k cut.
The grammar fields (`regex`, `json_schema`, `ebnf`, `choices`; at most one) are turned into
a `plait.grammar.GrammarSpec` by `grammar_spec()`; the scheduler compiles and enforces it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

from ..grammar.schema_keywords import static_refs
from ..grammar.schema_rewrite import resolve_local_ref

# Field kinds used by `validate` (and by `__post_init__` for normalisation).
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR_LIST_FIELDS = ("stop", "stop_regex")
_OPT_STR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
# Bounds on what one request may ask for: ints fit in 64 bits (the wire format), and the lists
# that cost work per generated token (stop strings) or per request (n copies) stay small.
MAX_INT = 2**63 - 1
MAX_N = 128
MAX_STOP_STRINGS = 128
MAX_STOP_STR_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024


def _is_int(v: Any) -> bool:
    # bool is an int subclass, but `max_new_tokens=True` is a caller bug, not 1.
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    `stop` / `stop_regex` accept a single string (normalised to a one-element list);
    `None` for any field means its default. Call `validate()` before using the params.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None  # plait extension: the output is exactly one of these
    structural_tag: str | None = None  # xgrammar's structural tag (JSON): free text with constrained sections
    # plait extensions: JSON output's length guards (None: the server's; 0: no bound)
    json_max_number_digits: int | None = None
    json_max_string_length: int | None = None
    # plait extension, for reasoning models: the constraint binds once the output has written
    # `reasoning_end` (e.g. "</think>"); with `reasoning_start` the section is optional, taken only
    # when the output opens with that marker's first token
    reasoning_start: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        # None means "default" for every field (JSON clients send explicit nulls).
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                if f.default is not dataclasses.MISSING:
                    setattr(self, f.name, f.default)
                elif f.default_factory is not dataclasses.MISSING:
                    setattr(self, f.name, f.default_factory())
        for name in _STR_LIST_FIELDS:
            v = getattr(self, name)
            if isinstance(v, str):
                setattr(self, name, [v])
            elif isinstance(v, (list, tuple)):
                setattr(self, name, list(v))  # copy: never alias the caller's list
        if isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.json_schema, (dict, bool)):  # Python callers may pass the schema itself
            import json

            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            import json

            self.structural_tag = json.dumps(self.structural_tag)
        if isinstance(self.choices, tuple):
            self.choices = list(self.choices)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, strict: bool) -> "SamplingParams":
        """Build from a mapping of field name -> value (values are not validated here).

        `None` values (and `d is None`) mean defaults. With `strict=True` (Python API) an
        unknown key raises ValueError naming it; with `strict=False` (HTTP, SGLang protocol)
        unknown keys are ignored.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown and strict:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError (naming the field) if any value has the wrong type or range.

        `vocab_size`, when given, bounds `stop_token_ids` to `[0, vocab_size)`.
        """
        self._check_types()
        self._check_sizes()
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        t = float(self.temperature)
        if math.isnan(t):
            raise ValueError(f"temperature must be >= 0, got {t}")
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        if math.isinf(t):
            # logits / inf turns masked (-inf) logits into NaN.
            raise ValueError(f"temperature must be finite, got {t}")
        # `not (lo <= x <= hi)` form so NaN is rejected too.
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {float(self.top_p)}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= float(self.min_p) <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {float(self.min_p)}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = float(getattr(self, name))
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        rp = float(self.repetition_penalty)
        if not (rp > 0.0) or math.isinf(rp):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {rp}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        hi = "inf" if vocab_size is None else vocab_size
        for t_id in self.stop_token_ids:
            if t_id < 0 or (vocab_size is not None and t_id >= vocab_size):
                raise ValueError(f"stop_token_ids must be in [0, {hi}), got {t_id}")

    def _check_sizes(self) -> None:
        for name in (*_INT_FIELDS, "seed"):
            v = getattr(self, name)
            if v is not None and not -MAX_INT - 1 <= v <= MAX_INT:
                raise ValueError(f"{name} must fit in a 64-bit integer, got {v}")
        if len(self.stop) > MAX_STOP_STRINGS or len(self.stop_regex) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STR_LEN for s in (*self.stop, *self.stop_regex)):
            raise ValueError(f"a stop string may be at most {MAX_STOP_STR_LEN} characters long")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not -MAX_INT - 1 <= t <= MAX_INT:
                raise ValueError(f"stop_token_ids must be token ids, got {t}")

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {type(v).__name__} {v!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_real(v):
                raise ValueError(f"{name} must be a number, got {type(v).__name__} {v!r}")
            try:
                setattr(self, name, float(v))  # an int 10**30 is a float for the wire and the sampler
            except OverflowError:  # an int too large for a float
                raise ValueError(f"{name} is out of range, got {v}") from None
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
        for name in _STR_LIST_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise ValueError(f"{name} must be a string or a list of strings, got {v!r}")
        v = self.stop_token_ids
        if not isinstance(v, list) or not all(_is_int(t) for t in v):
            raise ValueError(f"stop_token_ids must be a list of ints, got {v!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
        for name in ("json_max_number_digits", "json_max_string_length"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 (0: no bound) or None, got {v!r}")
        for name in _OPT_STR_FIELDS:
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string or None, got {type(v).__name__}")
        if self.choices is not None and (
            not isinstance(self.choices, list)
            or not self.choices
            or not all(isinstance(c, str) and c for c in self.choices)
        ):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        for name in ("reasoning_start", "reasoning_end"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string or None, got {v!r}")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("reasoning_start needs reasoning_end")
        given = [n for n in (*_OPT_STR_FIELDS, "choices") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of regex, json_schema, ebnf, structural_tag, choices; got {', '.join(given)}"
            )

    def grammar_spec(self):
        """The grammar this request is constrained to (a `plait.grammar.GrammarSpec`), or None.
        Raises `GrammarError` (a ValueError) for a spec that is not even well-formed."""
        from plait.grammar import GrammarError, GrammarSpec

        if self.json_schema is not None:
            spec = GrammarSpec.from_json_schema(self.json_schema)
            cycle = _cached_ref_cycle(spec.spec)
            if cycle:  # some backends compile it to a grammar that admits nothing
                raise GrammarError(f"invalid grammar: json_schema: circular $ref with no schema content: {cycle}")
            return spec
        if self.regex is not None:
            return GrammarSpec.from_regex(self.regex)
        if self.ebnf is not None:
            return GrammarSpec.from_ebnf(self.ebnf)
        if self.choices is not None:
            return GrammarSpec.from_choices(self.choices)
        if self.structural_tag is not None:
            return GrammarSpec.from_structural_tag(self.structural_tag)
        return None

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature 0 or top_k 1."""
        return self.temperature == 0 or self.top_k == 1


# Keys that do not constrain a value: a schema with only these and `$ref` is just the reference.
_ANNOTATIONS = frozenset(
    {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default", "examples"}
)


@functools.lru_cache(maxsize=256)
def _cached_ref_cycle(schema_text: str) -> str | None:
    # (per request in the scheduler: a large schema takes milliseconds, and schemas repeat)
    return ref_cycle(json.loads(schema_text))


def ref_cycle(schema: Any) -> str | None:
    """A chain of local `$ref`s that only ever points at more references (`{"$ref": "#"}`,
    a -> b -> a): such a schema describes no value. Returns the chain as text, or None. (References
    are read as document pointers first: `#/$defs/A` inside a nested `$id` is that resource's.)"""
    schema = static_refs(schema)
    stack, seen_nodes = [schema], set()
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict) or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        stack.extend(node.values())
        chain: list[str] = []
        cur = node
        while isinstance(cur, dict) and isinstance(cur.get("$ref"), str) and set(cur) <= _ANNOTATIONS:
            if cur["$ref"] in chain:
                return " -> ".join([*chain, cur["$ref"]])
            chain.append(cur["$ref"])
            cur = resolve_local_ref(schema, cur["$ref"])
    return None
