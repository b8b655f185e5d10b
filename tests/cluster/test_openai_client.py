"""The gateway judged by the official ``openai`` Python client (issue 16, finding 6): chat and
completions, streamed and not, ``n``, lists of prompts and token ids, ``stop``,
``stream_options.include_usage``, ``models.retrieve``, and the typed errors it raises for
the gateway's 400, 401, 404, 429 and 503 answers (with ``.code`` and ``.param``), a prompt
longer than the engines take among the 400s (``context_length_exceeded``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from kubernetes import client
from openai.types.chat import ChatCompletionMessageParam

from testkit.helpers import Groups, wait_for

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def connect(url: str, key: str = "sk-unused-by-an-open-gateway") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key=key,
        max_retries=0,  # every answer as the gateway gave it
        timeout=30,
        http_client=openai.DefaultHttpx2Client(trust_env=False),
    )


def check_completions(oa: openai.OpenAI) -> None:
    """What a client asks most: chat and completions, plain and streamed, n, lists, stop."""
    chat = oa.chat.completions.create(
        model="general",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "what is 6 x 7?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        max_completion_tokens=5,
        temperature=0.7,
        seed=1,
        user="u",
    )
    (choice,) = chat.choices
    assert (choice.finish_reason, choice.message.role) == ("length", "assistant")
    assert choice.message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5

    several = oa.chat.completions.create(model="general", messages=USER, n=3, max_tokens=2)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.usage is not None
    assert several.usage.completion_tokens == 6

    chunks = list(
        oa.chat.completions.create(
            model="general",
            messages=USER,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    plain_stream = list(oa.chat.completions.create(model="general", messages=USER, stream=True))
    assert all(c.usage is None for c in plain_stream)

    # the engines' words cycle through ten, "of " among them: cut there, the decode stopped
    stopped = oa.completions.create(model="general", prompt="x", max_tokens=50, stop=["of "])
    assert stopped.choices[0].finish_reason == "stop"
    assert "of " not in stopped.choices[0].text
    assert stopped.usage is not None
    assert stopped.usage.completion_tokens <= 10
    streamed = list(
        oa.completions.create(model="general", prompt="x", max_tokens=50, stop="of ", stream=True)
    )
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert "of " not in "".join(c.choices[0].text for c in streamed)

    listed = oa.completions.create(model="general", prompt=["one", "two two"], max_tokens=2)
    assert [c.index for c in listed.choices] == [0, 1]
    ids = oa.completions.create(model="general", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert ids.usage is not None
    assert (ids.usage.prompt_tokens, ids.usage.completion_tokens) == (5, 8)
    by_index: dict[int, str] = {}
    for c in oa.completions.create(model="general", prompt=["a", "b"], max_tokens=3, stream=True):
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert sorted(by_index) == [0, 1]
    assert all(len(text.split()) == 3 for text in by_index.values())


def check_refusals(oa: openai.OpenAI) -> None:
    """The 400s and 404s, typed, with the code and the parameter."""
    refusals: list[tuple[Callable[[], Any], str, str | None]] = [
        (
            lambda: oa.chat.completions.create(model="general", messages=USER, temperature=2.5),
            "temperature",
            "invalid_request",
        ),
        (
            lambda: oa.chat.completions.create(model="general", messages=USER, top_p=1.5),
            "top_p",
            "invalid_request",
        ),
        (
            lambda: oa.chat.completions.create(model="general", messages=USER, n=0),
            "n",
            "invalid_request",
        ),
        (
            lambda: oa.chat.completions.create(
                model="general",
                messages=USER,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            ),
            "tools",
            "unsupported_parameter",
        ),
        (
            lambda: oa.chat.completions.create(model="general", messages=USER, logprobs=True),
            "logprobs",
            "unsupported_parameter",
        ),
        (
            lambda: oa.chat.completions.create(
                model="general", messages=USER, response_format={"type": "json_object"}
            ),
            "response_format",
            "unsupported_parameter",
        ),
        (
            lambda: oa.chat.completions.create(
                model="general",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "https://example.invalid/x.png"},
                            }
                        ],
                    }
                ],
            ),
            "messages[0].content[0]",
            "unsupported_content",
        ),
        (
            lambda: oa.completions.create(model="general", prompt="x", echo=True),
            "echo",
            "unsupported_parameter",
        ),
        (
            lambda: oa.completions.create(
                model="general", prompt="x", stream_options={"include_usage": True}
            ),
            "stream_options",
            "invalid_request",
        ),
        (
            lambda: oa.chat.completions.create(
                model="general", messages=USER, extra_body={"top_k": 5}
            ),
            "top_k",
            "unknown_parameter",
        ),
        # within the gateway's --max-prompt-chars, over the engines' maxContextTokens (8192
        # tokens in the sample): the prefill's 413, final, in OpenAI's words
        (
            lambda: oa.chat.completions.create(
                model="general", messages=[{"role": "user", "content": "x" * 40_000}]
            ),
            "messages",
            "context_length_exceeded",
        ),
        (
            lambda: oa.completions.create(model="general", prompt="x" * 40_000, stream=True),
            "prompt",
            "context_length_exceeded",
        ),
    ]
    for call, param, code in refusals:
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert (bad.value.status_code, bad.value.param, bad.value.code) == (400, param, code)
    for call in (
        lambda: oa.chat.completions.create(model="no-such-model", messages=USER),
        lambda: oa.models.retrieve("no-such-model"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model")


def test_the_official_client_drives_the_gateway(
    api_client: client.ApiClient,
    namespace: str,
    groups: Groups,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    serving_group()
    url = start_gateway()
    oa = connect(url)
    wait_for(lambda: oa.models.list().data, timeout=20, what="the scenario")
    assert [m.id for m in oa.models.list().data] == ["general"]
    model = oa.models.retrieve("general")
    assert (model.id, model.object, model.owned_by) == ("general", "model", "matrixserve")
    check_completions(oa)
    check_refusals(oa)

    # 503 no_capacity (a hung prefill never answers within the budget): InternalServerError
    prefills = [
        groups.core.read_namespaced_pod(f"g-p-{i}", namespace).status.pod_ip for i in (0, 1)
    ]
    hang = {"kind": "hang"}
    for ip in prefills:
        answer = httpx.post(f"http://{ip}:8000/v1/faults", json=hang, trust_env=False)
        assert answer.status_code == 201
    try:
        with pytest.raises(openai.InternalServerError) as busy:
            oa.completions.create(model="general", prompt="x", max_tokens=2)
    finally:
        for ip in prefills:
            httpx.request("DELETE", f"http://{ip}:8000/v1/faults", json=hang, trust_env=False)
    assert (busy.value.status_code, busy.value.code) == (503, "no_capacity")
    assert busy.value.response.headers["Retry-After"] == "1"

    # API keys: AuthenticationError without a valid one, RateLimitError past the key's rate
    key = "sk-matrixserve-client-0123456789"
    client.CoreV1Api(api_client).create_namespaced_secret(
        namespace, {"metadata": {"name": "keys"}, "stringData": {"team": key}}
    )
    keyed = start_gateway(
        "--api-keys-secret", f"{namespace}/keys", "--rate-limit", "0.01", "--rate-burst", "2"
    )
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        connect(keyed, "sk-not-a-key-0000000000").models.list()
    assert unauthorized.value.code == "invalid_api_key"
    team = connect(keyed, key)

    def loaded() -> bool:
        try:
            return bool(team.models.list().data)  # once the keys are loaded: 1 of the burst's 2
        except openai.AuthenticationError:
            return False

    wait_for(loaded, timeout=20, what="the keys loaded")
    team.models.retrieve("general")  # 2 of 2
    with pytest.raises(openai.RateLimitError) as limited:
        team.models.retrieve("general")
    assert limited.value.code == "rate_limited"
