"""API speculation (`@function(num_api_spec_tokens=N)`), as SGLang does it: one model call writes
text ahead for several gens, and the program's gens take their values from it, so a program that
interleaves short constant text and gens costs one call instead of one per gen.

- `CompletionSpeculation` (completion calls, any backend): a gen that ends at a stop string and
  finds no text written ahead calls the model once for at least N tokens, without the stop; it
  takes the text up to its stop, and the rest waits for the next gen. Constant text the program
  appends meanwhile must be what the model wrote ahead (then it is consumed), else the text
  written ahead is dropped and the next gen calls the model again.
- `ChatSpeculation` (chat backends, inside an assistant role): a chat API cannot continue a reply
  half written by the program, so the role's constant text and gens are held until the role ends;
  then one chat call (at most N tokens) writes the whole reply, which is matched against the held
  template: the constant text must appear as written and each gen's value runs up to its stop
  string (or up to the constant text after it). A reply that does not fit is asked for again, up
  to `MAX_TRIES` times; after that the gens that did not match are empty, with a warning.

Only plain gens are speculated: a gen with a grammar (regex, json_schema, ebnf, dtype), n > 1 or
stop_regex is run on its own (completion) or refused (chat), because text generated for the
whole template cannot honour a constraint on one part of it. On the completion path a gen with no
stop string also runs on its own: where its value would end in the text written ahead is not
known (SGLang cuts it after max_new_tokens characters, which splits tokens arbitrarily).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")


def stop_list(stop: Any) -> list[str]:
    """A gen's `stop` as a list of non-empty strings (None, a string or a list)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in items if s]


def earliest_stop(text: str, stops: list[str]) -> int | None:
    """Where the first of `stops` begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def plain(sp: dict) -> bool:
    """Whether a gen with these settings may take its value from text written ahead."""
    return (
        not any(sp.get(k) is not None for k in GRAMMAR_KEYS)
        and (sp.get("n") or 1) == 1
        and not stop_list(sp.get("stop_regex"))
    )


class CompletionSpeculation:
    """Text written ahead on the completion path (see the module docstring)."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens
        self.text = ""

    def reset(self) -> None:
        self.text = ""

    def fill(self, piece: str) -> None:
        """The program appended `piece`: consume it if it is what was written ahead."""
        if piece and self.text.startswith(piece):
            self.text = self.text[len(piece) :]
        elif piece:
            self.text = ""

    def serves(self, sp: dict) -> bool:
        """Whether this gen is served from speculation (a plain gen ending at a stop string)."""
        return plain(sp) and bool(stop_list(sp.get("stop")))

    def take(
        self, prompt: str, sp: dict, lp: dict, generate: Callable[[str, dict, dict], tuple[str, dict]]
    ) -> tuple[str, dict]:
        """The gen's value (up to its stop) and the meta of the call that wrote it ({} when the
        value came from text written by an earlier call)."""
        meta: dict = {}
        if not self.text:
            wide = {**sp, "max_new_tokens": max(sp.get("max_new_tokens") or 0, self.num_tokens), "stop": None}
            self.text, meta = generate(prompt, wide, lp)
        cut = earliest_stop(self.text, stop_list(sp.get("stop")))
        cut = len(self.text) if cut is None else cut
        value, self.text = self.text[:cut], self.text[cut:]
        return value, meta


# What a held assistant role contains: ("fill", text), ("gen", Gen, sp) or ("expr", expression).
Item = tuple


class ChatSpeculation:
    """An assistant role held for one chat call (see the module docstring)."""

    MAX_TRIES = 3
    # settings that must agree between the gens of one role: they become one call's settings
    _SHARED = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "seed")

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens
        self.items: list[Item] = []
        self.sampling: dict | None = None  # the one call's settings, from the first gen
        self._shared: dict = {}

    def add_fill(self, text: str) -> None:
        if text:
            self.items.append(("fill", text))

    def add_expr(self, expr: Any) -> None:
        self.items.append(("expr", expr))

    def add_gen(self, gen: Any, sp: dict) -> None:
        """Hold a gen; its settings other than stop and length must agree with the role's others."""
        if not plain(sp):
            raise NotImplementedError(
                "with num_api_spec_tokens on a chat backend, a gen inside an assistant "
                "role cannot have regex/json_schema/ebnf/dtype, n > 1 or stop_regex"
            )
        shared = {k: sp.get(k) for k in self._SHARED}
        if self.sampling is None:
            self.sampling = {**sp, "max_new_tokens": self.num_tokens, "stop": None, "stop_regex": None}
            self._shared = shared
        elif shared != self._shared:
            raise ValueError(
                "with num_api_spec_tokens, the gens of one assistant role must share their "
                f"sampling settings (got {self._shared} and {shared})"
            )
        self.items.append(("gen", gen, sp))

    def resolve(self, chat: Callable[[dict], tuple[str, dict]]) -> list[Item]:
        """The held items with each gen replaced by ("value", gen, value, meta): one chat call
        (asked again while its reply does not fit the template), none when there is no gen."""
        if self.sampling is None:
            return list(self.items)
        values: dict[int, str] = {}
        meta: dict = {}
        for _ in range(self.MAX_TRIES):
            reply, meta = chat(dict(self.sampling))
            values, ok = self.match(reply)
            if ok:
                break
        else:
            warnings.warn(
                f"API speculation: the model's reply did not fit the program's template in "
                f"{self.MAX_TRIES} tries; the gens that did not match are empty",
                RuntimeWarning,
                stacklevel=2,
            )
        return [("value", it[1], values.get(i, ""), meta) if it[0] == "gen" else it for i, it in enumerate(self.items)]

    def match(self, reply: str) -> tuple[dict[int, str], bool]:
        """Each gen's value by its index in `items` (those matched so far) and whether the whole
        reply fits: constant text as written, each gen up to its stop, or up to the constant text
        after it, or (the last one) to the end."""
        pieces = [(i, it) for i, it in enumerate(self.items) if it[0] in ("fill", "gen")]
        values: dict[int, str] = {}
        rest = reply
        for k, (i, it) in enumerate(pieces):
            if it[0] == "fill":
                if not rest.startswith(it[1]):
                    return values, False
                rest = rest[len(it[1]) :]
                continue
            nxt = pieces[k + 1][1] if k + 1 < len(pieces) else None
            end = _gen_end(rest, stop_list(it[2].get("stop")), nxt)
            if end is None:
                return values, False
            values[i], rest = rest[:end], rest[end:]
        return values, True


def _gen_end(rest: str, stops: list[str], nxt: Item | None) -> int | None:
    """Where a held gen's value ends in the rest of the reply, or None if it cannot be told."""
    if stops:
        cut = earliest_stop(rest, stops)
        if cut is not None:
            return cut
    elif nxt is not None and nxt[0] == "fill":
        cut = rest.find(nxt[1])
        if cut >= 0:
            return cut
    return len(rest) if nxt is None else None
