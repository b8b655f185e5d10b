"""Forwarding to decode, the prefill's side (P/D-Serve §3.5-3.6): after the first token, the
request goes to a decode (round robin over the decodes the group's ``decode-meta`` names, less the
logically removed ones); a decode that is full (429) or refuses is passed over, and when every
decode refused, the prefill keeps the slot and the KV and tries again shortly (a finishing request
frees a decode slot). The decode's stream is relayed, its tokens renumbered after the prefill's
first and its ``done`` rewritten with the whole request's timings.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from enginestub.engine.kvpull import PendingKV
from enginestub.engine.parts import Part, Shared
from enginestub.engine.progress import Progress
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


class DecodeForwarder(Part):
    def __init__(self, shared: Shared, decodes: Callable[[], list[str]]) -> None:
        super().__init__(shared)
        self._decodes = decodes  # host:port of the decodes open to this prefill now
        self._turn = itertools.count()

    def candidates(self) -> list[str]:
        """The decodes to try, in this request's turn."""
        peers = self._decodes()
        if not peers:
            return []
        start = next(self._turn) % len(peers)
        return peers[start:] + peers[:start]

    async def relay(
        self, req: GenerateRequest, progress: Progress, pending: PendingKV
    ) -> AsyncIterator[Event]:
        """The rest of the request's stream, from the decode that takes it."""
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
                try:
                    async with self.http.stream(
                        "POST", f"http://{peer}/v1/decode", json=body
                    ) as response:
                        if response.status_code == 429:
                            continue
                        if response.status_code != 200:
                            text = (await response.aread()).decode(errors="replace")[:300]
                            log.warning(
                                "decode %s refused %s: %s %s",
                                peer,
                                req.request_id,
                                response.status_code,
                                text,
                            )
                            continue
                        got_done = False
                        async for line in response.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            event = json.loads(line[6:])
                            if event.get("type") == "token":
                                event["index"] += 1
                                event["t"] = progress.elapsed()
                            if event.get("type") == "done":
                                got_done = True
                                event = self._whole(req, progress, event)
                            yield event
                            if event.get("type") in LAST_EVENTS:
                                return
                        if not got_done:
                            yield error_event(
                                "decode_failed",
                                f"decode instance {peer} closed the stream before the end",
                            )
                            return
                except httpx.HTTPError as exc:
                    if pending.released.is_set():
                        yield error_event(
                            "decode_failed",
                            f"decode instance {peer} failed mid-stream: {type(exc).__name__}",
                        )
                        return
                    log.warning("decode %s unreachable for %s: %s", peer, req.request_id, exc)
                    continue
            # Every decode rejected: keep the slot and the KV, retry shortly (a finishing
            # request frees a decode slot, P/D-Serve §3.6).
            await self.clock.sleep(RETRY_SECONDS)

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
