"""The last check on JSON-schema outputs (runtime/output_check.py): a document that finished but
does not validate never comes back as "stop" — the request ends as an abort the HTTP layer answers
with a 500 naming the keyword; a valid one, a truncated one and one cut by the caller's own stop
string pass through as they are."""

from __future__ import annotations

import json

from plait.runtime.engine import RequestState
from plait.runtime.output_check import INVALID_OUTPUT, schema_violation
from plait.runtime.request import TokenOutput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.server.http_common import abort_error

# keywords xgrammar approximates (the auto backend's fallback where llguidance refuses a schema)
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"oneOf": [{"type": "integer"}, {"minimum": 0}]},
        "tag": {"allOf": [{"type": "string"}, {"not": {"const": "x"}}]},
    },
    "required": ["n"],
    "additionalProperties": {"type": "number"},
}


def finish(text: str, reason: dict, schema=SCHEMA, stop=None) -> dict:
    state = RequestState(
        "r", SamplingParams(json_schema=schema, stop=stop), tokenizer=None, return_text_in_logprobs=False
    )
    state.update(TokenOutput(rid="r", new_ids=[1, 2], finish_reason=reason, text_delta=text))
    return state.finish_reason


def test_schema_violation_names_the_keyword_and_where():
    text = json.dumps(SCHEMA)
    assert schema_violation(text, '{"n": -2, "tag": "y", "extra": 1.5}') is None
    for doc, keyword, where in (
        ('{"n": 3}', "oneOf", "['n']"),  # valid under both branches
        ('{"n": -1, "tag": "x"}', "not", "['tag']"),
        ('{"n": -1, "": "s"}', "type", "['']"),  # a type under the empty key
        ('{"tag": "y"}', "required", "the root"),
    ):
        why = schema_violation(text, doc)
        assert why.startswith(INVALID_OUTPUT) and f"'{keyword}'" in why and where in why, why
    assert "not JSON" in schema_violation(text, '{"n": ')
    # a `false` subschema: named by the keyword that holds it
    assert "'propertyNames'" in schema_violation('{"propertyNames": false}', '{"a": 1}')


def test_an_invalid_finished_document_becomes_an_abort_answered_with_500():
    reason = finish('{"n": 3}', {"type": "stop", "matched": 2})
    assert reason["type"] == "abort" and "'oneOf'" in reason["message"]
    err = abort_error(reason)
    assert err.status == 500 and INVALID_OUTPUT in str(err)


def test_valid_truncated_and_caller_stopped_outputs_pass_through():
    assert finish('{"n": -4}', {"type": "stop", "matched": 2}) == {"type": "stop", "matched": 2}
    assert finish('{"n": 3', {"type": "length", "length": 2}) == {"type": "length", "length": 2}
    # the caller's stop string cut the document: their request, their text
    assert finish('{"n": 3, "tag": "x"}', {"type": "stop", "matched": ", \""}, stop=[', "'])["type"] == "stop"
    # no schema: nothing to check
    state = RequestState("r", SamplingParams(), tokenizer=None, return_text_in_logprobs=False)
    state.update(TokenOutput(rid="r", new_ids=[1], finish_reason={"type": "stop", "matched": 2}, text_delta="{"))
    assert state.finish_reason["type"] == "stop"


def test_an_invalid_document_is_sampled_again_while_attempts_remain():
    """With attempts left (the engine's json_resample, for non-streamed sampled requests) an invalid
    document asks to be sampled again instead of finishing, its text and tokens forgotten; the
    next valid one finishes as "stop" and meta_info counts the discarded ones. When attempts run
    out the abort says how many documents were sampled."""
    state = RequestState("r", SamplingParams(json_schema=SCHEMA), tokenizer=None, return_text_in_logprobs=False)
    state.resamples_left = 1
    state.update(
        TokenOutput(rid="r", new_ids=[1, 2], finish_reason={"type": "stop", "matched": 2}, text_delta='{"n": 3}')
    )
    assert not state.finished and state.resample and state.output_ids == [] and state.text() == ""
    state.resample = False  # (the engine sends the request again)
    state.update(
        TokenOutput(rid="r", new_ids=[5], finish_reason={"type": "stop", "matched": 2}, text_delta='{"n": -3}')
    )
    assert state.finish_reason == {"type": "stop", "matched": 2} and state.text() == '{"n": -3}'
    assert state.result()["meta_info"]["json_resampled"] == 1 and state.output_ids == [5]

    state = RequestState("r", SamplingParams(json_schema=SCHEMA), tokenizer=None, return_text_in_logprobs=False)
    state.resamples_left = 1
    for _ in range(2):
        state.update(
            TokenOutput(rid="r", new_ids=[1], finish_reason={"type": "stop", "matched": 2}, text_delta='{"n": 3}')
        )
    assert (
        state.finish_reason["type"] == "abort" and "(2 documents sampled, none valid)" in state.finish_reason["message"]
    )


def test_ecma_patterns_are_checked_and_an_uncheckable_document_is_withheld():
    """A pattern of ECMA-262 that Python's `re` refuses (`\\p{Letter}`) is checked through the
    `regex` module, in `pattern`, `patternProperties` and what `additionalProperties` leaves; where
    the validator cannot finish (a `$ref` to nothing), the document is withheld, never passed."""
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"Id": {"type": "string", "pattern": "^\\p{Lu}\\d+$"}},
            "patternProperties": {"^\\p{Ll}+$": {"type": "integer"}},
            "additionalProperties": False,
        }
    )
    assert schema_violation(schema, '{"Id": "A1", "ab": 2}') is None
    for doc, keyword in (('{"Id": "a1"}', "pattern"), ('{"ab": "x"}', "type"), ('{"AB": 1}', "additionalProperties")):
        why = schema_violation(schema, doc)
        assert why is not None and f"'{keyword}'" in why, (doc, why)
    dangling = json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})
    why = schema_violation(dangling, '{"a": 1}')
    assert why.startswith(INVALID_OUTPUT) and "could not be checked" in why
