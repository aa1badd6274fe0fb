"""JSON extraction constrained by a JSON schema (a dict) and by a pydantic model.

.venv/bin/python examples/dsl_json_extraction.py
"""

from __future__ import annotations

import json

import pydantic
from _backend import default_backend

import plait

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "is_capital": {"type": "boolean"},
    },
    "required": ["name", "country", "is_capital"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=150)
    job: str = pydantic.Field(max_length=30)


@plait.function
def extract(s, text):
    s += "Extract the facts from the text as JSON.\n\nText: " + text + "\n"
    s += "City: " + plait.gen("city", json_schema=CITY_SCHEMA, max_tokens=64) + "\n"
    s += "Person: " + plait.gen("person", json_schema=Person, max_tokens=64)


def main() -> None:
    with default_backend(__doc__):
        state = extract.run(text="Marie, a 34-year-old baker, lives in Paris, the capital of France.", temperature=0)
        print("city:  ", json.loads(state["city"]))
        print("person:", Person.model_validate_json(state["person"]))


if __name__ == "__main__":
    main()
