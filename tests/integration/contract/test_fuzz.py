"""A schemathesis run over the whole served API with every check enabled: zero failures.

Tenant routes first (with a tenant key), then admin routes (with the admin token), so the admin
pass, which deletes tenants and revokes keys it finds, cannot pull the tenant key from under the
tenant pass. schemathesis itself probes every route without credentials and with wrong ones
(`ignored_auth`), sends undeclared methods (`unsupported_method`, which wants 405 + `Allow`),
asks OPTIONS (`allow_header_conformance`) and checks each answer's status, headers, content type
and body against the document.

`positive_data_acceptance` expects 2xx for schema-valid input by default; on the operations below
400 is also a correct answer to schema-valid input, for rules JSON Schema cannot state and that
the route's documented 400 describes: the prompt's token count against the context, the tenant's
per-request caps, the file's JSONL content, the relation between two fields (default_class above
priority_ceiling, expires_in_days with expires_at) and the clock (expires_at in the past).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema

from .conftest import ADMIN_TOKEN, Served

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 2  # per operation in the fuzzing phase; the coverage phase adds its boundary cases
RUNTIME_RULES = {
    "include-path-regex": r"^/v1/(chat/)?completions$|^/v1/(files|batches)$|^/admin/tenants(/\{tenant_id\}(/keys)?)?$",
    "include-method-regex": "^(POST|PATCH)$",
    "checks": {
        "positive_data_acceptance": {
            "expected-statuses": ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
        }
    },
}


@dataclass
class FuzzReport:
    cases: int = 0
    checks: int = 0
    by_phase: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.cases} cases, {self.checks} checks ({dict(self.by_phase)}), "
            f"{len(self.failures)} failures, {len(self.errors)} errors"
        )

    def run(self, schema: Any, describe: Callable[[Any, str, Any], str | None]) -> None:
        """Runs schemathesis over `schema`, counting cases and checks; each failed check goes to
        `describe(recorder, case_id, node)`, which words it or answers None to let it pass."""
        for event in from_schema(schema).execute():
            if isinstance(event, events.ScenarioFinished):
                recorder = event.recorder
                self.cases += len(recorder.cases)
                self.by_phase[str(event.phase)] += len(recorder.cases)
                for case_id, nodes in recorder.checks.items():
                    for node in nodes:
                        self.checks += 1
                        if node.status == Status.FAILURE and node.failure_info is not None:
                            described = describe(recorder, case_id, node)
                            if described is not None:
                                self.failures.append(described)
            elif isinstance(event, events.NonFatalError):
                self.errors.append(f"{event.label}: {event.value!r}"[:500])
            elif isinstance(event, events.FatalError):
                self.errors.append(f"fatal: {event.exception!r}"[:500])


def fuzz(served: Served, tenant_key: str, skip_paths: str, report: FuzzReport) -> None:
    config = SchemathesisConfig.from_dict(
        {
            "checks": {"enabled": True},
            "generation": {"max-examples": MAX_EXAMPLES},
            "phases": {"stateful": {"enabled": False}},
            "auth": {
                "openapi": {
                    "adminToken": {"bearer": ADMIN_TOKEN},
                    "metricsToken": {"bearer": ADMIN_TOKEN},
                    "apiKey": {"bearer": tenant_key},
                }
            },
            "operations": [{"include-path-regex": skip_paths, "enabled": False}, RUNTIME_RULES],
        }
    )
    schema = schemathesis.openapi.from_url(served.base_url + "/schema/openapi.json", config=config)

    def describe(recorder: Any, case_id: str, node: Any) -> str:
        case = recorder.cases[case_id].value
        failure = node.failure_info.failure
        return (f"{recorder.label} [{node.name}] {failure.title}: {failure.message[:300]} "
                f"(query {case.query}, body {str(case.body)[:200]})")

    report.run(schema, describe)


def test_schemathesis_whole_api(served: Served) -> None:
    # Small answers keep generation cheap: max_tokens above 8 is a documented 400 for this tenant.
    _, key = served.new_tenant(max_output_tokens=8)
    report = FuzzReport()
    started = time.monotonic()
    fuzz(served, key, r"^/admin", report)  # tenant and public routes
    fuzz(served, key, r"^/(v1|health|ready|metrics|tokenize|detokenize)", report)  # admin routes
    print(f"schemathesis: {report.line()} in {time.monotonic() - started:.1f}s")
    assert report.cases > 500  # every operation was exercised, not skipped
    assert not report.errors, "\n".join(report.errors)
    assert not report.failures, "\n".join(report.failures[:30])
