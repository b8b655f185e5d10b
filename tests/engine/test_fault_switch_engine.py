"""Issue 16 finding 7: fault injection is off unless the engine is started with it. Without the
switch, ``POST``/``DELETE /v1/faults`` get 403 with an OpenAI-shaped error and the engine stays
healthy and serving; with it (``ENGINE_FAULT_INJECTION=1``, what the operator sets on its
engines when told to), the fault is injected and healed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

ENGINE = ("--role", "colocated", "--time-scale", "50", "--load-source", "NPUForkUB")
HANG = {"kind": "hang"}


def _request(method: str, url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.request(method, url, json=body, timeout=5, trust_env=False)


def test_an_engine_refuses_faults_unless_started_with_the_switch(
    start_engine: Any, stream: Any
) -> None:
    # The fixture switches it on for the tests that inject faults; empty is unset (the default).
    closed = start_engine("closed", *ENGINE, env={"ENGINE_FAULT_INJECTION": ""})
    for method in ("POST", "DELETE"):
        refused = _request(method, f"{closed.url}/v1/faults", HANG)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == "fault_injection_disabled"
        assert "--fault-injection" in error["message"]
    # Nothing happened to it: alive, ready, serving.
    assert httpx.get(f"{closed.url}/healthz", timeout=2, trust_env=False).text == "ok"
    assert httpx.get(f"{closed.url}/readyz", timeout=2, trust_env=False).status_code == 200
    status, events = stream(
        f"{closed.url}/v1/generate", {"requestId": "r", "promptTokens": 64, "maxTokens": 2}
    )
    assert status == 200
    assert events[-1]["type"] == "done"

    opened = start_engine("opened", *ENGINE, env={"ENGINE_FAULT_INJECTION": "1"})
    assert _request("POST", f"{opened.url}/v1/faults", HANG).status_code == 201
    with pytest.raises(httpx.TimeoutException):  # hung: a request waits on the serving loop
        stream(f"{opened.url}/v1/generate", {"requestId": "h", "promptTokens": 8}, timeout=0.5)
    assert _request("DELETE", f"{opened.url}/v1/faults", HANG).status_code == 200
    status, events = stream(
        f"{opened.url}/v1/generate", {"requestId": "h2", "promptTokens": 8, "maxTokens": 2}
    )
    assert (status, events[-1]["type"]) == (200, "done")
