"""Forwarding to decode, the prefill's side (P/D-Serve §3.5-3.6): after the first token, the
request goes to a decode (round robin over the decodes the group's ``decode-meta`` names, less the
logically removed ones); a decode that is full (429) or refuses is passed over, and when every
decode refused, the prefill keeps the slot and the KV and tries again shortly (a finishing request
frees a decode slot). The decode's stream is relayed, its tokens renumbered after the prefill's
first and its ``done`` rewritten with the whole request's timings.

Until a decode has pulled the KV, the wait is bounded (issue 16 finding 1): a decode answering,
even 429, is progress; decodes that cannot be reached, or take the request and never pull it,
end it with ``kv_pull_timeout`` after :func:`enginestub.engine.kvpull.kv_wait_bound` without
progress, and the slot is free. Closing the relay (its caller gone) closes the connection to
the decode, whose handler is cancelled in turn (finding 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import httpx

from enginestub.engine.kvpull import PendingKV, kv_wait_bound
from enginestub.engine.parts import Part, Shared
from enginestub.engine.progress import Progress
from matrixserve.api import zk_layout as zl
from matrixserve.api.engine_protocol import (
    LAST_EVENTS,
    Event,
    GenerateRequest,
    PrefillRef,
    decode_body,
    error_event,
)

log = logging.getLogger("enginestub.engine")
RETRY_SECONDS = 0.005  # emulated: after every decode refused
_T = TypeVar("_T")


class DecodeForwarder(Part):
    def __init__(
        self,
        shared: Shared,
        decodes: Callable[[], list[str]],
        entries: Callable[[], Sequence[zl.MapEntry]] = list,
    ) -> None:
        super().__init__(shared)
        self._decodes = decodes  # host:port of the decodes open to this prefill now
        self._entries = entries  # the decode meta's: who is at which host:port
        self._turn = itertools.count()

    def _named(self, event: Event, peer: str) -> Event:
        """An error of a stream the decode at ``peer`` took, naming that decode (issue 17: the
        gateway passes the instances on, so a client tells a failure on a faulty instance from
        one elsewhere)."""
        names = {f"{e.pod_ip}:{e.port}": e.instance for e in self._entries()}
        on = {"prefill": self.config.instance, "decode": names.get(peer)}
        return event | {"instances": on} if event.get("type") == "error" else event

    def candidates(self) -> list[str]:
        """The decodes to try, in this request's turn."""
        peers = self._decodes()
        if not peers:
            return []
        start = next(self._turn) % len(peers)
        return peers[start:] + peers[:start]

    async def relay(
        self, req: GenerateRequest, progress: Progress, pending: PendingKV
    ) -> AsyncGenerator[Event, None]:
        """The rest of the request's stream, from the decode that takes it. Until a decode has
        pulled the KV, every wait is bounded by :func:`kv_wait_bound` counted from the request's
        last progress (prefill done, a decode answering, its pull starting): a decode that
        refuses (429) is alive and busy, and the prefill keeps trying; decodes that cannot be
        reached or do not answer make it give up with ``kv_pull_timeout``."""
        cfg = self.config
        body = decode_body(
            req.request_id,
            req.prompt_tokens,
            req.max_tokens - 1,
            PrefillRef(f"{cfg.host}:{cfg.port}", cfg.instance, tuple(cfg.roce_ips)),
        )
        while True:
            candidates = self.candidates()
            if not candidates:
                yield error_event("no_decode", "no decode instance is available to this prefill")
                return
            for peer in candidates:
                request = self.http.build_request("POST", f"http://{peer}/v1/decode", json=body)
                try:
                    response = await self._within(pending, self.http.send(request, stream=True))
                except TimeoutError:
                    yield self._gave_up(pending)
                    return
                except httpx.HTTPError as exc:
                    log.warning("decode %s unreachable for %s: %s", peer, req.request_id, exc)
                    continue
                try:
                    if response.status_code == 429:
                        pending.ticket.progressed()  # a live decode, full: busy, not stuck
                        continue
                    if response.status_code != 200:
                        text = await self._within(pending, response.aread())
                        log.warning(
                            "decode %s refused %s: %s %s",
                            peer,
                            req.request_id,
                            response.status_code,
                            text.decode(errors="replace")[:300],
                        )
                        continue
                    pending.ticket.progressed()  # a decode took it
                    async with contextlib.aclosing(
                        self._events(req, progress, pending, response)
                    ) as events:
                        async for event in events:
                            yield self._named(event, peer)
                            if event.get("type") in LAST_EVENTS:
                                return
                    yield self._named(
                        error_event(
                            "decode_failed",
                            f"decode instance {peer} closed the stream before the end",
                        ),
                        peer,
                    )
                    return
                except TimeoutError:  # named if the decode had taken it (it never pulled)
                    gave_up = self._gave_up(pending)
                    yield self._named(gave_up, peer) if response.status_code == 200 else gave_up
                    return
                except httpx.HTTPError as exc:
                    if pending.released.is_set():
                        yield self._named(
                            error_event(
                                "decode_failed",
                                f"decode instance {peer} failed mid-stream: {type(exc).__name__}",
                            ),
                            peer,
                        )
                        return
                    log.warning("decode %s failed for %s: %s", peer, req.request_id, exc)
                    continue
                finally:
                    await response.aclose()
            # Every decode refused: keep the slot and the KV, retry shortly (a finishing
            # request frees a decode slot, P/D-Serve §3.6) - within the bound.
            if self._left(pending) <= 0:
                yield self._gave_up(pending)
                return
            await self.clock.sleep(RETRY_SECONDS)

    async def _events(
        self,
        req: GenerateRequest,
        progress: Progress,
        pending: PendingKV,
        response: httpx.Response,
    ) -> AsyncGenerator[Event, None]:
        """The decode's events, renumbered after the prefill's first token."""
        lines = response.aiter_lines()
        while True:
            try:
                line = await self._within(pending, anext(lines))
            except StopAsyncIteration:
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "token":
                event["index"] += 1
                event["t"] = progress.elapsed()
            if event.get("type") == "done":
                event = self._whole(req, progress, event)
            yield event

    def _bound(self) -> float:
        return kv_wait_bound(self.config, self.faults.slow_factor)

    def _left(self, pending: PendingKV) -> float:
        """Emulated seconds left before the wait for a decode to pull the KV gives up."""
        hold = pending.ticket.hold
        idle = hold.idle(self.clock.now()) if hold is not None else 0.0
        return self._bound() - idle

    async def _within(self, pending: PendingKV, step: Awaitable[_T]) -> _T:
        """``step``, within what is left of the bound while the KV waits for its pull
        (unbounded once pulled: the slot is free, and the gateway watches a silent stream)."""
        if pending.released.is_set():
            return await step
        async with asyncio.timeout(max(self.clock.to_wall(self._left(pending)), 0.0)):
            return await step

    def _gave_up(self, pending: PendingKV) -> Event:
        self.metrics.requests.labels(stage="prefill", outcome="kv_timeout").inc()
        return error_event(
            "kv_pull_timeout",
            f"no decode took the request and pulled its KV within {self._bound():.3f}s "
            "of its last progress (the KV-pull wait bound)",
        )

    @staticmethod
    def _whole(req: GenerateRequest, progress: Progress, decoded: Event) -> Event:
        """The decode's ``done`` as the whole request's: the prefill's first token counted, its
        TTFT and prefill time, the decode's TPOT and KV transfer."""
        timings = decoded["timings"]
        return progress.done(
            req,
            decoded["usage"]["completionTokens"] + 1,
            [timings["tpotMean"]] if timings["tpotMean"] else [],
            timings["kvTransfer"],
            decoded["instances"]["decode"],
        )
