"""Length guards for JSON output: bounds on the free-length parts of a document (number digits,
strings without a maxLength) and, near `max_tokens`, a steer towards closing it, applied on top
of whichever backend's mask.

A small model at temperature 0.8 can write `11.111111111111111588888...` or a never-ending
string until max_tokens, and the grammar allows it. The guard narrows the backend's mask only
where the narrowed mask still allows a token, so it never rules out a document the grammar
allows at that point: where the grammar demands more digits or characters (a large `minimum`,
a `minLength`, an enum value) it defers to the grammar. What the document is stays the
backend's business; the guard only chooses among what the backend allows.

- numbers: an integer part of at most `max_number_digits` digits (19 fit an int64), a fraction
  of at most min(that, 17) (a float64's precision), an exponent of at most 3 (its range);
- strings: at most `max_string_length` characters (raised to the schema's largest `maxLength` or
  `minLength`), after which only tokens that close the string are allowed; where the string's
  `pattern` does not match yet (no closing token is allowed), the shortest way to a match of one of
  the schema's patterns is written instead, then the quote (string_patterns.py);
- closing: before the end (64 tokens plus twice an estimate from the schema's required keys, or
  at once) the guard walks the grammar ahead of the model with the
  cheapest choices (close the string, stop the number, close a bracket, the shortest value, at a
  key the next required one; among those the longest token, so the fewest steps; where the grammar
  forces text, such as a required key's name, its longest token, found without a mask; rolled back
  after) to estimate the shortest way to
  finish the document: a walk as long as that close, a few steps for a small schema, hundreds
  where many keys are required and closing must start early. It walks again each time the slack
  beyond the estimate has halved. Within twice the estimate, plus room for one more of what the
  schema repeats (an array item, a map value: `repeat_bound`), at most the last half of
  max_tokens, the closing choices are preferred (the model closes what it has open instead of
  opening, say, an array item with many required keys that no longer fits). Once the tokens left come within a margin of it (CLOSING_MARGIN
  and a CLOSING_SHARE of the estimate, as the model may deepen the document meanwhile), the
  document ends along that walk, token by token: the model's own closing choices can take longer
  (`" "` for `""`, an optional key), and a document that fitted would be cut. So a document that
  can still fit ends valid ("stop") instead of cut ("length"). Where the walk finds no close (a
  string whose `pattern` refuses the quote), the closing choices are preferred and the model
  picks among them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from .base import Matcher
from .schema_rewrite import resolve_local_ref
from .string_patterns import completions, schema_patterns

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer_info import TokenizerInfo

FRACTION_DIGITS = 17  # a float64 holds 15-17 significant decimal digits
EXPONENT_DIGITS = 3  # a float64's exponent stays within +-308
PROBE_FLOOR = 64  # the first estimate at the latest this many tokens before max_tokens
PROBE_STEPS = 1024  # the walk's length limit (a longer close counts as this)
PROBE_EVERY = 4  # re-estimate at least this many tokens apart
CLOSING_MARGIN = 2  # tokens kept beyond the estimate, plus a quarter of it: the model can
CLOSING_SHARE = 4  # deepen the document (open a nested object) between two estimates
SOFT_FACTOR = 2  # within this many times the estimate (plus SOFT_EXTRA) of the end, the
SOFT_EXTRA = 16  # closing choices are preferred: nothing new is opened that may not fit
ROOM_CAP = 128  # the soft zone's room for one more repeated part, at most (a cycle counts as unbounded)
REPEAT_NODES = 5000  # schema nodes `repeat_bound` reads, at most
REQUIRED_KEYS = 64  # required key names a closing walk tries at a key's start, at most
_CLOSERS = frozenset(b"}] \n\t")
_WS = frozenset(b" \n\t\r")
_SHORT_VALUES = frozenset({b"0", b'""', b"[]", b"{}", b"null", b"true", b"false"})


@dataclasses.dataclass(frozen=True)
class JsonLimits:
    """The guard's bounds; 0 turns a bound off."""

    max_number_digits: int = 19
    max_string_length: int = 512


class _State(NamedTuple):
    """Where the text so far stands, lexically (outside a string, `run` counts the current
    number's digits of part `part`: 0 integer, 1 fraction, 2 exponent). A tuple: `_scan` runs on
    every token, and unpacks it."""

    in_string: bool = False
    escape: bool = False
    str_len: int = 0
    in_number: bool = False
    part: int = 0
    run: int = 0
    depth: int = 0


def _scan(s: _State, data: bytes) -> _State:
    """The state after `data` (a token's bytes)."""
    in_string, escape, str_len, in_number, part, run, depth = s
    for c in data:
        if in_string:
            if escape:
                escape = False
                str_len += 1
            elif c == 0x5C:  # backslash
                escape = True
            elif c == 0x22:  # closing quote
                in_string = False
            elif c & 0xC0 != 0x80:  # a character starts (not a UTF-8 continuation byte)
                str_len += 1
        elif c == 0x22:
            in_string, str_len, in_number, run = True, 0, False, 0
        elif 0x30 <= c <= 0x39:
            if not in_number:
                in_number, part, run = True, 0, 0
            run += 1
        elif in_number and c == 0x2E:  # '.'
            part, run = 1, 0
        elif in_number and c in (0x65, 0x45):  # 'e' / 'E'
            part, run = 2, 0
        elif c == 0x2D and not in_number:  # a leading '-'
            in_number, part, run = True, 0, 0
        elif in_number and c in (0x2B, 0x2D) and part == 2:
            pass  # the exponent's sign
        else:
            in_number, run = False, 0
            if c in (0x7B, 0x5B):
                depth += 1
            elif c in (0x7D, 0x5D):
                depth -= 1
    return _State(in_string, escape, str_len, in_number, part, run, depth)


def _allows(r, token: int) -> bool:
    """Whether packed mask row `r` (a tensor or its numpy view) allows `token`."""
    return bool((int(r[token >> 5]) >> (token & 31)) & 1)


def _only(r: "torch.Tensor", token: int) -> None:
    """Mask row `r` allowing `token` alone."""
    word, bit = divmod(token, 32)
    r.zero_()
    r[word] = -(1 << 31) if bit == 31 else 1 << bit


def _string_so_far(before: _State, written: bytes, data: bytes, after: _State) -> bytes:
    """The open string's bytes after token `data` (`written` before it); empty outside a string."""
    if not after.in_string:
        return b""
    if before.in_string and 0x22 not in data:
        return written + data
    return data[data.rindex(b'"') + 1 :]


def close_bound(schema: Any, root: Any = None, depth: int = 0) -> int:
    """A generous estimate, from the schema alone, of the tokens the shortest document takes:
    where the guard first walks the grammar (a walk costs a mask a step, so not at every request's
    first token when its close is short). Required keys with their shortest values, minItems
    items, minLength characters; a reference cycle or deep nesting counts as unbounded."""
    root = schema if root is None else root
    if depth > 16 or not isinstance(schema, dict):
        return 2 if depth <= 16 else 1 << 20
    if isinstance(schema.get("$ref"), str):
        target = resolve_local_ref(root, schema["$ref"])
        return close_bound(target, root, depth + 1) if target is not None else 4
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"] or [None]
        return min(len(json.dumps(v)) for v in values) // 2 + 2
    branches = [b for k in ("anyOf", "oneOf") for b in schema.get(k) or () if isinstance(b, dict)]
    best = min((close_bound(b, root, depth + 1) for b in branches), default=0)
    for part in schema.get("allOf") or ():
        best += close_bound(part, root, depth + 1)
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for key in schema.get("required") or ():
        if isinstance(key, str):
            best += len(key) // 2 + 4 + close_bound(props.get(key, {}), root, depth + 1)
    items = schema.get("items")
    if isinstance(schema.get("minItems"), int) and schema["minItems"] > 0:
        best += schema["minItems"] * (2 + close_bound(items if isinstance(items, dict) else {}, root, depth + 1))
    if isinstance(schema.get("minLength"), int):
        best += schema["minLength"]
    return best + 2


def repeat_bound(schema: Any) -> int:
    """A generous estimate of the tokens one more repeated part of a document takes: the largest
    `close_bound` of an array's `items` or an object's `additionalProperties` value (with its key)."""
    best, stack, seen = 0, [schema], 0
    while stack and seen < REPEAT_NODES:
        node, seen = stack.pop(), seen + 1
        if isinstance(node, dict):
            for k in ("items", "additionalProperties"):
                if isinstance(node.get(k), dict):
                    best = max(best, close_bound(node[k], schema) + 4)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(node)
    return best


def schema_string_bound(schema: Any) -> int:
    """The largest `maxLength` / `minLength` anywhere in a schema (0 if none)."""
    best = 0
    stack = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k in ("maxLength", "minLength"):
                n = v.get(k)
                if isinstance(n, int) and not isinstance(n, bool):
                    best = max(best, n)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return best


class GuardTables:
    """Per-tokenizer packed masks (built once; a Python pass over the vocabulary at build time only)."""

    def __init__(self, info: "TokenizerInfo") -> None:
        from .bitmask import bitmask_width

        self.token_bytes = info.token_bytes
        width = bitmask_width(info.vocab_size)
        n = min(info.tokenizer_vocab_size, info.vocab_size)
        lead = np.zeros(width * 32, dtype=np.int32)
        quote = np.zeros(width * 32, dtype=bool)
        string_end = np.zeros(width * 32, dtype=bool)
        closer = np.zeros(width * 32, dtype=bool)
        value = np.zeros(width * 32, dtype=bool)
        opener = np.zeros(width * 32, dtype=bool)
        length = np.zeros(width * 32, dtype=np.int32)
        self.by_bytes: dict[bytes, int] = {}  # a token of each byte string
        for i, b in info.normal_tokens():
            if i >= n:
                break
            k = len(b) - len(b.lstrip(b"0123456789"))
            lead[i] = k
            if 0x22 in b and 0x5C not in b:  # (not `\"`: an escaped quote keeps the string open)
                quote[i] = True
                string_end[i] = all(c == 0x22 or c in _CLOSERS for c in b)
            closer[i] = all(c in _CLOSERS for c in b) and not all(c in _WS for c in b)
            value[i] = b.strip() in _SHORT_VALUES
            opener[i] = b.strip() in (b'"', b"[", b"{")
            length[i] = len(b)
            self.by_bytes.setdefault(b, i)
        for e in info.eos_token_ids:
            quote[e] = string_end[e] = closer[e] = True
        self._lead = lead
        self.max_token_bytes = int(length.max())
        self._shifts = torch.arange(32, dtype=torch.int64)
        self._length_np = length  # bytes per token (0: special tokens)
        self._shifts_np = np.arange(32, dtype=np.int32)
        self.quote = self._pack(quote)
        self.string_end = self._pack(string_end)
        self.closer = self._pack(closer)
        self.value = self._pack(value)
        self.opener = self._pack(opener)
        self._digits: dict[int, torch.Tensor] = {}

    def _pack(self, allowed) -> np.ndarray:
        """A packed mask row (numpy int32: the guard's row ops run in numpy, see `longest`)."""
        bits = torch.from_numpy(allowed.reshape(-1, 32).astype("int64")) << self._shifts
        words = bits.sum(dim=1)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).numpy()

    def longest(self, row: "torch.Tensor") -> int:
        """The allowed token of packed mask row `row` with the most bytes (the lowest id among
        equals; EOS where it is the only one; -1 if none). Unpacks only the nonzero words: a
        closing mask allows a few tokens. (numpy on the row's memory: a closing walk calls this
        at every step, and torch's per-op cost is most of the time of ops on ~1500 words.)"""
        r = row.numpy()
        words = np.flatnonzero(r)
        if not len(words):
            return -1
        bits = (r[words, None] >> self._shifts_np) & 1  # [words, 32]
        ids = (words[:, None] * 32 + self._shifts_np).ravel()
        lengths = np.where(bits.ravel() != 0, self._length_np[ids], -1)
        return int(ids[lengths.argmax()])

    def digits(self, room: int) -> np.ndarray:
        """Tokens that start with at most `room` digits."""
        m = self._digits.get(room)
        if m is None:
            m = self._digits[room] = self._pack(self._lead <= room)
        return m


def guard_tables(info: "TokenizerInfo") -> GuardTables:
    return info.backend_state("json_guard", lambda: GuardTables(info))


class SchemaProfile(NamedTuple):
    """What the guard reads from a schema, once per schema (a large one takes milliseconds)."""

    string_bound: int = 0  # the largest maxLength / minLength
    close: int = 0  # close_bound: the first estimate's timing
    room: int = 0  # the soft zone's room for one more repeated part
    patterns: tuple[str, ...] = ()
    required: tuple[bytes, ...] = ()  # required key names, as written after a key's opening quote


@functools.lru_cache(maxsize=256)
def schema_profile(schema_text: str) -> SchemaProfile:
    """The `SchemaProfile` of a JSON schema's text (cached: requests repeat their schemas)."""
    schema = json.loads(schema_text)
    bound = close_bound(schema)
    room = min(max(bound, repeat_bound(schema)), ROOM_CAP)
    return SchemaProfile(schema_string_bound(schema), bound, room, schema_patterns(schema), required_keys(schema))


def required_keys(schema: Any) -> tuple[bytes, ...]:
    """The names of the schema's `required` lists (the first REQUIRED_KEYS, the root's first), each
    as a document writes it after the key's opening quote: escaped, with the closing quote."""
    found: dict[bytes, None] = {}
    queue = [schema]
    while queue and len(found) < REQUIRED_KEYS:
        node = queue.pop(0)
        if isinstance(node, dict):
            if isinstance(node.get("required"), list):
                for k in node["required"]:
                    if isinstance(k, str):
                        found.setdefault(json.dumps(k, ensure_ascii=False)[1:].encode(), None)
            queue.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            queue.extend(node)
    return tuple(found)[:REQUIRED_KEYS]


class JsonGuard(Matcher):
    """A JSON grammar's matcher with the length guards on its mask (see the module docstring)."""

    def __init__(
        self,
        inner: Matcher,
        tables: GuardTables,
        limits: JsonLimits,
        max_tokens: int,
        profile: SchemaProfile | None = None,
    ) -> None:
        self.inner = inner
        self.tables = tables
        self.max_tokens = max_tokens
        self.number_caps = (
            (limits.max_number_digits, min(limits.max_number_digits, FRACTION_DIGITS), EXPONENT_DIGITS)
            if limits.max_number_digits > 0
            else None
        )
        profile = profile or SchemaProfile()
        self.string_cap = max(limits.max_string_length, profile.string_bound) if limits.max_string_length > 0 else 0
        self.state = _State()
        self._written = b""  # the open string's bytes so far
        self._patterns = profile.patterns
        self._required = profile.required
        self._history: list[tuple] = []  # per accepted token: what rollback restores (_saved)
        self._scratch = np.empty(tables.quote.shape, dtype=np.int32)
        self._probe = torch.empty(1, tables.quote.shape[0], dtype=torch.int32)
        # tokens left at the first estimate: soon enough for the schema's close, with room to spare
        self._probe_at = min(max_tokens, PROBE_FLOOR + 2 * profile.close)
        self._room = profile.room
        self._need = 0  # the last estimate of the shortest close ...
        self._walked_at = -1  # ... made with this many tokens left
        self._closing_now = False
        self._soft = False  # within twice the estimate: closing choices preferred
        self._path: tuple[int, ...] | None = None  # while closing: the walk's tokens ...
        self._step = 0  # ... and how many of them are written
        self._path_failed = False  # the walk found no close: closing tiers only

    def _tiers(self, s: _State, closing: bool) -> list[np.ndarray]:
        """The masks to narrow to in state `s`, in order of preference; the first that leaves a
        token wins (none: the grammar's mask as it is)."""
        t = self.tables
        if s.in_string:
            # (mid-escape a quote is the escaped character, not the close: `_toward_close` then)
            return [t.string_end, t.quote] if self._ending(s, closing) and not s.escape else []
        if s.in_number:
            if closing:
                return [t.closer, t.digits(0)]
            return [] if self.number_caps is None else [t.digits(max(0, self.number_caps[s.part] - s.run))]
        return [t.closer, t.value, t.opener] if closing else []

    def _ending(self, s: _State, closing: bool) -> bool:
        """Whether the open string should end now: closing, or past the string cap."""
        return closing or bool(self.string_cap and s.str_len >= self.string_cap)

    def _closing(self) -> bool:
        """Whether the tokens left are down to the shortest close (plus the margin); sets `_soft`
        when they are within twice it, where the closing choices are preferred so that the model
        does not open what no longer fits (a new array item with many required keys)."""
        if self._closing_now:
            return True
        left = self.max_tokens - self.inner.num_accepted
        # an estimate from tokens ago that says "close now" is walked again first: the document
        # has usually come nearer its end meanwhile, and closing on the old figure cut it short
        stale = left <= self._need + self._margin() and self._walked_at != left
        path: list[int] | None = None
        if left <= self._probe_at or stale:
            path = []
            self._need = self._shortest_close(limit=min(left, PROBE_STEPS), path=path)
            self._walked_at = left
            soft = self._soft_zone()
            # the next estimate when three quarters of the slack to the soft zone are spent, inside
            # it when half the slack to the close is: few walks (each costs a mask a step of the
            # close) while the model, held to the closing choices there, closes the document itself
            gap = (left - self._need - self._margin()) // 2 if left <= soft else (left - soft) * 3 // 4
            self._probe_at = left - max(PROBE_EVERY, gap)
        self._soft = left <= self._soft_zone()
        self._closing_now = left <= self._need + self._margin()
        if self._closing_now and path is not None and not self._path_failed:  # along the walk just made
            if self._need <= left:
                self._path, self._step = tuple(path), 0
            else:
                self._path_failed = True
        return self._closing_now

    def _soft_zone(self) -> int:
        """Tokens before the end where closing choices are preferred (at most the last half), with
        room for one more of what the schema repeats: an array item opened just outside the zone,
        before any estimate saw it, took more than was left (dependabot's `updates`)."""
        return min(SOFT_FACTOR * self._need + SOFT_EXTRA + self._room, self.max_tokens // 2)

    def _margin(self) -> int:
        return CLOSING_MARGIN + self._need // CLOSING_SHARE

    def _next_forced(self) -> int | None:
        """The walk's next token while closing (walked when closing begins, and again whenever the
        document leaves the walk: jump-forward, a rollback); None if the walk found no close."""
        if self._path is None and not self._path_failed:
            path: list[int] = []
            left = self.max_tokens - self.inner.num_accepted
            if self._shortest_close(limit=min(left, PROBE_STEPS), path=path) <= left:
                self._path, self._step = tuple(path), 0
            else:
                self._path_failed = True
        if self._path is None or self._step >= len(self._path):
            return None
        return self._path[self._step]

    def _shortest_close(self, limit: int = PROBE_STEPS, path: list[int] | None = None) -> int:
        """Tokens (EOS included) to finish the document from here, taking the closing choices
        wherever the grammar allows them (limit + 1 if the walk takes more); rolled back after.
        `path`, if given, receives the walk's tokens (EOS left out)."""
        s, written, steps = self.state, self._written, 0
        tail = b""  # the rest of the way to a pattern's match (and the quote) the walk is writing
        try:
            while steps < limit:
                if self.inner.can_end():
                    return steps + 1
                # the way to a pattern's match being written, else the grammar's forced text: no mask
                tok = self._prefix_token(tail) if tail else self._forced_token()
                if tok is None:
                    self.inner.fill_mask(self._probe, 0)
                    row = self._probe[0]
                    narrowed = self._narrow(row, self._tiers(s, True))
                    tok, tail = (None, b"") if narrowed or not s.in_string else self._toward_close(row, s, written)
                    tok = self.tables.longest(row) if tok is None else tok
                    if tok < 0 or not self.inner.accept(tok):
                        break
                if tail:
                    tail = tail[len(self.tables.token_bytes[tok]) :]
                steps += 1
                if path is not None:
                    path.append(tok)
                if tok < len(self.tables.token_bytes):
                    data = self.tables.token_bytes[tok]
                    s, before = _scan(s, data), s
                    if self._patterns:
                        written = _string_so_far(before, written, data, s)
            return limit + 1
        finally:
            self.inner.rollback(steps)

    def _forced_token(self) -> int | None:
        """Where the grammar forces the next bytes (a key's name, `": "`): the longest token that
        writes a prefix of them, accepted; None where nothing is forced. Nearly half of a walk's
        steps are such, and this costs a lookup instead of a mask (tens of microseconds)."""
        forced = self.inner.forced_text()
        return self._prefix_token(forced.encode()) if forced else None

    def _prefix_token(self, data: bytes) -> int | None:
        """The longest token that writes a prefix of `data` and that the grammar accepts, accepted
        (None if none)."""
        by_bytes = self.tables.by_bytes
        for n in range(min(len(data), self.tables.max_token_bytes), 0, -1):
            tok = by_bytes.get(data[:n])
            if tok is not None and self.inner.accept(tok):
                return tok
        return None

    def _narrow(self, r: "torch.Tensor", tiers: list[np.ndarray]) -> bool:
        """Narrow mask row `r` to the first tier that leaves a token (unchanged if none does:
        False); numpy on the tensor's memory, as `GuardTables.longest`."""
        row, narrowed = r.numpy(), self._scratch
        for m in tiers:
            np.bitwise_and(row, m, out=narrowed)
            if np.count_nonzero(narrowed):
                row[:] = narrowed
                return True
        return False

    def _toward_close(self, r: "torch.Tensor", s: _State, written: bytes) -> tuple[int | None, bytes]:
        """Where an open string cannot close yet: the allowed token that writes the most of the
        shortest way to a match of the string's `pattern`, or, at a key's start, of the first of the
        schema's required keys the grammar takes there (an object's optional keys before its next
        required one are skipped: a walk that took the longest token wrote them all, and measured
        the close of sp_303's items of 80 optional keys at 115 tokens instead of 15); and the bytes
        of that way (with the closing quote). (None, b"") where neither shows one."""
        row = r.numpy()
        # mid-escape (a backslash written, a vocabulary without `\\\\`): the ways from the text before
        # it that go on with an escape, their first backslash written
        cut = 1 if s.escape else 0
        for tail in completions(self._patterns, written[: len(written) - cut]) if self._patterns else ():
            target = json.dumps(tail, ensure_ascii=False)[1:].encode()  # (escaped, with the quote)
            if cut and not target.startswith(b"\\"):
                continue
            if (tok := self._longest_allowed(row, target[cut:])) is not None:
                return tok, target[cut:]
        if s.str_len == 0:
            for key in self._required:
                if (tok := self._longest_allowed(row, key)) is not None and self._takes(key):
                    return tok, key
        return None, b""

    def _longest_allowed(self, row: np.ndarray, target: bytes) -> int | None:
        """The token that writes the longest prefix of `target` and that mask row `row` allows."""
        by_bytes = self.tables.by_bytes
        for n in range(min(len(target), self.tables.max_token_bytes), 0, -1):
            tok = by_bytes.get(target[:n])
            if tok is not None and _allows(row, tok):
                return tok
        return None

    def _takes(self, data: bytes) -> bool:
        """Whether the grammar takes `data` from here (written in its longest tokens; rolled back)."""
        n = 0
        try:
            while data:
                tok = self._prefix_token(data)
                if tok is None:
                    return False
                n += 1
                data = data[len(self.tables.token_bytes[tok]) :]
            return True
        finally:
            self.inner.rollback(n)

    def accept(self, token_id: int) -> bool:
        if not self.inner.accept(token_id):
            return False
        self._history.append(self._saved())
        if self._path is not None and self._step < len(self._path):
            if self._path[self._step] == token_id:
                self._step += 1
            else:
                self._path = None  # off the walk (jump-forward): walk again from here
        if token_id < len(self.tables.token_bytes):
            data, before = self.tables.token_bytes[token_id], self.state
            self.state = _scan(before, data)
            if self._patterns:  # (per token: only where a pattern may need the string's text)
                self._written = _string_so_far(before, self._written, data, self.state)
        return True

    def fill_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        self.inner.fill_mask(bitmask, row)
        self._guard_row(bitmask, row)

    def defer_mask(self, row: int, jobs) -> bool:
        return self.inner.defer_mask(row, jobs)

    def finish_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        self.inner.finish_mask(bitmask, row)
        self._guard_row(bitmask, row)

    def _guard_row(self, bitmask: "torch.Tensor", row: int) -> None:
        """Narrow the grammar's mask in bitmask[row] by the guards."""
        closing = self._closing()
        if closing and not self.inner.can_end() and (forced := self._next_forced()) is not None:
            r = bitmask[row]
            if _allows(r, forced):  # always, unless the grammar changed under the walk
                _only(r, forced)
                return
        st = self.state
        tiers = self._tiers(st, closing or self._soft)
        narrowed = bool(tiers) and self._narrow(bitmask[row], tiers)
        if st.in_string and not narrowed and (tiers or st.escape and self._ending(st, closing or self._soft)):
            # a string its pattern keeps open: steered to the pattern's nearest match and closed; a
            # key near the end: the next required one, not one more optional
            if (tok := self._toward_close(bitmask[row], st, self._written)[0]) is not None:
                _only(bitmask[row], tok)

    def is_finished(self) -> bool:
        return self.inner.is_finished()

    def can_end(self) -> bool:
        return self.inner.can_end()

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)
        if n:
            (
                self.state,
                self._written,
                self._probe_at,
                self._need,
                self._walked_at,
                self._closing_now,
                self._soft,
                self._path,
                self._step,
                self._path_failed,
            ) = self._history[-n]
            del self._history[-n:]

    def _saved(self) -> tuple:
        """The guard's state before a token: a rollback (rejected drafts) restores all of it, so
        its masks depend on the accepted tokens alone, as without speculation."""
        return (
            self.state,
            self._written,
            self._probe_at,
            self._need,
            self._walked_at,
            self._closing_now,
            self._soft,
            self._path,
            self._step,
            self._path_failed,
        )

    def forced_text(self) -> str:
        return self.inner.forced_text()

    @property
    def num_accepted(self) -> int:
        return self.inner.num_accepted


def guarded(matcher: Matcher, spec, info: "TokenizerInfo", limits: JsonLimits, max_tokens: int) -> Matcher:
    """`matcher` with the JSON guards when `spec` is a JSON grammar (the matcher itself otherwise)."""
    if spec.kind not in ("json_schema", "json_object"):
        return matcher
    profile = schema_profile(spec.spec) if spec.kind == "json_schema" else None
    return JsonGuard(matcher, guard_tables(info), limits, max_tokens, profile)
