"""The served schema says what the server enforces (issue #35): schemathesis over the generation,
tokenizer and file routes with every phase and every check, and schema-valid input must be
accepted (2xx) except for the rules the route documents that JSON Schema cannot state.

Unlike `test_fuzz.py` (which lets any documented 400 pass on these routes), a 400 here is a
failure unless its `code` is one of `RUNTIME_CODES`: a refusal for a reason the document cannot
express (the prompt's tokens against the model's context, the tenant's per-request caps, a file's
JSONL lines). Anything else refused while the schema allows it is the schema lying.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig

from .conftest import Served
from .test_fuzz import FuzzReport

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 6  # per operation and phase: bounded, so the run takes about a minute on 2 cores
PATHS = r"^/v1/(chat/)?completions$|^/v1/files$|^/(de)?tokenize$"
# 400s that depend on more than the body's shape (documented on each route).
RUNTIME_CODES = {"context_length_exceeded", "max_output_tokens_exceeded", "max_prompt_tokens_exceeded",
                 "invalid_jsonl"}


def _runtime_refusal(label: str, response: object) -> bool:
    """A 400 for a rule the document states but JSON Schema does not validate: the prompt's tokens
    against the context, the tenant's caps, and content the document gives a media type
    (`contentMediaType` is an annotation, schemathesis sends any text): an upload's UTF-8 JSONL,
    a tool call's `arguments` JSON."""
    try:
        error = json.loads(response.content)["error"]  # type: ignore[attr-defined]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    if error.get("code") in RUNTIME_CODES:
        return True
    if label == "POST /v1/files" and error.get("code") == "invalid_file":
        return True
    return str(error.get("param") or "").endswith(".tool_calls") and "not valid JSON" in str(error.get("message"))


def test_schema_valid_input_is_accepted(served: Served) -> None:
    _, key = served.new_tenant(max_output_tokens=8)
    config = SchemathesisConfig.from_dict({
        "checks": {"enabled": True},
        "generation": {"max-examples": MAX_EXAMPLES},
        "auth": {"openapi": {"apiKey": {"bearer": key}}},
        "operations": [{"include-path-regex": PATHS, "enabled": True},
                       {"exclude-path-regex": PATHS, "enabled": False}],
    })
    schema = schemathesis.openapi.from_url(served.base_url + "/schema/openapi.json", config=config)
    report = FuzzReport()
    started = time.monotonic()

    def describe(recorder: Any, case_id: str, node: Any) -> str | None:
        response = recorder.interactions.get(case_id)
        if (node.name == "positive_data_acceptance" and response is not None
                and response.response is not None and _runtime_refusal(recorder.label, response.response)):
            return None
        case = recorder.cases[case_id].value
        failure = node.failure_info.failure
        answer = response.response.content[:300] if response and response.response else b""
        return f"{recorder.label} [{node.name}] {failure.title} (body {str(case.body)[:200]}): {answer!r}"

    report.run(schema, describe)
    print(f"schemathesis: {report.line()} in {time.monotonic() - started:.1f}s")
    assert report.cases > 50
    assert not report.errors, "\n".join(report.errors)
    assert not report.failures, "\n".join(report.failures[:40])
