"""Rewrites of a JSON schema into one that llguidance enforces exactly, or a stricter one (a subset of
the valid documents, never a superset): `oneOf` over `required` lists, `if`/`then`/`else` keyed on
property values, `not` / `dependencies` that keep keys out, and strict mode's closed objects."""

from __future__ import annotations

import json
from typing import Any

from .schema_keywords import (
    KNOWN,
    SUBSCHEMA_MAPS,
    escape,
    integral_counts,
    known_drafts,
    one_of_type,
    plain_conditional,
    plain_not,
    property_names,
    ref_siblings,
    resolve_local_ref,
    static_refs,
    unevaluated_properties,
)

# keywords whose values are schemas (a dict), lists of schemas, or maps of name -> schema;
# everything else (enum, const, default, examples, ...) is data and is left alone
_SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


_ANNOTATIONS = ("title", "description", "$comment")


def _only_required(branch: Any, root: Any) -> Any:
    """A branch as its `required` part where the rest says nothing: a `$ref` followed, `properties`
    that allow anything (`{"x": true}`) left out."""
    if isinstance(branch, dict) and set(branch) == {"$ref"} and isinstance(branch["$ref"], str) and root is not None:
        branch = resolve_local_ref(root, branch["$ref"])
    if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
        return branch
    if any(v is not True and v != {} for v in branch["properties"].values()):
        return branch
    return {k: v for k, v in branch.items() if k != "properties"}


def exclusive_required(branches: list, root: Any = None) -> list | None:
    """`oneOf` branches that differ only by `required` keys ("give either these or those", common in
    real schemas) as `anyOf` branches that cannot both hold: each an object (a non-object meets every
    `required` at once) that leaves out the keys the others require beyond its own. Exact where each
    branch requires one key; otherwise a subset of the valid documents, never an invalid one. A
    branch whose keys include another's can never be the only one to hold and is dropped. None if
    the branches are not of this form."""
    keys = []
    for b in (_only_required(b, root) for b in branches):
        if not (
            isinstance(b, dict)
            and isinstance(b.get("required"), list)
            and all(k in ("required", *_ANNOTATIONS) for k in b)
            and all(isinstance(k, str) for k in b["required"])
        ):
            return None
        keys.append(set(b["required"]))
    out = []
    for i, mine in enumerate(keys):
        others = [theirs for j, theirs in enumerate(keys) if j != i]
        if any(theirs <= mine for theirs in others):
            continue
        banned = sorted(set().union(*(theirs - mine for theirs in others)))
        out.append({"type": "object", "required": sorted(mine), "properties": {k: False for k in banned}})
    return out or None


def _condition(node: Any) -> dict[str, list] | None:
    """An `if` that only pins properties to `const` / `enum` values, as {key: allowed values}
    (None for any other `if`)."""
    if not isinstance(node, dict) or any(k not in ("properties", "required", "$schema", *_ANNOTATIONS) for k in node):
        return None
    props = node.get("properties")
    if not isinstance(props, dict) or not props:
        return None
    cond = {}
    for key, sub in props.items():
        if not isinstance(sub, dict) or any(k not in ("const", "enum", "type", *_ANNOTATIONS) for k in sub):
            return None
        if "const" in sub:
            cond[key] = [sub["const"]]
        elif isinstance(sub.get("enum"), list) and sub["enum"]:
            cond[key] = list(sub["enum"])
        else:
            return None
    required = node.get("required", [])
    if not isinstance(required, list) or any(k not in cond for k in required):
        return None
    return cond


def _disjoint(a: dict[str, list], b: dict[str, list]) -> bool:
    """Whether no document meets both conditions: some key is pinned to values that never meet."""
    return any(
        not ({json.dumps(v, sort_keys=True) for v in a[k]} & {json.dumps(v, sort_keys=True) for v in b[k]})
        for k in a.keys() & b.keys()
    )


def _only(node: Any, keys: tuple[str, ...]) -> bool:
    return isinstance(node, dict) and all(k in keys or k in _ANNOTATIONS or k == "$schema" for k in node)


def _cases(node: dict) -> tuple[list[tuple[dict, Any, str]], tuple[Any, str], list[tuple[Any, str]]] | None:
    """The node's conditionals as (cases [(condition, then, then's pointer below the node)], (what
    holds when none applies, its pointer), the `allOf` items left with theirs): an `if`/`then`/`else`
    chain on the node, or `allOf` items that are each a bare `if`/`then`. None if the node has
    neither or a condition is not of `_condition`'s form."""
    cases: list[tuple[dict, Any, str]] = []
    items = node.get("allOf", []) if isinstance(node.get("allOf"), list) else []
    rest = [(item, f"/allOf/{i}") for i, item in enumerate(items)]
    otherwise: tuple[Any, str] = ({}, "")
    if "if" in node:
        link, at = node, ""
        while True:
            cond = _condition(link["if"])
            if cond is None:
                return None
            cases.append((cond, link.get("then", {}), f"{at}/then"))
            otherwise = (link.get("else", {}), f"{at}/else")
            if not (_only(otherwise[0], ("if", "then", "else")) and "if" in otherwise[0]):
                break
            link, at = otherwise[0], otherwise[1]
    else:
        kept = []
        for item, at in rest:
            if _only(item, ("if", "then")) and "if" in item:
                cond = _condition(item["if"])
                if cond is None:
                    return None
                cases.append((cond, item.get("then", {}), f"{at}/then"))
            else:
                kept.append((item, at))
        rest = kept
    return (cases, otherwise, rest) if cases else None


def _moved_refs(node: Any, moves: list[tuple[str, str]]) -> Any:
    """A copy of `node` whose `$ref`s into a moved subtree (old pointer, new pointer) follow it."""
    if isinstance(node, list):
        return [_moved_refs(x, moves) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _moved_refs(v, moves) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for old, new in moves:
            if ref == old or ref.startswith(old + "/"):
                out["$ref"] = new + ref[len(old) :]
                break
    return out


def conditional_branches(node: dict, root: Any = None, path: str = "#") -> dict | None:
    """A node whose `if`/`then`/`else` (or `allOf` of `if`/`then`) conditions pin properties to values
    ("if kind is cypress then ...", common in real schemas), with the conditionals as one `anyOf`:
    a branch per case, requiring its pinned keys at their values together with its `then`, and a
    branch for "no case applies" where a key every case pins has values (from the node's own
    `enum` / `const` for it) that no case takes. Cases must pin some shared key to values that never
    meet, so that exactly one applies. A document where a pinned key is absent (the `if` then holds
    vacuously) or where no case applies otherwise is left out: a subset of the valid documents.
    None if the node is not of this form. The result keeps its objects open (an `allOf`), since
    the branches declare keys the node does not; a `then` that is only a local `$ref` is copied in
    (its target may be closed by strict mode), and `$ref`s into the moved parts (`root`'s, the node
    at pointer `path`) follow them."""
    found = _cases(node)
    if found is None:
        return None
    cases, (otherwise, otherwise_at), rest = found
    conds = [c for c, _, _ in cases]
    if any(not _disjoint(a, b) for i, a in enumerate(conds) for b in conds[i + 1 :]):
        return None
    root = node if root is None else root
    anyof_at = f"{path}/allOf/{len(rest)}/anyOf"
    moves = [(f"{path}{at}", f"{path}/allOf/{i}") for i, (_, at) in enumerate(rest)]

    def pinned(cond: dict[str, list]) -> dict:
        return {"type": "object", "required": sorted(cond), "properties": {k: {"enum": v} for k, v in cond.items()}}

    def branch(cond: dict[str, list], then: Any, at: str) -> dict:
        if then in ({}, True):
            return pinned(cond)
        if (
            _only(then, ("$ref",))
            and isinstance(then.get("$ref"), str)
            and isinstance(target := resolve_local_ref(root, then["$ref"]), dict)
        ):
            then = target
        else:
            moves.append((f"{path}{at}", f"{anyof_at}/{len(branches)}/allOf/1"))
        return {"allOf": [pinned(cond), then]}

    branches: list[dict] = []
    for cond, then, at in cases:
        branches.append(branch(cond, then, at))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for key in set.intersection(*(set(c) for c in conds)):
        sub = props.get(key)
        values = (
            [sub["const"]]
            if isinstance(sub, dict) and "const" in sub
            else sub.get("enum")
            if isinstance(sub, dict) and isinstance(sub.get("enum"), list)
            else None
        )
        taken = {json.dumps(v, sort_keys=True) for c in conds for v in c[key]}
        left = [v for v in values or () if json.dumps(v, sort_keys=True) not in taken]
        if left:
            branches.append(branch({key: left}, otherwise, otherwise_at))
            break
    out = {k: v for k, v in node.items() if k not in ("if", "then", "else", "allOf")}
    out["allOf"] = [*(item for item, _ in rest), {"anyOf": branches}]
    moves.sort(key=lambda m: -len(m[0]))  # the deepest first: a then inside a moved else
    return _moved_refs(out, moves)


def _is_empty_schema(node: Any) -> bool:
    return node is True or (isinstance(node, dict) and all(k in _ANNOTATIONS for k in node))


def _into_branches(node: dict, key: str, dep: Any) -> bool:
    """A dependency of `key` moved into the node's `oneOf` / `anyOf` branches: applied in those that
    require `key`, `key` forbidden in the others. False (node unchanged) if no branch requires it."""
    for keyword in ("oneOf", "anyOf"):
        branches = node.get(keyword)
        if isinstance(branches, list) and any(
            isinstance(b, dict) and key in (b.get("required") or ()) for b in branches
        ):
            node[keyword] = [
                {"allOf": [b, dep]}
                if isinstance(b, dict) and key in (b.get("required") or ())
                else {"allOf": [b, {"properties": {key: False}}]}
                for b in branches
            ]
            return True
    return False


def absent_keys(node: dict) -> dict | bool:
    """Keywords llguidance does not implement that say "this key must be absent", as what it does
    implement: `not: {}` (nothing validates) as `false`; `not: {"required": [k, ...]}` (or an `allOf`
    of such) as `k` forbidden (exact for one key, else the first key the node does not require); `dependencies` /
    `dependentRequired` / `dependentSchemas` on key k as k forbidden, or, where k is required, its
    dependency applied. Subsets of the valid documents, never a superset."""
    if "not" in node and _is_empty_schema(node["not"]) and all(k in ("not", *_ANNOTATIONS) for k in node):
        return False
    out = dict(node)
    forbidden: list[str] = []
    extra_schemas: list[Any] = []
    required = set(out.get("required", ())) if isinstance(out.get("required"), list) else set()
    if together := _required_together(out.get("not")):
        del out["not"]
        forbidden.append(next((k for k in together if k not in required), together[0]))
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = out.get(keyword)
        if not isinstance(deps, dict):
            continue
        del out[keyword]
        for key, dep in deps.items():
            dep_schema = {"required": dep} if isinstance(dep, list) else dep
            if key in required:
                extra_schemas.append(dep_schema)
            elif not _into_branches(out, key, dep_schema):
                forbidden.append(key)
    if forbidden:
        props = dict(out["properties"]) if isinstance(out.get("properties"), dict) else {}
        props.update(dict.fromkeys(forbidden, False))
        out["properties"] = props
    if extra_schemas:
        out["allOf"] = [*out.get("allOf", []), *extra_schemas]
    return out


def _required_together(sub: Any) -> list[str]:
    """The keys `sub` asks to be there all together (`required: [a, b]`, or `allOf` of such), if
    that is all it asks; else []."""
    if not isinstance(sub, dict):
        return []
    keys = set(sub) & KNOWN
    if keys == {"required"} and isinstance(sub["required"], list) and all(isinstance(k, str) for k in sub["required"]):
        return list(sub["required"])
    if keys == {"allOf"} and isinstance(sub["allOf"], list):
        parts = [_required_together(p) for p in sub["allOf"]]
        return [k for p in parts for k in p] if parts and all(parts) else []
    return []


# applicators whose subschemas constrain the same instance as the schema holding them: an object they
# describe is a part of one, so strict mode leaves it open (see `strict_schema`)
_SAME_INSTANCE = ("allOf", "if", "then", "else", "not", "dependentSchemas")


def _partial_branches(node: dict) -> bool:
    """Whether the node's anyOf / oneOf branches add to keys it declares itself (then each branch
    is a part of the object, not all of it)."""
    return any(k in node for k in ("properties", "patternProperties", "allOf", "$ref", "additionalProperties"))


def _open_refs(root: Any) -> set[str]:
    """The local `$ref`s (as written) that some schema reaches in a same-instance position (inside an
    allOf branch, a conditional, or the branches of an object that declares keys itself), followed
    through the definitions they name: strict mode leaves their targets open."""
    found: set[str] = set()
    todo: list[Any] = []

    def walk(node: Any, open_: bool) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x, open_)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if open_ and isinstance(ref, str) and ref.startswith("#") and ref not in found:
            found.add(ref)
            todo.append(resolve_local_ref(root, ref))
        for k, v in node.items():
            if k in _SAME_INSTANCE:
                walk(v if k != "dependentSchemas" or not isinstance(v, dict) else list(v.values()), True)
            elif k in ("anyOf", "oneOf"):
                walk(v, open_ or _partial_branches(node))
            elif k in _SUBSCHEMA or k in _SUBSCHEMA_LISTS:
                walk(v, False)
            elif k in ("properties", "patternProperties") and isinstance(v, dict):
                walk(list(v.values()), False)
            elif k in ("$defs", "definitions") and node is root and isinstance(v, dict):
                walk(list(v.values()), False)

    walk(root, False)
    while todo:
        walk(todo.pop(), True)
    return found


def strict_schema(
    node,
    close: bool = True,
    *,
    presence_cases: bool = True,
    root: Any = None,
    path: str = "#",
    _open: set | None = None,
):
    """A copy of the schema for llguidance: `oneOf` over `required` lists made exclusive (see
    `exclusive_required`), conditionals keyed on property values as branches (see
    `conditional_branches`), the keywords of `schema_keywords` as ones llguidance implements; and
    with `close`, objects that list `properties` and say nothing of other
    keys forbid them (`additionalProperties: false`) — what xgrammar's strict mode does, so that a
    model writes the declared keys and stops instead of inventing more. An object that is only a
    part of one is left open, with all it contains: the branches of an `allOf`, the subschemas of
    `if` / `then` / `else` / `not`, the `anyOf` / `oneOf` branches of an object that declares keys
    itself, and the definitions those refer to (closing a part would forbid the keys the other
    parts declare, and a required one would make the schema unsatisfiable). `presence_cases`: an
    `if` on a key's presence as the anyOf of its two cases (exact, but it can multiply a large
    object's grammar past llguidance's limit), else as the case without the key (a subset).
    `root` and `path` (the node's JSON pointer) let a rewrite keep `$ref`s into what it moves pointing right."""
    if root is None:
        root = node = ref_siblings(static_refs(known_drafts(node)))
        _open = _open_refs(node) if close else set()
        out = strict_schema(node, close=close, root=root, path=path, presence_cases=presence_cases, _open=_open)
        return _finished(out, out)
    if isinstance(node, list):
        return [
            strict_schema(x, close=close, root=root, path=f"{path}/{i}", presence_cases=presence_cases, _open=_open)
            for i, x in enumerate(node)
        ]
    if not isinstance(node, dict):
        return node
    node = conditional_branches(node, root, path) or node
    node = integral_counts(plain_conditional(node, presence_cases))
    declared = isinstance(node.get("properties"), dict)  # (absent_keys adds forbidden ones)
    node = absent_keys(node)
    if node is not False:
        node = plain_not(node)
    if node is False:
        return False
    node = property_names(node)
    if node is False:
        return False
    node = one_of_type(unevaluated_properties(node, root))
    out = {}
    partial = _partial_branches(node)
    for k, v in node.items():
        at = f"{path}/{escape(k)}"
        # a part of this object (or of its instance) is left open, with all it contains
        sub_close = close and k not in _SAME_INSTANCE and not (k in ("anyOf", "oneOf") and partial)
        if k in _SUBSCHEMA:
            out[k] = strict_schema(v, close=sub_close, root=root, path=at, presence_cases=presence_cases, _open=_open)
        elif k == "oneOf" and "anyOf" not in node and isinstance(v, list) and (ex := exclusive_required(v, root)):
            out["anyOf"] = ex
        elif k in _SUBSCHEMA_LISTS and isinstance(v, list):
            out[k] = [
                strict_schema(
                    x, close=sub_close, root=root, path=f"{at}/{i}", presence_cases=presence_cases, _open=_open
                )
                for i, x in enumerate(v)
            ]
        elif k == "allOf" and isinstance(v, list):
            out[k] = [
                strict_schema(
                    _without_own_properties(x, path),
                    close=False,
                    root=root,
                    path=f"{at}/{i}",
                    presence_cases=presence_cases,
                    _open=_open,
                )
                for i, x in enumerate(v)
            ]
        elif k in SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {
                name: strict_schema(
                    x,
                    close=sub_close and f"{at}/{escape(name)}" not in (_open or ()),
                    root=root,
                    path=f"{at}/{escape(name)}",
                    presence_cases=presence_cases,
                    _open=_open,
                )
                for name, x in v.items()
            }
        else:
            out[k] = v
    if not close:
        return out
    props = node.get("properties")
    if (
        declared
        and isinstance(props, dict)
        and "allOf" not in node
        # a required key the properties do not declare stays writable (closing would make it unsatisfiable)
        and all(k in props for k in node.get("required", ()) if isinstance(k, str))
        and not any(k in node for k in ("additionalProperties", "unevaluatedProperties", "patternProperties"))
    ):
        out["additionalProperties"] = False
    return out


def _without_own_properties(part: Any, path: str) -> Any:
    """An `allOf` part of the object at `path` (with its `then` / `else` / `anyOf` / `oneOf` /
    `allOf`: the same instance) without the `properties` that only point back at that object's own
    (`$ref: <path>/properties/k`): a schema intersected with itself, which llguidance builds all the
    same (dependabot's `then` doubled a large object past its limit that way), and which hides a
    `oneOf` over `required` lists from `exclusive_required`."""
    if not isinstance(part, dict):
        return part
    out = dict(part)
    for k in ("then", "else"):
        if isinstance(part.get(k), dict):
            out[k] = _without_own_properties(part[k], path)
    for k in ("anyOf", "oneOf", "allOf"):
        if isinstance(part.get(k), list):
            out[k] = [_without_own_properties(b, path) for b in part[k]]
    props = part.get("properties")
    if isinstance(props, dict):
        kept = {k: v for k, v in props.items() if v != {"$ref": f"{path}/properties/{escape(k)}"}}
        if kept:
            out["properties"] = kept
        else:
            del out["properties"]
    return out


_APPLICATORS = ("allOf", "anyOf", "oneOf")


def _finished(node: Any, root: Any) -> Any:
    """The schema as llguidance takes it: `anyOf` / `oneOf` without branches that are `false` (or a
    `$ref` to one), which it refuses as unsatisfiable even beside others (none left: `false`); and
    `allOf` / `anyOf` / `oneOf` after a node's other keywords (llguidance 1.9 merges an `allOf`
    written before the node's `properties` without them: a closed object then refuses its keys)."""
    if isinstance(node, list):
        return [_finished(x, root) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k in sorted(node, key=lambda k: k in _APPLICATORS):  # (stable: the rest keep their order)
        v = node[k] if k in ("enum", "const", "default", "examples") else _finished(node[k], root)
        if k in ("anyOf", "oneOf") and isinstance(v, list):
            v = [b for b in v if not _is_false(b, root)]
            if not v:
                return False
        out[k] = v
    return out


def _is_false(node: Any, root: Any) -> bool:
    if isinstance(node, dict) and set(node) == {"$ref"} and isinstance(node["$ref"], str):
        node = resolve_local_ref(root, node["$ref"])
    return node is False
