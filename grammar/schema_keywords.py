"""Keywords llguidance does not implement (its lenient mode drops them), rewritten into ones it does:
exactly where the rewrite is exact, else into a subset of the valid documents, never a superset.

- `$recursiveRef`, `$dynamicRef`, `$anchor` / `$id` references within one document: plain JSON
  pointers (`static_refs`);
- `$ref` beside other keywords: `allOf: [{"$ref": ...}]` beside them, its meaning since draft 2019-09,
  and `$ref` alone in a schema of draft 7 or before, which ignored them (`ref_siblings`); pointers
  percent-encoded as URIs; `$schema` as the id of the draft the validator takes it for
  (`known_drafts`);
- `if` that is not keyed on property values (those are `schema_rewrite.conditional_branches`'):
  `if: true` / `{}` is its `then`, `if: false` its `else`, an `if` on values holds together with its
  `then` (`plain_conditional`: a subset);
- `not` over a schema of unknown keywords (nothing is valid), `not: {type: ...}` (the other types)
  (`plain_not`);
- `propertyNames` as `patternProperties` / `additionalProperties` (`property_names`);
- `unevaluatedProperties` as `additionalProperties` over the keys the node, its `allOf` parts and
  `$ref` targets declare, pushed into `anyOf` / `oneOf` branches (`unevaluated_properties`);
- counts written as integral floats (`minItems: 2.0`) as integers (`integral_counts`)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote, unquote, urldefrag, urljoin

# keywords of JSON Schema (validation, applicators, core); a subschema with none of them is `{}`
KNOWN = frozenset(
    "type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength "
    "pattern maxItems minItems uniqueItems maxContains minContains maxProperties minProperties required "
    "dependentRequired dependencies format items additionalItems prefixItems contains properties "
    "patternProperties additionalProperties propertyNames unevaluatedProperties unevaluatedItems allOf "
    "anyOf oneOf not if then else dependentSchemas $ref $recursiveRef $dynamicRef contentEncoding "
    "contentMediaType contentSchema".split()
)
_TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
# where subschemas sit (a key inside `properties` is a name, not a keyword)
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_ONE += ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_URI_SAFE = "#/:@!$&'()*+,;=-._~%?"  # what a URI's fragment holds as it is


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The target of a local `$ref` ("#" or a "#/..." JSON pointer), or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def validator_class(schema: Any):
    """The `jsonschema` validator class for a schema's `$schema` (the latest draft where it names
    none the package knows): the draft the output is checked under, so the grammar reads it too."""
    import warnings

    from jsonschema import validators

    with warnings.catch_warnings():  # (an unknown `$schema`: the latest draft, with a warning)
        warnings.simplefilter("ignore")
        return validators.validator_for(schema if isinstance(schema, dict) else {})


def legacy_ref(root: Any) -> bool:
    """Whether the schema is of draft 7 or before, where `$ref` ignores the keywords beside it."""
    return validator_class(root).__name__ in (
        "Draft3Validator",
        "Draft4Validator",
        "Draft6Validator",
        "Draft7Validator",
    )


def known_drafts(root: Any) -> Any:
    """Every `$schema` as the metaschema id of the draft the validator reads it as: llguidance
    fetches (and so refuses) any other spelling, `https://json-schema.org/draft-07/schema` or a
    vendor's own metaschema among them."""

    def fix(node: dict, at: str) -> dict:
        if not isinstance(node.get("$schema"), str):
            return node
        meta = validator_class({"$schema": node["$schema"]}).META_SCHEMA
        return {**node, "$schema": meta.get("$id", meta.get("id"))}

    return _rewrite(root, fix)


def escape(key: str) -> str:
    """A key as a JSON pointer token."""
    return key.replace("~", "~0").replace("/", "~1")


def _children(node: dict, at: str):
    """(keyword, name / index / None, child schema, its pointer) of a schema node's subschemas."""
    for k, v in node.items():
        key = f"{at}/{escape(k)}"
        if k in SUBSCHEMA_MAPS and isinstance(v, dict):
            yield from ((k, name, x, f"{key}/{escape(name)}") for name, x in v.items())
        elif isinstance(v, list) and (k in _LISTS or k == "items"):
            yield from ((k, i, x, f"{key}/{i}") for i, x in enumerate(v))
        elif k in _ONE:
            yield k, None, v, key


def walk_schema(node: Any, at: str = "#"):
    """Every schema node (a dict) of a schema, parents first (data under `enum`, `const`, ... not)."""
    if isinstance(node, dict):
        yield node
        for _, _, child, child_at in _children(node, at):
            yield from walk_schema(child, child_at)


def _rewrite(node: Any, fn, at: str = "#") -> Any:
    """A copy of the schema with `fn(node, pointer)` applied to every schema node, parents first."""
    if not isinstance(node, dict):
        return node
    node = fn(node, at)
    if not isinstance(node, dict):
        return node
    out = {k: dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for k, v in node.items()}
    for k, where, child, child_at in _children(node, at):
        if where is None:
            out[k] = _rewrite(child, fn, child_at)
        else:
            out[k][where] = _rewrite(child, fn, child_at)
    return out


def static_refs(root: Any) -> Any:
    """References resolved within the document, as JSON pointers: `$ref` to a plain-name anchor or to
    a nested `$id`; `$recursiveRef: "#"` to its resource's root (the document's, where both say
    `$recursiveAnchor: true`: the outermost of the dynamic scope); `$dynamicRef: "#name"` to the
    `$dynamicAnchor` of that name (the document root's resource first: the outermost one); then the
    anchors and nested `$id`s go, so that every pointer is the document's. Exact for a schema that
    is one document; a reference it cannot place stays as written."""
    if not isinstance(root, dict):
        return root
    ids: dict[str, str] = {}  # absolute $id -> pointer
    anchors: dict[tuple[str, str], str] = {}  # (resource, name) -> pointer
    dynamic: dict[str, list[tuple[str, str]]] = {}  # name -> [(resource, pointer)]
    resource_of: dict[str, tuple[str, str]] = {}  # pointer -> (resource base, resource pointer)

    def walk(node: Any, at: str, base: str, res_at: str) -> None:
        if not isinstance(node, dict):
            return
        if isinstance(node.get("$id"), str):
            url, frag = urldefrag(urljoin(base, node["$id"]))
            if url != base or at == "#":
                base, res_at = url, at
                ids[base] = at
            elif frag and not frag.startswith("/"):  # draft 6 / 7's `"$id": "#name"`: an anchor
                anchors[(base, frag)] = at
            # (`"$id": "#/properties/x"`, as localazy's: names a place in this resource, not a new one)
        resource_of[at] = (base, res_at)
        if isinstance(node.get("$anchor"), str):
            anchors[(base, node["$anchor"])] = at
        if isinstance(node.get("$dynamicAnchor"), str):
            anchors.setdefault((base, node["$dynamicAnchor"]), at)
            dynamic.setdefault(node["$dynamicAnchor"], []).append((base, at))
        for _, _, child, child_at in _children(node, at):
            walk(child, child_at, base, res_at)

    walk(root, "#", "", "#")
    root_base = resource_of["#"][0]

    def target(ref: str, base: str) -> str | None:
        url, frag = urldefrag(urljoin(base, ref))
        if url != base and url not in ids:
            return None
        res_at = ids.get(url, "#") if url != base else None
        if res_at is None:  # this resource
            res_at = next((p for p, (b, r) in resource_of.items() if b == base and r == p), "#")
        if not frag:
            return res_at
        if frag.startswith("/"):
            return (res_at if res_at != "#" else "#") + frag
        return anchors.get((url, frag))

    def fix(node: dict, at: str) -> dict:
        base, res_at = resource_of.get(at, (root_base, "#"))
        # anchors and nested ids only name what the pointers written below point at (llguidance
        # refuses the anchor keywords, and would read a pointer below a nested $id as into it)
        names = ("$anchor", "$dynamicAnchor", "$recursiveAnchor", *(("$id",) if at != "#" else ()))
        out = {k: v for k, v in node.items() if k not in names}
        if isinstance(node.get("$recursiveRef"), str) and node["$recursiveRef"] == "#":
            enclosing = resolve_local_ref(root, res_at)
            outer = isinstance(enclosing, dict) and enclosing.get("$recursiveAnchor") is True
            to = "#" if outer and root.get("$recursiveAnchor") is True else res_at
            out = {k: v for k, v in out.items() if k != "$recursiveRef"} | {"$ref": to}
        elif isinstance(node.get("$dynamicRef"), str):
            ref = node["$dynamicRef"]
            name = urldefrag(urljoin(base, ref))[1]
            found = dynamic.get(name, [])
            outer = [p for b, p in found if b == root_base] or ([p for _, p in found] if len(found) == 1 else [])
            to = outer[0] if outer else target(ref, base)
            if to is not None:
                out = {k: v for k, v in out.items() if k != "$dynamicRef"} | {"$ref": to}
        elif isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            if ref.startswith("#/") or ref == "#":  # a pointer into this resource
                to = ref if res_at == "#" else res_at + ref[1:]
            else:
                to = target(ref, base)
            if to is not None:
                to = quote(to, safe=_URI_SAFE)  # (`#/$defs/Parameter Node`: llguidance wants a URI)
            if to is not None and to != ref:
                out["$ref"] = to
        return out

    return _rewrite(root, fix)


_NOTES = ("title", "description", "$comment", "default", "examples", "$anchor", "$dynamicAnchor", "deprecated")


def ref_siblings(root: Any) -> Any:
    """Every `{"$ref": R, k: ...}` as `{"allOf": [{"$ref": R}], k: ...}` (annotations aside); in a
    schema of draft 7 or before, whose `$ref` ignores the keywords beside it (and so does the
    validator that checks the output), as `{"$ref": R}` (its definitions kept)."""
    if legacy_ref(root):
        return _rewrite(root, _ref_alone)
    return _rewrite(root, _ref_sibling)


def _ref_alone(node: dict, at: str) -> dict:
    if not isinstance(node.get("$ref"), str):
        return node
    return {
        k: v for k, v in node.items() if k in ("$ref", "$defs", "definitions") or k.startswith("$") and k not in KNOWN
    }


def _ref_sibling(node: dict, at: str) -> dict:
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return node
    kept = {k: v for k, v in node.items() if k in KNOWN or k in SUBSCHEMA_MAPS or k.startswith("$")}
    if set(kept) & KNOWN == {"$ref"}:
        # annotations aside (`description`, `markdownDescription`, ...), which llguidance counts as
        # siblings too and refuses beside a circular reference
        return kept
    if ref == "#" or at == ref or at.startswith(ref + "/"):
        return node  # a reference to a schema holding it: llguidance refuses that beside other keywords
    out = {k: v for k, v in node.items() if k != "$ref"}
    out["allOf"] = [{"$ref": node["$ref"]}, *(node["allOf"] if isinstance(node.get("allOf"), list) else ())]
    return out


def _presence(cond: Any) -> str | None:
    """The key `cond` only asks to be there (`required: [k]`, beside properties that allow anything)."""
    if not isinstance(cond, dict) or set(cond) & KNOWN - {"properties"} != {"required"}:
        return None
    required, props = cond["required"], cond.get("properties", {})
    if not (isinstance(required, list) and len(required) == 1 and isinstance(required[0], str)):
        return None
    if not isinstance(props, dict) or any(v is not True and v != {} for v in props.values()):
        return None
    return required[0]


def _key_cases(cond: Any) -> tuple[str, bool] | None:
    """For an `if` on one key's presence (`required: [k]` or `not: {required: [k]}`): the key, and
    whether the `if` holds when the key is there; else None."""
    if isinstance(cond, dict) and set(cond) & KNOWN == {"not"} and (key := _presence(cond["not"])) is not None:
        return key, False
    if (key := _presence(cond)) is not None:
        return key, True
    return None


def _merged(a: Any, b: Any) -> Any:
    """A schema both `a` and `b` hold for: one object where their keywords do not overlap (but for
    `properties`, merged by name), else their `allOf` (llguidance's intersection of nested
    `allOf` / `anyOf` can lose documents: one object where it can)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if not (isinstance(a, dict) and isinstance(b, dict)) or (set(a) & set(b)) - {"properties"}:
        return {"allOf": [a, b]}
    out = {**a, **b}
    if "properties" in a and "properties" in b:
        pa, pb = a["properties"], b["properties"]
        out["properties"] = {**pa, **pb, **{k: {"allOf": [pa[k], pb[k]]} for k in pa.keys() & pb.keys()}}
    return out


def plain_conditional(node: dict, presence: bool = True) -> dict:
    """An `if` left after `conditional_branches`: `if: true` (or one with no keyword) is its `then`,
    `if: false` its `else`; one on a key's presence as the `anyOf` of its two cases (exact), or
    without `presence` as the case where the key is left out (a subset); one on values (not on
    which keys an object has) holds together with its `then` (the documents where it holds: a
    subset)."""
    if "if" not in node:
        return node
    cond = node["if"]
    out = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
    then, else_ = node.get("then", True), node.get("else", True)
    if cond is False:
        taken = [else_]
    elif cond is True or (isinstance(cond, dict) and not (set(cond) & KNOWN)):
        taken = [then]
    elif (case := _key_cases(cond)) is not None:
        key, holds_if_there = case
        there = _merged({"required": [key]}, then if holds_if_there else else_)
        absent = _merged({"properties": {key: False}}, else_ if holds_if_there else then)
        required = node.get("required") if isinstance(node.get("required"), list) else ()
        if presence:
            taken = [{"anyOf": [there, absent]}]
        else:
            # the exact anyOf doubled a large object past what llguidance holds: the case where the
            # key is left out (where it is there, if the node requires it): a subset, sound
            taken = [there if key in required else absent]
    elif isinstance(cond, dict) and (_declares_keys(cond) or "required" in cond or "not" in cond):
        # on which keys an object has: left to lenient mode and the output check (the then-case
        # alone would force keys; llguidance's anyOf of the two cases lost documents)
        return node
    else:
        taken = [_merged(cond, then)]
    taken = [t for t in taken if t is not True and t != {}]
    if len(taken) == 1 and isinstance(taken[0], dict) and not (set(out) - {"$schema", *_NOTES}):
        return {**out, **taken[0]}  # (not an allOf of one: see `_merged`)
    if taken:
        out["allOf"] = [*(node["allOf"] if isinstance(node.get("allOf"), list) else ()), *taken]
    return out


_COUNTS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


def lenient_conditionals(root: Any) -> Any:
    """For llguidance's lenient mode, which drops an `if` it cannot enforce: each such `if` whose
    `then` and `else` only set `properties` as those properties holding under one branch or the
    other (a superset, where dropping would leave them unconstrained; the output check validates).
    And `minProperties` / `maxProperties` it cannot enforce dropped (a superset): lenient, it counts
    only the keys beyond `properties` (`{"a": 1}` refused under `minProperties: 1`)."""
    return _rewrite(root, lambda node, at: _countable(_branch_union(node)))


def _countable(node: dict) -> dict:
    """`node` without the key counts llguidance implements only for objects of required or closed
    keys: other keys allowed and an optional one listed."""
    if "minProperties" not in node and "maxProperties" not in node:
        return node
    props, required = node.get("properties"), node.get("required")
    optional = isinstance(props, dict) and set(props) - set(required if isinstance(required, list) else ())
    if not optional or node.get("additionalProperties", True) is False:
        return node
    return {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}


def _branch_union(node: dict) -> dict:
    then, else_ = node.get("then"), node.get("else")
    if "if" not in node or not all(isinstance(b, dict) and set(b) & KNOWN == {"properties"} for b in (then, else_)):
        return node
    props = dict(node["properties"]) if isinstance(node.get("properties"), dict) else {}
    for k in then["properties"].keys() & else_["properties"].keys():
        either = {"anyOf": [then["properties"][k], else_["properties"][k]]}
        own = props.get(k, {})
        props[k] = either if isinstance(own, dict) and not set(own) & KNOWN else {"allOf": [own, either]}
    return {**{k: v for k, v in node.items() if k not in ("if", "then", "else")}, "properties": props}


# keywords that constrain one type of instance only (every other instance meets them)
_TYPED = {
    "array": frozenset(
        "items prefixItems additionalItems contains minContains maxContains minItems maxItems uniqueItems "
        "unevaluatedItems".split()
    ),
    "object": frozenset(
        "properties required additionalProperties patternProperties propertyNames minProperties maxProperties "
        "dependentRequired dependentSchemas dependencies unevaluatedProperties".split()
    ),
    "string": frozenset("minLength maxLength pattern".split()),
    "number": frozenset("minimum maximum exclusiveMinimum exclusiveMaximum multipleOf".split()),
}


def one_of_type(node: dict) -> dict:
    """A `oneOf` whose branches (two or more) only hold keywords of one type T: an instance of any
    other type meets every branch, so the `oneOf` fails for it: the node's `type` as T (exact).
    Test-suite schemas leave out `type`, and a model then wrote an object for an array's `oneOf`."""
    branches = node.get("oneOf")
    if not (isinstance(branches, list) and len(branches) >= 2 and all(isinstance(b, dict) for b in branches)):
        return node
    kinds = {next((t for t, keys in _TYPED.items() if set(b) & KNOWN <= keys), None) for b in branches}
    if len(kinds) != 1 or None in kinds or any(not set(b) & KNOWN for b in branches):
        return node
    (kind,) = kinds
    have = node.get("type", list(_TYPES))
    have = [have] if isinstance(have, str) else have
    if kind not in have and not (kind == "number" and "integer" in have):
        return node  # (nothing is valid: left for the backend to say)
    keep = [t for t in have if t == kind or (kind == "number" and t == "integer")]
    return {**node, "type": keep[0] if len(keep) == 1 else keep}


def integral_counts(node: dict) -> dict:
    """Counts written as integral floats (`"minItems": 2.0`, valid JSON Schema) as integers, which
    llguidance requires."""
    if not any(isinstance(node.get(k), float) for k in _COUNTS):
        return node
    return {k: int(v) if k in _COUNTS and isinstance(v, float) and v.is_integer() else v for k, v in node.items()}


def plain_not(node: dict) -> dict | bool:
    """`not` over a schema with no keyword of JSON Schema (every instance is valid against it: none
    is valid here) as `false`; `not: {"type": T, ...}` as the other types (exact for a bare `type`
    but for `number` left out where `T` is `integer`; with more keywords, a subset); `not:
    {"pattern": P}` as nothing where no string is allowed, else as strings without a character every
    match of `P` has (a subset)."""
    sub = node.get("not")
    if sub is True or (isinstance(sub, dict) and not (set(sub) & KNOWN)):
        return False
    if isinstance(sub, dict) and "type" in sub:  # (with more keywords: the other types are a subset)
        banned = {sub["type"]} if isinstance(sub["type"], str) else set(sub["type"])
        if "number" in banned or "integer" in banned:
            banned |= {"number", "integer"}
        have = node.get("type", list(_TYPES))
        have = [have] if isinstance(have, str) else list(have)
        if "number" in have and "integer" not in have:
            have = [*have, "integer"]
        left = [t for t in have if t not in banned]
        if not left:
            return False
        out = {k: v for k, v in node.items() if k != "not"}
        out["type"] = left[0] if len(left) == 1 else left
        return out
    if isinstance(sub, dict) and set(sub) & KNOWN == {"pattern"} and "pattern" not in node:
        types = node.get("type", "string")
        if "string" not in ([types] if isinstance(types, str) else types):
            return {k: v for k, v in node.items() if k != "not"}  # (a pattern holds only for strings)
        if (avoiding := _avoiding(sub["pattern"])) is not None:
            return {**{k: v for k, v in node.items() if k != "not"}, "pattern": avoiding}
    return node


# characters that stand for themselves in a pattern and in a character class
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789<>@#%&=:,;'\"!~`/_ ")


def _avoiding(pattern: str) -> str | None:
    """A pattern of strings that `pattern` cannot match: those without a character every match of it
    holds (its first, where that is a plain literal and there is no alternation), or None."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if "|" in pattern or not body or body[0] not in _PLAIN or body[1:2] in ("?", "*", "{"):
        return None
    return f"^[^{body[0]}]*$"


def _name_pattern(sub: Any) -> str | None:
    """A regex every allowed property name matches (and no other), for `propertyNames: sub`; None
    where it is not one of: `pattern`, `minLength` / `maxLength`, `enum` / `const`."""
    if not isinstance(sub, dict):
        return None
    keys = set(sub) & KNOWN
    if keys - {"type"} == {"pattern"} and sub.get("type", "string") == "string" and isinstance(sub["pattern"], str):
        p = sub["pattern"]
        return p if p.startswith("^") and p.endswith("$") else f"^.*(?:{p}).*$" if p else None
    if keys and keys <= {"minLength", "maxLength", "type"} and sub.get("type", "string") == "string":
        lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
        return f"^.{{{lo},{'' if hi is None else int(hi)}}}$"
    return None


_LITERAL_NAMES = re.compile(r"\^\((?:\?:)?([\w-]+(?:\|[\w-]+)*)\)\$|\^([\w-]+)\$")


def _banned_names(sub: Any) -> list[str] | None:
    """The names `sub` rules out by a `not` over an anchored list of literal names."""
    neg = sub.get("not") if isinstance(sub, dict) else None
    if not (isinstance(neg, dict) and set(neg) & KNOWN == {"pattern"} and isinstance(neg["pattern"], str)):
        return None
    if (m := _LITERAL_NAMES.fullmatch(neg["pattern"])) is None:
        return None
    return (m.group(1) or m.group(2)).split("|")


def property_names(node: dict) -> dict | bool:
    """`propertyNames` as what llguidance implements: `false` as no key at all; names from an
    `enum` / `const` as those properties only; a pattern (or length bounds) as `patternProperties`
    of it (with the node's `additionalProperties`) and other keys forbidden, the declared properties
    that do not match it forbidden too; names a `not` lists literally as properties that cannot be
    there. Left as written where the node has `patternProperties`."""
    if "propertyNames" not in node:
        return node
    sub = node["propertyNames"]
    out = {k: v for k, v in node.items() if k != "propertyNames"}
    if sub is True or sub == {}:
        return out
    if "patternProperties" in node:
        return node
    props = dict(node["properties"]) if isinstance(node.get("properties"), dict) else {}
    if (banned := _banned_names(sub)) is not None:
        # `not: {pattern: "^(a|b)$"}`: those names as properties that cannot be there
        sub = {k: v for k, v in sub.items() if k != "not"}
        props.update(dict.fromkeys(banned, False))
        out["properties"] = props
        if not set(sub) & KNOWN - {"type"}:
            return out
    if sub is False:
        names: list | None = []
    elif isinstance(sub, dict) and set(sub) & KNOWN <= {"enum", "const", "type"} and ("enum" in sub or "const" in sub):
        names = [sub["const"]] if "const" in sub else sub["enum"]
        names = [n for n in names if isinstance(n, str)]
    else:
        names = None
    if names is not None:
        # a name the properties do not declare has the schema other keys have (ansible-lint's
        # `rules`: propertyNames an enum, each value `additionalProperties: {$ref: rule}`)
        other = node.get("additionalProperties", {})
        out["properties"] = {n: props[n] if n in props else other for n in names}
        out["additionalProperties"] = False
        return out
    pattern = _name_pattern(sub)
    if pattern is None:
        return node
    try:
        matches = re.compile(pattern).search
    except re.error:
        return node
    out["properties"] = {k: (v if matches(k) else False) for k, v in props.items()}
    # other keys: those of the pattern as `additionalProperties` had them (a declared key that also
    # matches gets both: a subset), the rest none
    out["patternProperties"] = {pattern: node.get("additionalProperties", {})}
    out["additionalProperties"] = False
    return out


_BRANCHING = ("anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "not")


def _declares_keys(node: Any) -> bool:
    """Whether a subschema (anywhere inside) says anything about an object's keys."""
    if isinstance(node, list):
        return any(_declares_keys(x) for x in node)
    if not isinstance(node, dict):
        return False
    if any(k in node for k in ("properties", "patternProperties", "additionalProperties", "$ref")):
        return True
    return any(_declares_keys(v) for k, v in node.items() if k in KNOWN and k not in ("enum", "const"))


def _evaluated(node: Any, root: Any, depth: int = 0) -> tuple[set, set, bool] | None:
    """(property names, patterns, whether every key) that an instance's validation against `node`
    evaluates whatever the instance: its own `properties` / `patternProperties`, its `allOf` parts'
    and `$ref` targets'; every key where one has `additionalProperties` / `unevaluatedProperties`.
    None where that depends on which branch or condition holds."""
    if node is True or node is False or node == {}:
        return set(), set(), False
    if not isinstance(node, dict) or depth > 32:
        return None
    if "additionalProperties" in node or "unevaluatedProperties" in node:
        return set(), set(), True
    if any(_declares_keys(node[k]) for k in _BRANCHING if k in node):
        return None
    names = set(node["properties"]) if isinstance(node.get("properties"), dict) else set()
    patterns = set(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else set()
    every = False
    parts = list(node["allOf"]) if isinstance(node.get("allOf"), list) else []
    if isinstance(node.get("$ref"), str):
        parts.append(resolve_local_ref(root, node["$ref"]))
    for part in parts:
        got = _evaluated(part, root, depth + 1)
        if got is None:
            return None
        names |= got[0]
        patterns |= got[1]
        every = every or got[2]
    return names, patterns, every


def unevaluated_properties(node: dict, root: Any) -> dict:
    """`unevaluatedProperties: U` as `additionalProperties: U` beside `properties` (and
    `patternProperties`) naming every key the node's parts evaluate (`_evaluated`): exact. With
    `anyOf` / `oneOf` branches, each branch gets its own such closing over its keys and the node's
    (a document then needs one branch that covers its keys: exact for `oneOf`, a subset for `anyOf`).
    Left as written where what is evaluated depends on a condition."""
    if "unevaluatedProperties" not in node:
        return node
    closing = node["unevaluatedProperties"]
    out = {k: v for k, v in node.items() if k != "unevaluatedProperties"}
    if closing is True or closing == {} or "additionalProperties" in node:
        return out  # nothing left unevaluated
    branchy = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    if len(branchy) > 1:
        return node
    base = _evaluated({k: v for k, v in out.items() if k not in branchy}, root)
    if base is None:
        return node
    names, patterns, every = base
    if every:
        return out

    def closed(more_names: set, more_patterns: set) -> dict:
        return {
            "properties": {n: {} for n in sorted(names | more_names)},
            "patternProperties": {p: {} for p in sorted(patterns | more_patterns)},
            "additionalProperties": closing,
        }

    if not branchy:
        shut = closed(set(), set())
        out["properties"] = {**shut["properties"], **(node.get("properties") or {})}
        if shut["patternProperties"]:
            out["patternProperties"] = {**shut["patternProperties"], **(node.get("patternProperties") or {})}
        out["additionalProperties"] = closing
        return out
    branches = []
    for b in node[branchy[0]]:
        got = _evaluated(b, root)
        if got is None:
            return node
        branches.append(b if got[2] else {"allOf": [b, closed(got[0], got[1])]})
    out[branchy[0]] = branches
    return out
