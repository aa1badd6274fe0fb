"""The program IR: what `s += ...` appends. Expressions are plain data; the interpreter runs them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Regexes behind gen(dtype=...), SGLang's own: the value stays the generated text. The numbers end
# in optional blanks because gen(dtype=int|float) also stops at " " and "\n" (as in SGLang): a
# small model that wants to write "," after a number can end it there instead of adding digits.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


class Expr:
    """Anything that can be appended to a state; `str + expr` and `expr + str` make a list."""

    def __add__(self, other: Any) -> "ExprList":
        return ExprList([self, other])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([other, self])


@dataclass(eq=False)
class ExprList(Expr):
    items: list

    def __post_init__(self) -> None:
        flat: list = []
        for it in self.items:
            flat.extend(it.items if isinstance(it, ExprList) else [it])
        self.items = flat


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: dict = field(default_factory=dict)  # sampling keys set by the caller (None = default)
    logprob: dict = field(default_factory=dict)  # return_logprob etc.
    extra_stop: list[str] | None = None  # added to the stop strings in force (gen(dtype=int))


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    choices_method: Any = "token_length_normalized"  # a method's name, or an SGLang-style callable
    temperature: float = 0.0


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """After `expr` ran: split each named gen/select in it into its answer (the variable) and its
    reasoning (`<name>_reasoning_content`), by the model family's think markers."""

    model_type: str
    expr: Any


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Role(Expr):
    """`user("hi")`: begin, content, end."""

    role: str
    content: Any = None


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


class Call(Expr):
    """A call of one program inside another (`s += inner(...)`); `plait.frontend.api` runs it."""

    def inline_into(self, state: Any) -> None:
        """Run the called program's body on `state`, at the point where it is appended."""
        raise NotImplementedError


def contains_call(expr: Any) -> bool:
    """Whether appending `expr` runs a nested program (a Call, possibly inside a list or a role)."""
    if isinstance(expr, Call):
        return True
    if isinstance(expr, ExprList):
        return any(contains_call(it) for it in expr.items)
    if isinstance(expr, Role):
        return contains_call(expr.content)
    return False


def schema_to_str(schema: Any) -> str | None:
    """A JSON schema given as a dict, a JSON string or a pydantic model class -> a JSON string."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # pydantic v2
        return json.dumps(schema.model_json_schema())
    if isinstance(schema, type) and hasattr(schema, "schema_json"):  # pydantic v1
        return schema.schema_json()
    raise TypeError(f"json_schema must be a dict, a JSON string or a pydantic model class, got {type(schema).__name__}")
