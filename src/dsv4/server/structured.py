"""Structured-output request fields -> `StructuredOutput` (the engine compiles and enforces it).

Accepted, at most one per request (each a 400 naming the field when malformed):
    response_format  (chat; OpenAI) {"type": "text"} | {"type": "json_object"} |
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
                     "strict": bool}}: the output is JSON matching the schema (constrained
                     decoding enforces it whatever `strict` says)
    regex, ebnf      (SGLang) a regular expression / a GBNF grammar with a `root` rule
    guided_regex, guided_choice, guided_json  (vLLM) a regex / a list of strings / a schema
A spec that does not compile is refused by the engine (400 with the compiler's message).
"""

from __future__ import annotations

import json
from typing import Any

from dsv4.engine.sampling_params import StructuredOutput
from dsv4.server.errors import bad_request
from dsv4.server.protocol import SamplingFields

_EXTRA_FIELDS = ("regex", "ebnf", "guided_regex", "guided_choice", "guided_json")


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The body's structured-output constraint, or None."""
    given: list[tuple[str, StructuredOutput]] = []
    fmt = _response_format(getattr(body, "response_format", None))
    if fmt is not None:
        given.append(("response_format", fmt))
    for name in _EXTRA_FIELDS:
        value = getattr(body, name)
        if value is not None:
            given.append((name, _extra(name, value)))
    if len(given) > 1:
        raise bad_request(f"{' and '.join(n for n, _ in given)} are exclusive; allowed: at most "
                          "one structured-output field", given[1][0])
    return given[0][1] if given else None


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutput | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad_request(f"response_format.type={kind!r} is invalid; allowed: 'text', "
                          "'json_object', 'json_schema'", "response_format")
    spec = (fmt or {}).get("json_schema")
    spec = spec if isinstance(spec, dict) else {}
    schema = spec.get("schema")
    if not isinstance(schema, dict) or not isinstance(spec.get("name", ""), str):
        raise bad_request("response_format.json_schema must be {'name': str, 'schema': object, "
                          "'strict': bool}; the schema is missing or not an object",
                          "response_format")
    return StructuredOutput("json_schema", json.dumps(schema))


def _extra(name: str, value: Any) -> StructuredOutput:
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise bad_request(f"{name} must be a non-empty list of non-empty strings", name)
        return StructuredOutput("choice", json.dumps(value))
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad_request(f"{name} is not valid JSON: {e}", name) from e
        if not isinstance(value, dict):
            raise bad_request(f"{name} must be a JSON schema object", name)
        return StructuredOutput("json_schema", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return StructuredOutput("ebnf" if name == "ebnf" else "regex", value)
