"""Attention clients decoding through expert servers, on a private ZooKeeper, the test playing
the pool's controller (:class:`engine.test_expert_server.Pool`):

- a client alone (no P/D group: ``/v1/generate``) decodes through three servers, every expert
  on two of them: every stream completes, and no server gets two first messages from the
  client in one iteration (its repeat counter stays 0, its messages are at most the client's
  iterations);
- a server killed (SIGKILL, by pid) mid-decode: 0 failed streams, its parts re-sent to the
  replicas (the client's re-send and failover counters move);
- an expert's last copy killed: the client holds its iteration for the failover timeout, then
  the streams end with ``expert_uncovered`` and admission refuses 503 ``expert_uncovered``
  until a map covers them again (then a stream completes: no iteration has to run first);
  a map that covers it again written within the bound instead: 0 failed;
- monolithic mode: a server killed stops every iteration (no token for a while), its restart
  (registered and Serving again) resumes them, and every stream completes;
- a forward probe (``/v1/attention/step`` with ``send``: 1K-token requests, xDeepServe Fig.
  11b's sequence) goes to the servers as an iteration of its own, between the batch's: each
  server serves one more message, its tokens count in their reports, and the MoE part the
  servers' answers give is the one predicted for idle servers; the same body unsent moves no
  server; a malformed probe, or one that would keep a server busy half the failover timeout,
  is a 400 naming its field;
- the pool's failover timeout (the pointer's ``failoverMs``, rewritten alone) wins over the
  client's own long one from the next message on: a hung server (SIGSTOP: its session lives,
  no offline event) is dropped on timeout within seconds, and no stream fails.

Each measured stall is printed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from engine.conftest import EngineProc, concurrent_streams
from engine.test_expert_server import EXPERTS, Pool, every_layer, pool  # noqa: F401
from matrixserve.api import zk_layout as zl
from testkit.helpers import wait_for

HALF_A, HALF_B = list(range(8)), list(range(8, 16))


def _metric(engine: EngineProc, name: str, labels: str = "") -> float:
    """A metric's value on the engine (0 when absent)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=5, trust_env=False).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _iterations(client: EngineProc) -> float:
    return _metric(client, "matrixserve_engine_expert_iteration_seconds_count")


@contextlib.contextmanager
def _decoding(
    client: EngineProc, n: int, tokens: int
) -> Iterator[concurrent.futures.Future[list[tuple[int, list[dict[str, Any]]]]]]:
    """``n`` streams of ``tokens`` running in the background, a few iterations in."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        running = ex.submit(concurrent_streams, client, n, tokens)
        wait_for(lambda: _iterations(client) > 5, timeout=30, what="decoding")
        yield running


def _failed(results: list[tuple[int, list[dict[str, Any]]]]) -> list[Any]:
    return [
        events[-1] if events else status
        for status, events in results
        if status != 200 or not events or events[-1].get("type") != "done"
    ]


def _servers(
    experts: Pool, start_engine: Callable[..., EngineProc], *names: str
) -> list[EngineProc]:
    procs = [experts.start_server(start_engine, name) for name in names]
    wait_for(
        lambda: all(experts.report(n) is not None for n in names), timeout=30, what="registered"
    )
    return procs


def _client(
    experts: Pool, start_engine: Callable[..., EngineProc], name: str, *more: str
) -> EngineProc:
    return start_engine(name, *experts.args("attention", *more), env=experts.env())


def _three_servers_two_copies(experts: Pool, version: int = 1) -> None:
    """ex-a: 0-7, ex-b: 8-15, ex-c: all 16: every expert on two servers."""
    experts.write(version, ["ex-a", "ex-b", "ex-c"], every_layer(HALF_A, HALF_B, list(range(16))))
    for name in ("ex-a", "ex-b", "ex-c"):
        wait_for(lambda n=name: experts.serving(n, version), timeout=30, what=f"{name} serving")


def _three_and_a_client(
    experts: Pool, start_engine: Callable[..., EngineProc], *client_args: str
) -> tuple[list[EngineProc], EngineProc]:
    """Servers ex-a, ex-b, ex-c serving :func:`_three_servers_two_copies`'s map, and client
    att-1 (with ``client_args``)."""
    servers = _servers(experts, start_engine, "ex-a", "ex-b", "ex-c")
    _three_servers_two_copies(experts)
    return servers, _client(experts, start_engine, "att-1", *client_args)


def test_client_decodes_through_servers_one_message_per_pair(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    servers, client = _three_and_a_client(pool, start_engine)
    predicted = httpx.post(
        f"{client.url}/v1/attention/step", json={"batch": 8}, timeout=5, trust_env=False
    ).json()
    assert predicted["mapVersion"] == 1
    assert predicted["seconds"] > 0

    results = concurrent_streams(client, 8, 24)
    assert _failed(results) == []
    iterations = _iterations(client)
    messages = _metric(client, "matrixserve_engine_expert_messages_per_iteration_sum")
    print(f"\n{iterations:.0f} iterations, {messages:.0f} messages (3 servers)")
    assert iterations >= 23  # 24 tokens, the first from the prefill
    assert messages <= 3 * iterations
    for server in servers:
        received = _metric(
            server, "matrixserve_engine_expert_messages_received_total", '{outcome="served"}'
        )
        assert received > 0, server.name
        # one message per client per iteration: the server counts a second of the same pair
        # and iteration (its received total may run one iteration ahead of the client's
        # completed ones when read, so it is not compared with them)
        assert _metric(server, "matrixserve_engine_expert_repeated_messages_total") == 0
    assert _metric(client, "matrixserve_engine_expert_resends_total") == 0
    # its report carries its token counts from its next refresh on (a health interval)
    wait_for(
        lambda: (r := pool.report("ex-c")) is not None and sum(r.tokens.get(0, {}).values()) > 0,
        timeout=10,
        what="ex-c's report counting the tokens it served",
    )


def test_a_forward_probe_is_made_through_the_servers_and_timed_by_them(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    servers, client = _three_and_a_client(pool, start_engine)
    step = f"{client.url}/v1/attention/step"

    def served() -> list[float]:
        return [
            _metric(s, "matrixserve_engine_expert_messages_received_total", '{outcome="served"}')
            for s in servers
        ]

    def tokens() -> int:
        reports = [pool.report(n) for n in ("ex-a", "ex-b", "ex-c")]
        return sum(sum(sum(row.values()) for row in r.tokens.values()) for r in reports if r)

    for bad, field in (
        ({"batch": 4, "tokensPerRequest": 0}, "tokensPerRequest"),
        ({"batch": 4, "tokensPerRequest": "1024"}, "tokensPerRequest"),
        ({"batch": 4, "send": "yes"}, "send"),
        ({"batch": 100_000, "tokensPerRequest": 1024, "send": True}, "batch"),
    ):
        answer = httpx.post(step, json=bad, timeout=5, trust_env=False)
        assert answer.status_code == 400, (bad, answer.text)
        assert answer.json()["error"]["param"] == field, answer.text
    # one that would keep a server busy half the failover timeout (0.5 s) is refused: every
    # client would drop that healthy server; nothing sent
    huge = httpx.post(
        step, json={"batch": 1000, "tokensPerRequest": 1000, "send": True}, timeout=30
    )
    assert huge.status_code == 400, huge.text
    assert "half the failover timeout" in huge.json()["error"]["message"], huge.text
    assert served() == [0.0, 0.0, 0.0]

    body = {"batch": 4, "kvTokens": 0, "tokensPerRequest": 1024}
    predicted = httpx.post(step, json=body, timeout=5, trust_env=False).json()
    assert predicted["sent"] is False
    assert predicted["tokensPerRequest"] == 1024
    assert served() == [0.0, 0.0, 0.0]  # a prediction sends nothing
    before = tokens()
    made = httpx.post(step, json=body | {"send": True}, timeout=30, trust_env=False).json()
    print(f"\nprobe: predicted {predicted}, made {made}")
    assert made["sent"] is True
    assert served() == [1.0, 1.0, 1.0]  # one message per server: every server holds some
    assert _iterations(client) == 0  # a probe is no iteration of the batch's
    # the servers count its tokens (4 x 1024 tokens x top-4 over 3 MoE layers) in their
    # reports, rewritten every health interval
    wait_for(lambda: tokens() - before == 4 * 1024 * 4 * 3, timeout=30, what="tokens reported")
    # idle servers: the answers' MoE part is the prediction's, within the token rotation's
    # difference between two iterations
    assert made["moeSeconds"] > 0
    assert abs(made["moeSeconds"] / predicted["moeSeconds"] - 1) < 0.05
    assert made["seconds"] >= made["moeSeconds"]

    # beside a decoding batch: both go on (one iteration at a time), no stream fails
    with _decoding(client, 4, 40) as running:
        again = httpx.post(step, json=body | {"send": True}, timeout=30, trust_env=False)
        assert again.status_code == 200, again.text
        assert _failed(running.result()) == []


def test_server_killed_mid_decode_fails_no_stream(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    servers, client = _three_and_a_client(pool, start_engine)
    with _decoding(client, 8, 120) as running:
        os.kill(servers[2].pid, signal.SIGKILL)
        results = running.result()
    assert _failed(results) == []
    resends = _metric(client, "matrixserve_engine_expert_resends_total")
    failovers = sum(
        _metric(client, "matrixserve_engine_expert_failovers_total", f'{{why="{why}"}}')
        for why in ("gone", "timeout", "unreachable")
    )
    print(f"\nre-sends {resends:.0f}, failovers {failovers:.0f}")
    assert failovers >= 1
    assert resends >= 1 or _metric(
        client, "matrixserve_engine_expert_failovers_total", '{why="gone"}'
    )


def test_last_copy_gone_held_then_expert_uncovered(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    """Held for the failover timeout (2 emulated s, 0.2 wall s at this scale, floored at
    1 wall s), then failed with ``expert_uncovered``; admission refuses until a map covers
    them again."""
    servers = _servers(pool, start_engine, "ex-a", "ex-b")
    pool.write(1, ["ex-a", "ex-b"], every_layer(HALF_A, HALF_B))
    for name in ("ex-a", "ex-b"):
        wait_for(lambda n=name: pool.serving(n, 1), timeout=30, what=f"{name} serving")
    client = _client(pool, start_engine, "att-1", "--expert-failover-ms", "2000")
    with _decoding(client, 4, 400) as running:
        killed = time.monotonic()
        os.kill(servers[1].pid, signal.SIGKILL)
        results = running.result()
        ended = time.monotonic() - killed
    codes = {events[-1].get("code") for _, events in results}
    print(f"\nstreams ended {ended:.2f} wall s after the kill: {codes}")
    assert codes == {"expert_uncovered"}
    assert ended < 10  # the bound, not the session timeout's notice
    refused = httpx.post(
        f"{client.url}/v1/generate",
        json={"requestId": "late", "promptTokens": 8, "maxTokens": 4},
        timeout=10,
        trust_env=False,
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "expert_uncovered"
    # a map that covers them again (ex-a takes ex-b's experts): admitted, decoded
    pool.write(2, ["ex-a"], every_layer(list(range(16))), reason="failover of ex-b")
    wait_for(lambda: pool.serving("ex-a", 2), timeout=30, what="ex-a serving v2")
    assert _failed(concurrent_streams(client, 1, 8)) == []


def test_last_copy_gone_covered_within_the_bound_fails_nothing(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    servers = _servers(pool, start_engine, "ex-a", "ex-b", "ex-c")
    pool.write(1, ["ex-a", "ex-b", "ex-c"], every_layer(HALF_A, HALF_B, []))
    for name in ("ex-a", "ex-b", "ex-c"):
        wait_for(lambda n=name: pool.serving(n, 1), timeout=30, what=f"{name} serving")
    # a long bound (60 emulated s = 6 wall s): the controller's new map comes within it
    client = _client(pool, start_engine, "att-1", "--expert-failover-ms", "60000")
    with _decoding(client, 4, 120) as running:
        os.kill(servers[1].pid, signal.SIGKILL)
        wait_for(
            lambda: _metric(client, "matrixserve_engine_expert_halts_total", '{why="uncovered"}'),
            timeout=10,
            what="the iteration held",
        )
        pool.write(2, ["ex-a", "ex-c"], every_layer(HALF_A, HALF_B), reason="failover of ex-b")
        results = running.result()
    assert _failed(results) == []


def test_monolithic_halts_until_every_server_is_back(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    servers, client = _three_and_a_client(pool, start_engine, "--expert-mode", "monolithic")
    with _decoding(client, 4, 300) as running:
        os.kill(servers[2].pid, signal.SIGKILL)
        wait_for(
            lambda: _metric(client, "matrixserve_engine_expert_halts_total", '{why="monolithic"}'),
            timeout=15,
            what="the client halted",
        )
        before = _iterations(client)
        time.sleep(1.5)
        during = _iterations(client)
        assert during == before  # stopped: a replica exists, yet nothing runs
        servers[2].sup.stop("ex-c", grace=1)  # reap the killed process's record
        restarted = time.monotonic()
        pool.start_server(start_engine, "ex-c")
        wait_for(lambda: pool.serving("ex-c", 1), timeout=30, what="ex-c back")
        wait_for(
            lambda: _iterations(client) > during,
            timeout=15,
            what="iterations resumed",
        )
        print(f"\nresumed {time.monotonic() - restarted:.2f} wall s after the restart")
        results = running.result()
    assert _failed(results) == []
    assert EXPERTS == 16


def _failover_seconds(client: EngineProc) -> float:
    """The client's failover timeout in force (emulated s), as its step endpoint says."""
    answer = httpx.post(
        f"{client.url}/v1/attention/step", json={"batch": 1}, timeout=5, trust_env=False
    )
    return float(answer.json()["failoverSeconds"])


def test_the_pools_failover_timeout_in_the_pointer_wins_over_the_clients_own(
    pool: Pool,  # noqa: F811
    start_engine: Callable[..., EngineProc],
) -> None:
    """The client's own bound is 600 emulated s (60 wall s at this scale); the pointer rewritten
    with the pool's 1 ms (the same version) brings it to the wall floor (1 s): a hung server
    is dropped on timeout long before its session's end (the offline event) would say so."""
    servers, client = _three_and_a_client(pool, start_engine, "--expert-failover-ms", "600000")
    assert _failover_seconds(client) == 600  # no failoverMs in the pointer: its own
    pool.zk.set(pool.paths.map, zl.ExpertMapPointer(version=1, failoverMs=1).dump())
    wait_for(lambda: _failover_seconds(client) == 0.001, timeout=10, what="the pool's timeout")
    timeouts = '{why="timeout"}'
    with _decoding(client, 4, 200) as running:
        hung = time.monotonic()
        os.kill(servers[2].pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: _metric(client, "matrixserve_engine_expert_failovers_total", timeouts),
                timeout=5,
                what="the hung server dropped on timeout",
            )
            dropped = time.monotonic() - hung
            assert pool.report("ex-c") is not None  # still registered: the timeout dropped it
            results = running.result()
        finally:
            os.kill(servers[2].pid, signal.SIGCONT)
    print(f"\nhung server dropped {dropped:.2f} wall s after SIGSTOP (client's own bound 60 s)")
    assert _failed(results) == []
    assert _metric(client, "matrixserve_engine_expert_resends_total") >= 1
