"""A stream survives the instance that serves it (issue 31 item 2, its "Done when"): streamed
completions through the gateway while an engine process is killed (kill -9, as
``test_recovery_chaos``'s ``kill`` fault):

- **a decode killed mid-stream**, a second decode serving: the prefill that relays each stream
  moves it (re-prefill of the prompt and the tokens sent, then the other decode);
- **a prefill killed before its first token**, a second prefill serving: the gateway offers the
  request to the other entrance within its TTFT budget.

Either way: 0 failed streams, every client's text equal to an unfaulted run's of the same
prompts (the stub's tokens are a function of the prompt and their index), usage counted once,
the streams that were on the killed instance said moved (``matrixserve.migrations``), and what
the moves took given back. The stall a moved stream shows is printed (``pytest -s``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from matrixserve.devcluster.cluster import ClusterInfo
from testkit.helpers import Groups, metric, pdgroup_body, wait_for


@dataclass
class Stream:
    """One streamed completion as its client saw it."""

    prompt: str
    started: float = 0.0  # wall time it was sent
    status: int = 0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # wall time of each token chunk
    usage: dict[str, int] = field(default_factory=dict)
    account: dict[str, Any] = field(default_factory=dict)  # the final chunk's ``matrixserve``
    error: dict[str, Any] | None = None
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done and bool(self.usage)

    @property
    def moved(self) -> int:
        return int(self.account.get("migrations") or 0)

    def ttft(self) -> float:
        return self.arrivals[0] - self.started

    def longest_gap(self) -> float:
        """The longest wall time between two tokens (a moved stream's stall)."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


def stream(gateway: str, prompt: str, max_tokens: int) -> Stream:
    body = {
        "model": "general",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen = Stream(prompt, time.monotonic())
    with httpx.stream(
        "POST", f"{gateway}/v1/completions", json=body, timeout=60, trust_env=False
    ) as response:
        seen.status = response.status_code
        if response.status_code != 200:
            seen.error = json.loads(response.read())
            return seen
        for line in response.iter_lines():
            if line == "data: [DONE]":
                seen.done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                seen.error = chunk["error"]
            elif chunk.get("usage"):
                seen.usage = chunk["usage"]
            elif "matrixserve" in chunk:
                seen.account = chunk["matrixserve"]
            elif chunk["choices"]:
                seen.text += chunk["choices"][0]["text"]
                seen.arrivals.append(time.monotonic())
    return seen


def run(
    gateway: str, prompts: list[str], max_tokens: int, during: Callable[[], None] | None = None
) -> list[Stream]:
    """Every prompt streamed at once (one client each); ``during()`` runs meanwhile."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, gateway, p, max_tokens) for p in prompts]
        if during is not None:
            during()
        return [f.result(timeout=120) for f in futures]


def _pods(cluster: ClusterInfo, namespace: str) -> dict[str, dict[str, Any]]:
    pods = httpx.get(f"{cluster.node_emulator}/pods", trust_env=False).json()
    return {p["name"]: p for p in pods if p["namespace"] == namespace and p["pids"]}


def _info(pod: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.get(f"http://{pod['podIP']}:8000/v1/info", timeout=5, trust_env=False)
    return dict(answer.json()["health"])


def _same_as_unfaulted(faulted: list[Stream], unfaulted: list[Stream], max_tokens: int) -> None:
    failed = [(s.prompt[:30], s.status, s.error) for s in faulted if not s.ok]
    assert not failed, f"{len(failed)} failed streams: {failed}"
    for hit, clean in zip(faulted, unfaulted, strict=True):
        assert hit.text == clean.text, "a token repeated, skipped or changed"
        assert hit.usage == clean.usage, "usage counted once"
        assert hit.usage["completion_tokens"] == max_tokens


def _gaps(streams: list[Stream]) -> str:
    moved = [s.longest_gap() * 1000 for s in streams if s.moved]
    others = [s.longest_gap() * 1000 for s in streams if not s.moved]
    return (
        f"longest gap between two tokens: moved streams {', '.join(f'{g:.0f}' for g in moved)} "
        f"wall ms; the others at most {max(others, default=0):.0f} wall ms"
    )


DECODE_SCALE = "5"  # time scale: ~12 emulated ms a token are 2.4 wall ms
DECODE_TOKENS = 600  # ~1.5 wall s a stream
DECODE_CLIENTS = 6


def test_a_decode_killed_mid_stream_fails_no_stream_and_changes_no_text(
    cluster: ClusterInfo,
    namespace: str,
    serving_group: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    serving_group(
        prefill=1,
        decode=2,
        time_scale=DECODE_SCALE,
        extra=("--engine-pre-load-seconds", "0"),  # 4 wall s of start-up not looked at
    )
    gateway = start_gateway("--time-scale", DECODE_SCALE)
    prompts = [f"client {i} asks for a long story " * 8 for i in range(DECODE_CLIENTS)]
    unfaulted = run(gateway, prompts, DECODE_TOKENS)
    assert all(s.ok for s in unfaulted), [s.error for s in unfaulted if not s.ok]
    pods = _pods(cluster, namespace)
    decodes = {name: pod for name, pod in pods.items() if name.startswith("g-d-")}
    assert len(decodes) == 2
    killed: dict[str, float] = {}

    def kill_a_busy_decode() -> None:
        def busy() -> str | None:
            running = {name: _info(pod)["decodeBatch"]["running"] for name, pod in decodes.items()}
            name = max(running, key=lambda n: running[n])
            both = all(running.values())  # the streams spread over both decodes first
            return name if both and running[name] >= 2 else None

        name = wait_for(busy, timeout=10, every=0.02, what="streams decoding on both decodes")
        time.sleep(0.3)  # mid-stream: a few hundred tokens out
        os.kill(decodes[name]["pids"]["engine"], signal.SIGKILL)
        killed[name] = time.monotonic()

    faulted = run(gateway, prompts, DECODE_TOKENS, kill_a_busy_decode)
    (victim,) = killed
    _same_as_unfaulted(faulted, unfaulted, DECODE_TOKENS)
    moved = [s for s in faulted if s.moved]
    assert moved, "no stream was on the killed decode"
    assert all(s.account["instances"]["decode"] != victim for s in moved)
    prefill = f"http://{pods['g-p-0']['podIP']}:8000"
    moves = sum(
        metric(prefill, f'matrixserve_engine_migrations_total{{outcome="{outcome}"}}')
        for outcome in ("pull", "reprefill")
    )
    assert moves == sum(s.moved for s in moved)
    stall_sum = metric(prefill, "matrixserve_engine_migration_stall_seconds_sum")
    stall_count = metric(prefill, "matrixserve_engine_migration_stall_seconds_count")
    print(
        f"\n{len(moved)} of {len(faulted)} streams moved off {victim}; stall "
        f"{stall_sum / stall_count * 1000:.1f} emulated ms on average (the prefill's); "
        + _gaps(faulted)
    )
    # what the moves took is given back: nothing held once the streams ended
    survivor = next(pod for name, pod in decodes.items() if name != victim)
    wait_for(
        lambda: (
            _info(pods["g-p-0"])["prefillSlots"]["used"] == 0
            and _info(pods["g-p-0"])["kvReservedBytes"] == 0
            and _info(survivor)["decodeBatch"]["admitted"] == 0
        ),
        timeout=5,
        what="the prefill and the surviving decode idle",
    )
    for name in ("open_streams", "prompts_in_prefill", "prefill_slots_held"):
        assert metric(gateway, f"matrixserve_gateway_{name}") == 0, name


PREFILL_TOKENS = 16
PREFILL_CLIENTS = 8
PROMPT = "a prompt of about a thousand tokens " * 111  # 3,996 characters: 999 tokens


def test_a_prefill_killed_before_its_first_token_fails_no_stream_and_changes_no_text(
    cluster: ClusterInfo,
    namespace: str,
    groups: Groups,
    start_operator: Callable[..., Any],
    start_gateway: Callable[..., str],
) -> None:
    """Both prefills slowed (an injected ``slow`` fault: g-p-0 1000x, a 999-token prompt's
    prefill ~25 emulated s, 1.2 wall s; g-p-1 40x, 50 wall ms) so that some prompts are being
    prefilled on g-p-0 when it is killed; the TTFT budget (120 emulated s, 6 wall s) leaves
    room for the move."""
    start_operator(namespace, extra=("--engine-pre-load-seconds", "0"))
    body = pdgroup_body("g", prefill=2, decode=1)
    body["spec"]["slo"]["ttftMilliseconds"] = 120000
    groups.create(body)
    groups.wait_ready("g")
    gateway = start_gateway()  # time scale 20, as the operator's engines
    prompts = [f"client {i}: {PROMPT}" for i in range(PREFILL_CLIENTS)]
    unfaulted = run(gateway, prompts, PREFILL_TOKENS)
    assert all(s.ok for s in unfaulted), [s.error for s in unfaulted if not s.ok]
    pods = _pods(cluster, namespace)
    for name, factor in (("g-p-0", 1000), ("g-p-1", 40)):
        injected = httpx.post(
            f"http://{pods[name]['podIP']}:8000/v1/faults",
            json={"kind": "slow", "factor": factor},
            trust_env=False,
        )
        assert injected.status_code == 201, injected.text
    killed: list[int] = []
    killed_at: list[float] = []

    def kill_the_slow_prefill_while_it_prefills() -> None:
        wait_for(
            lambda: _info(pods["g-p-0"])["prefillSlots"]["used"] >= 1,
            timeout=10,
            every=0.02,
            what="prompts in prefill on g-p-0",
        )
        time.sleep(0.2)
        killed.append(_info(pods["g-p-0"])["prefillSlots"]["used"])
        os.kill(pods["g-p-0"]["pids"]["engine"], signal.SIGKILL)
        killed_at.append(time.monotonic())

    faulted = run(gateway, prompts, PREFILL_TOKENS, kill_the_slow_prefill_while_it_prefills)
    _same_as_unfaulted(faulted, unfaulted, PREFILL_TOKENS)
    moved = [s for s in faulted if s.moved]
    # what was on g-p-0 at the kill is counted after it (admissions may change its slots
    # between a read and the kill): every stream it held moved (none failed, above), and the
    # gateway's moves are exactly the moved streams
    assert len(moved) >= 1, "a prompt in prefill on g-p-0 moved"
    assert all(s.account["instances"]["prefill"] == "g-p-1" for s in moved)
    offered = sum(
        metric(gateway, f'matrixserve_gateway_migrations_total{{outcome="moved",stage="{stage}"}}')
        for stage in ("before_first_token", "mid_stream")
    )
    assert offered == sum(s.moved for s in moved)
    assert (
        metric(
            gateway,
            'matrixserve_gateway_migrations_total{outcome="moved",stage="before_first_token"}',
        )
        >= 1
    )
    print(
        f"\n{len(moved)} of {len(faulted)} streams were on the killed g-p-0 ({killed[0]} slots "
        "in use just before the kill) and moved to g-p-1; TTFT of the moved "
        + ", ".join(f"{s.ttft() * 1000:.0f}" for s in moved)
        + f" wall ms (killed {(killed_at[0] - min(s.started for s in faulted)) * 1000:.0f} ms "
        "after the first was sent); of the others at most "
        + f"{max((s.ttft() for s in faulted if not s.moved), default=0) * 1000:.0f} wall ms"
    )
    for name in ("open_streams", "prompts_in_prefill", "prefill_slots_held"):
        assert metric(gateway, f"matrixserve_gateway_{name}") == 0, name
