"""Cut the response schemas the server must satisfy out of OpenAI's published OpenAPI description
(github.com/openai/openai-openapi, `openapi.json`) into one small JSON file the tests validate
against, with the commit it came from.

    python scripts/vendor_openai_schemas.py OPENAPI_JSON COMMIT OUT_JSON

Kept: the chat completion response, its stream chunk, the completion response, the Responses
API's response object and its stream events, with every schema they reference; their prose
(`description` and `title` strings, which no validator reads) is left out. The description is
OpenAPI 3.1 but still writes `nullable: true` in places (an OpenAPI 3.0 keyword that JSON Schema
ignores); each such schema becomes `anyOf: [it, null]`, which is what the keyword means.
"""

from __future__ import annotations

import json
import sys

ROOTS = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse", "Response",
         "ResponseStreamEvent")
PROSE = ("description", "title")
PREFIX = "#/components/schemas/"


def _references(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(PREFIX):]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _references(value)
        return found
    if isinstance(node, list):
        return set().union(*map(_references, node)) if node else set()
    return set()


def _for_validation(node):
    if isinstance(node, list):
        return [_for_validation(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: _for_validation(value) for key, value in node.items()
            if not (key in PROSE and isinstance(value, str))}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def vendor(description: dict, commit: str) -> dict:
    schemas = description["components"]["schemas"]
    kept, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = schemas[name]
            todo += sorted(_references(schemas[name]))
    return {"source": "https://github.com/openai/openai-openapi/blob/" + commit + "/openapi.json",
            "commit": commit, "openapi": description["openapi"], "license": "MIT (OpenAI)",
            "components": {"schemas": {name: _for_validation(kept[name]) for name in sorted(kept)}}}


def main() -> None:
    source, commit, out = sys.argv[1:4]
    with open(source) as handle:
        vendored = vendor(json.load(handle), commit)
    with open(out, "w") as handle:
        json.dump(vendored, handle, indent=1, sort_keys=True)
        handle.write("\n")


if __name__ == "__main__":
    main()
