"""Keywords llguidance drops in lenient mode, rewritten into ones it enforces (grammar/schema_keywords.py):
each schema below (shapes of JSON-Schema-Test-Suite cases and of real schemas) compiles exactly (no
approximation), its grammar takes the valid documents (keys in the order the schema declares them,
as llguidance writes them) and refuses the invalid ones, as a real JSON Schema validator judges
them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from plait.grammar import GrammarSpec, make_backend
from plait.grammar.schema_keywords import one_of_type, plain_conditional, ref_siblings, static_refs
from plait.grammar.schema_rewrite import strict_schema

BASE = {  # "extend a base type": $ref beside the node's own keywords
    "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
    "$ref": "#/$defs/base",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}
CASES = [  # (what, schema, valid documents, invalid documents)
    (
        "unevaluatedProperties over allOf",
        {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "allOf": [{"properties": {"b": {"type": "integer"}}}],
            "unevaluatedProperties": False,
        },
        [{"a": "x", "b": 1}, {}],
        [{"a": "x", "c": 1}, {"b": "x"}],
    ),
    (
        "unevaluatedProperties over oneOf branches",
        {
            "type": "object",
            "properties": {"kind": {"type": "string"}},
            "oneOf": [
                {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "string"}}, "required": ["y"]},
            ],
            "unevaluatedProperties": False,
        },
        [{"kind": "a", "x": 1}, {"y": "b"}],
        [{"x": 1, "z": 2}, {"kind": "a"}],
    ),
    ("propertyNames: pattern", {"type": "object", "propertyNames": {"pattern": "^a+$"}}, [{"aa": 1}, {}], [{"b": 1}]),
    (
        "propertyNames with additionalProperties",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
        [{"ab": 1}],
        [{"Ab": 1}, {"ab": "x"}],
    ),
    ("propertyNames: maxLength", {"type": "object", "propertyNames": {"maxLength": 3}}, [{"abc": 1}], [{"abcd": 1}]),
    ("propertyNames: false", {"type": "object", "properties": {"x": {}}, "propertyNames": False}, [{}], [{"x": 1}]),
    (
        "if on a key's presence",
        {
            "type": "object",
            "properties": {"a": {}, "b": {"type": "integer"}},
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
        },
        [{"a": 1, "b": 2}, {"b": 2}, {}],
        [{"a": 1}],
    ),
    (
        "if on a key's absence",
        {
            "type": "object",
            "properties": {"m": {}, "s": {}},
            "if": {"not": {"required": ["m"]}},
            "then": {"required": ["s"]},
        },
        [{"s": 1}, {"m": 1}],
        [{}],
    ),
    ("if: true", {"if": True, "then": {"const": "then"}, "else": {"const": "else"}}, ["then"], ["else"]),
    ("if on a value", {"if": {"const": "skip"}, "then": True, "else": {"const": 0}}, ["skip"], ["other"]),
    (
        "$dynamicRef",
        {
            "type": "array",
            "items": {"$dynamicRef": "#items"},
            "$defs": {"foo": {"$dynamicAnchor": "items", "type": "string"}},
        },
        [["a", "b"]],
        [[1]],
    ),
    (
        "$recursiveRef in a nested resource",
        {
            "$schema": "https://json-schema.org/draft/2019-09/schema",
            "$id": "http://example.com/root.json",
            "$defs": {
                "tree": {
                    "$id": "tree.json",
                    "$recursiveAnchor": True,
                    "anyOf": [{"type": "string"}, {"type": "object", "additionalProperties": {"$recursiveRef": "#"}}],
                }
            },
            "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/tree"}],
        },
        [{"a": {"b": "x"}}, 3],
        [{"a": 1.5}],
    ),
    ("not over unknown keywords", {"anyOf": [{"not": {"foo": 1}}, {"type": "string"}]}, ["x"], [1]),
    ("not: {type: object, ...}", {"not": {"type": "object", "properties": {"a": {"type": "string"}}}}, [1, "x"], [{}]),
    # (llguidance writes an object's keys in their declared order: the node's, then its parts')
    (
        "anyOf beside false branches",  # (llguidance refuses a false branch even beside others)
        {"$defs": {"no": {"not": {"foo": 1}}}, "anyOf": [{"$ref": "#/$defs/no"}, {"type": "string"}, False]},
        ["x"],
        [1],
    ),
    (  # (the key dependentRequired keeps out is no declared property: the object stays open)
        "dependentRequired on an open object",
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        [{"c": 1}, {}],
        [{"a": 1}],
    ),
    ("a count written 2.0", {"type": "array", "items": {"type": "integer"}, "minItems": 2.0}, [[1, 2]], [[1]]),
    ("$ref beside keywords", BASE, [{"name": "n", "id": 1}], [{"id": 1}, {"name": "n"}]),
    (
        "propertyNames: type and pattern",
        {"type": "object", "propertyNames": {"type": "string", "pattern": "^[a-z]+$"}},
        [{"ab": 1}],
        [{"Ab": 1}],
    ),
    (  # (circle-ci's step names)
        "propertyNames: a pattern but not some names",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "not": {"pattern": "^(when|unless)$"}}},
        [{"run": 1}],
        [{"when": 1}, {"Run": 1}],
    ),
    (  # (a subset: strings without the '<' every match starts with)
        "not: {pattern}",
        {"type": "object", "properties": {"f": {"type": "string", "not": {"pattern": "<<.*>>"}}}},
        [{"f": "main"}],
        [{"f": "<< x >>"}],
    ),
    (
        "not: {allOf of required}",
        {
            "type": "object",
            "properties": {"when": {}, "unless": {}},
            "not": {"allOf": [{"required": ["when"]}, {"required": ["unless"]}]},
        },
        [{"unless": 1}, {}],
        [{"when": 1, "unless": 2}],
    ),
    (  # (llguidance refuses a circular $ref beside any other key, annotations too)
        "a circular $ref beside annotations",
        {
            "definitions": {
                "node": {"type": "object", "properties": {"next": {"$ref": "#/definitions/node", "description": "x"}}}
            },
            "$ref": "#/definitions/node",
        },
        [{"next": {"next": {}}}],
        [{"next": 1}],
    ),
    (  # ansible-lint's `rules`: the values keep additionalProperties' schema
        "propertyNames: enum beside additionalProperties",
        {
            "type": "object",
            "propertyNames": {"enum": ["fqcn", "yaml"]},
            "additionalProperties": {"type": "object", "properties": {"skip": {"type": "boolean"}}},
        },
        [{"fqcn": {"skip": True}}, {}],
        [{"fqcn": 1}, {"other": {}}],
    ),
    (  # minecraft's loot tables: draft 7 ignores what stands beside $ref, the validator too
        "a circular $ref beside keywords in draft 7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {
                "n": {
                    "type": "object",
                    "properties": {"v": {"type": "number"}, "next": {"$ref": "#/definitions/n", "minProperties": 9}},
                }
            },
            "$ref": "#/definitions/n",
        },
        [{"v": 1, "next": {"next": {}}}, {}],
        [{"v": "x"}, {"next": {"v": "x"}}],
    ),
    (  # calqulus-pipeline's `#/$defs/Parameter Node`: not a URI as written, jsonschema reads it
        "a pointer with a space",
        {"$defs": {"A B": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/A B"}}},
        [{"x": 1}],
        [{"x": "1"}],
    ),
    (  # saucectl's `https://json-schema.org/draft-07/schema`: llguidance fetched any other spelling
        "$schema as the validator reads it",
        {
            "$schema": "https://json-schema.org/draft-07/schema",
            "type": "object",
            "properties": {"a": {"type": "integer"}},
        },
        [{"a": 1}],
        [{"a": "x"}],
    ),
]


@pytest.fixture(scope="module")
def backend(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    return make_backend("llguidance", tok, len(tok)), tok


def _takes(grammar, tok, doc) -> bool:
    m = grammar.matcher()
    return all(m.accept(t) for t in tok.encode(json.dumps(doc), add_special_tokens=False)) and m.can_end()


@pytest.mark.parametrize("what,schema,valid,invalid", CASES, ids=[c[0] for c in CASES])
def test_rewritten_keywords_are_enforced_exactly(backend, what, schema, valid, invalid):
    llg, tok = backend
    check = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    assert all(check.is_valid(d) for d in valid) and not any(check.is_valid(d) for d in invalid)  # the cases
    grammar = llg.compile(GrammarSpec.from_json_schema(json.dumps(schema)))
    assert not grammar.approximate, what
    for doc in valid:
        assert _takes(grammar, tok, doc), (what, doc)
    for doc in invalid:
        assert not _takes(grammar, tok, doc), (what, doc)


def test_static_refs_leave_what_they_cannot_place():
    schema = {"items": {"$dynamicRef": "#nowhere"}, "properties": {"r": {"$ref": "other.json#/a"}}}
    assert static_refs(schema) == schema
    nested = {"$defs": {"x": {"$id": "x.json", "$defs": {"y": {"type": "string"}}, "$ref": "#/$defs/y"}}}
    assert static_refs(nested)["$defs"]["x"]["$ref"] == "#/$defs/x/$defs/y"  # the resource's own pointer


def test_a_reference_to_an_enclosing_schema_keeps_its_siblings():
    """llguidance refuses a circular `$ref` inside an `allOf`: such a one stays beside its keywords."""
    schema = {"definitions": {"x": {"$ref": "#", "allOf": [{"properties": {"a": {}}}]}}, "properties": {}}
    assert ref_siblings(schema) == schema


def test_a_presence_condition_too_large_to_double_keeps_the_case_without_the_key():
    """Where the anyOf of an `if`'s two cases is past llguidance's size limit, the case without the
    key: a subset of the valid documents (the node's required key keeps the other case)."""
    node = {"type": "object", "if": {"not": {"required": ["m"]}}, "then": {"required": ["s"]}}
    check = jsonschema.Draft202012Validator(plain_conditional(node, presence=False))
    assert check.is_valid({"s": 1}) and not any(map(check.is_valid, [{"m": 1}, {}, {"m": 1, "s": 2}]))
    node = {"required": ["m"], "if": {"required": ["m"]}, "then": {"required": ["s"]}}
    check = jsonschema.Draft202012Validator(plain_conditional(node, presence=False))
    assert check.is_valid({"m": 1, "s": 2}) and not check.is_valid({"m": 1})


def test_an_allof_part_does_not_repeat_the_objects_own_property():
    """dependabot's `then` names the object's own `schedule` by $ref: llguidance would intersect that
    schema with itself (which put dependabot past its size limit); the part keeps its `required`."""
    schema = {
        "definitions": {
            "update": {
                "type": "object",
                "properties": {"schedule": {"type": "object"}, "group": {}},
                "allOf": [
                    {
                        "if": {"not": {"required": ["group"]}},
                        "then": {
                            "properties": {"schedule": {"$ref": "#/definitions/update/properties/schedule"}},
                            "required": ["schedule"],
                        },
                    }
                ],
            }
        },
        "$ref": "#/definitions/update",
    }
    update = schema["definitions"]["update"]
    update["allOf"].append(  # (its `directory` / `directories` oneOf: exclusive once the refs are gone)
        {
            "oneOf": [
                {"properties": {k: {"$ref": f"#/definitions/update/properties/{k}"}}, "required": [k]} for k in "ab"
            ]
        }
    )
    update["properties"].update(a={}, b={})
    parts = strict_schema(schema, presence_cases=False)["definitions"]["update"]["allOf"]
    assert parts[0] == {"properties": {"group": False}, "required": ["schedule"]}
    assert parts[1]["anyOf"] == [
        {"type": "object", "required": ["a"], "properties": {"b": False}},
        {"type": "object", "required": ["b"], "properties": {"a": False}},
    ]


def test_lenient_mode_keeps_both_branches_of_a_dropped_conditional(backend):
    """github-actions' `outputs` takes one schema or another by a nested value: llguidance cannot
    enforce that `if`, and its lenient mode would leave `outputs` free (the model wrote
    `"outputs": 1`); it holds under one branch or the other instead (a superset, output-checked)."""
    llg, tok = backend
    schema = {
        "type": "object",
        "properties": {"runs": {"type": "object", "properties": {"using": {"type": "string"}}}, "outputs": {}},
        "if": {"properties": {"runs": {"properties": {"using": {"const": "composite"}}}}},
        "then": {"properties": {"outputs": {"type": "object"}}},
        "else": {"properties": {"outputs": {"type": "array"}}},
    }
    grammar = llg.compile(GrammarSpec.from_json_schema(json.dumps(schema)))
    assert grammar.approximate
    assert _takes(grammar, tok, {"runs": {"using": "composite"}, "outputs": {}})
    assert _takes(grammar, tok, {"runs": {"using": "docker"}, "outputs": []})
    assert not _takes(grammar, tok, {"runs": {"using": "docker"}, "outputs": 1})


def test_a_oneof_over_one_types_keywords_takes_that_type_only(backend):
    """Branches with array keywords only: an object meets both, so `oneOf` refuses it (the model
    wrote `{",": 2}` for a test-suite schema with no `type`); the grammar holds arrays alone."""
    llg, tok = backend
    schema = {"prefixItems": [{"const": "foo"}], "oneOf": [{"prefixItems": [True, {"const": "bar"}]}, {"maxItems": 1}]}
    check = jsonschema.Draft202012Validator(schema)
    assert not check.is_valid({",": 2}) and check.is_valid(["foo", "bar"])
    grammar = llg.compile(GrammarSpec.from_json_schema(json.dumps(schema)))
    assert _takes(grammar, tok, ["foo", "bar"])
    assert not _takes(grammar, tok, {",": 2}) and not _takes(grammar, tok, "x")
    assert one_of_type({"oneOf": [{"minimum": 1}, {"minLength": 1}]}) == {"oneOf": [{"minimum": 1}, {"minLength": 1}]}


@pytest.mark.parametrize(
    "what,schema,valid,invalid",
    [
        (  # hint's config: a look-ahead llguidance's regexes cannot read, left out
            "a negative look-ahead",
            {"type": "array", "items": {"type": "string", "pattern": "^(?!all$).*$"}},
            [["a", "alley"]],
            [[1]],
        ),
        (  # a JavaScript literal brace (Annex B): escaped, exact
            "a literal brace",
            {"type": "string", "pattern": "^\\${[a-z]+}$"},
            ["${ab}"],
            ["$ab", "${1}"],
        ),
        (  # GitLab CI's `additionalProperties: false` among the patternProperties
            "overlapping patternProperties, one false",
            {"type": "object", "patternProperties": {".*": {"type": "string"}, "additionalProperties": False}},
            [{"a": "x"}],
            [{"a": 1}],
        ),
        (
            "min / maxProperties beside optional keys",
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "additionalProperties": True,
                "minProperties": 1,
            },
            [{"a": 1}, {"a": 1, "c": 2}],
            [{"a": "x"}],
        ),
    ],
)
def test_schemas_llguidance_refuses_compile_relaxed(backend, what, schema, valid, invalid):
    """Schemas llguidance refused outright (so that they went to xgrammar, which wrote documents
    that broke them) compile on llguidance, relaxed only where its error pointed (`schema_repair`,
    lenient mode): the valid documents taken, documents the relaxed grammar still refuses
    refused. (Whatever a relaxation lets through, the output check judges.)"""
    llg, tok = backend
    check = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    assert all(check.is_valid(d) for d in valid) and not any(check.is_valid(d) for d in invalid)
    grammar = llg.compile(GrammarSpec.from_json_schema(json.dumps(schema)))
    assert grammar.approximate, what  # (lenient mode: an exact repair, the brace, is marked too)
    for doc in valid:
        assert _takes(grammar, tok, doc), (what, doc)
    for doc in invalid:
        assert not _takes(grammar, tok, doc), (what, doc)


def test_a_pattern_that_is_no_regex_is_not_relaxed(backend):
    from plait.grammar import GrammarError
    from plait.grammar.schema_repair import js_braces, without_assertions

    with pytest.raises(GrammarError):
        backend[0].compile(GrammarSpec.from_json_schema({"type": "string", "pattern": "([a"}))
    assert js_braces(r"^\p{Lu}{2,3}[{]x{,2}$") == r"^\p{Lu}{2,3}[{]x\{,2\}$"
    assert without_assertions(r"(?<=a)b\b[(?!]") == "b[(?!]"
