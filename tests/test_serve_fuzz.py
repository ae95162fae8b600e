"""Schemathesis against cabin-serve's own ``/openapi.json`` on loopback (the tiny engine): no generated request,
valid or not, gets a 5xx, an undocumented status or content type, or a response that breaks the schema. Each
generated chat request is also sent again on a valid conversation, so the fuzzed sampling, tool and format fields
reach the scheduler, not only the message checks. ``scripts/fuzz_server.sh`` is the longer run.

Not checked: positive_data_acceptance. The schema states each field's type; rules across fields (a tool message
names its call, a user message holds text) are checked by the request model and answered 400 naming the field.
"""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from serve_helpers import running_server

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection]
VALID = [{"role": "user", "content": "set the cabin to 21 degrees"}]


@pytest.fixture(scope="module", autouse=True)
def server(tiny_engine_dir):
    with running_server(tiny_engine_dir, "--max-tokens", "8") as base:
        yield base


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_fuzzed_request_breaks_the_server_or_the_schema(case):
    case.call_and_validate(checks=CHECKS)
    if case.operation.path == "/v1/chat/completions" and isinstance(case.body, dict):
        case.body = {**case.body, "messages": VALID}
        case.call_and_validate(checks=[c for c in CHECKS if c is not checks.negative_data_rejection])
