"""GET /openapi.json: its paths and methods equal the app's route table, and schemathesis fuzzes
every route from it (a few hundred cases, on the fake engine) with no 5xx and every error in its
route family's envelope."""
import importlib.util
import tempfile
from pathlib import Path

import falcon.inspect
import pytest
from hypothesis import HealthCheck, Phase, settings

from turbospark_wsgi.http.schemas.openapi_spec import spec

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

HTTP_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


def route_table(app):
    """{path template: {methods}} as the app routes them (Falcon's default responders left out)."""
    table = {}
    for route in falcon.inspect.inspect_routes(app):
        path = route.path.replace(":path}", "}")
        methods = {m.method for m in route.methods if not m.internal and m.method in HTTP_METHODS}
        if methods:
            table[path] = methods
    return table


def test_the_spec_covers_exactly_the_route_table(harness):
    routes = route_table(harness.app())
    documented = {path: {m.upper() for m in ops} for path, ops in spec()["paths"].items()}
    assert documented == routes


def test_served_spec_is_openapi_3_1(client):
    doc = client.get("/openapi.json").json
    assert doc["openapi"].startswith("3.1") and "/v1/chat/completions" in doc["paths"]


def fuzz_app():
    """The app on the suite's fake engine, its default model loaded (so /health answers 200).

    NOTE(schemathesis): the schema must exist at collection time (its lazy fixture loader does not
    work with this pytest), so the suite's conftest is loaded by path rather than as a fixture.
    """
    spec_ = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    suite = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(suite)
    harness = suite.Harness(Path(tempfile.mkdtemp(prefix="turbospark-fuzz-")), max_context=64)
    harness.engine(reply="Hi there")
    harness.registry.resolve(None)
    return harness.app()


schema = schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app())


@schemathesis.check
def error_envelope(ctx, response, case):
    """4xx/5xx bodies use the route family's envelope (Anthropic under /v1/messages)."""
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        ok = body.get("type") == "error" and set(body.get("error", {})) == {"type", "message"}
    else:
        ok = set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if not ok:
        raise AssertionError(f"{response.status_code} body is not the {case.path} family's envelope: {body}")
    return None


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_5xx_and_always_use_the_envelope(case):
    case.call_and_validate(checks=[not_a_server_error, error_envelope])
