"""The `auto` backend (the default): each spec goes to the backend that handles its kind best,
falling back to the next one when a backend refuses the spec.

Measured on JSONSchemaBench (300 real-world schemas, SmolLM2 tokenizer; see
benchmarks/grammar_jsonschemabench.py): llguidance is exact on every schema it accepts and refuses
the rest with an error, while xgrammar compiles nearly all but approximates some keywords
(`oneOf` as `anyOf`, `required` inside `anyOf` branches, untyped `pattern` branches, `uniqueItems`,
`multipleOf`), letting invalid instances through. llguidance also compiles schemas faster. So
JSON schemas try llguidance first and xgrammar second: every schema compiles, and the exact
backend is used wherever it can be. (llguidance itself relaxes `oneOf` and the keywords it does
not implement before refusing a schema: see LLGuidanceBackend.compile; the engine validates
every finished document.) Regexes, EBNF, choices and json_object go to xgrammar first
(its masks are the cheapest per token); structural tags (xgrammar's format) to xgrammar alone.
"""

from __future__ import annotations

from .base import Grammar, GrammarBackend, GrammarError, GrammarSpec

# kind -> backends to try, in order (those not installed are skipped)
ORDER = {
    "json_schema": ("llguidance", "xgrammar"),
    "json_object": ("xgrammar", "llguidance"),
    "regex": ("xgrammar", "llguidance"),
    "ebnf": ("xgrammar", "llguidance"),
    "choice": ("xgrammar", "llguidance"),
    "structural_tag": ("xgrammar",),  # xgrammar's own format
}


class AutoBackend(GrammarBackend):
    """Tries the backends of `ORDER[spec.kind]` in turn; the first that compiles wins. A spec every
    backend refuses fails with all their reasons."""

    name = "auto"

    def __init__(self, backends: dict[str, GrammarBackend]) -> None:
        if not backends:
            raise ValueError("the auto grammar backend needs at least one backend")
        self.backends = backends

    @property
    def cache_key(self) -> tuple:
        return (self.name, *(b.cache_key for b in self.backends.values()))

    def order(self, kind: str) -> list[GrammarBackend]:
        """The installed backends a spec of this kind tries, in order."""
        names = [n for n in ORDER.get(kind, ()) if n in self.backends]
        return [self.backends[n] for n in names] or list(self.backends.values())

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        reasons: list[str] = []
        for backend in self.order(spec.kind):
            try:
                return backend.compile(spec, timeout_s=timeout_s)
            except GrammarError as e:
                msg = str(e)
                reasons.append(msg if msg.startswith(backend.name) else f"{backend.name}: {msg}")
        if len(reasons) == 1:
            raise GrammarError(reasons[0])
        raise GrammarError("no grammar backend accepts this spec: " + "; ".join(reasons))
