"""The serving engine: prefill without a queue, KV pulled by decode, continuous-batching decode.

P/D-Serve §3.5-3.6 as the engine sees it:

- **Prefill accepts or rejects**, never queues: a request is accepted only if a slot is free,
  and "a prompt continuously occupies one slot in prefill if it is waiting for KVCache transfer
  to a decoding". Prefill time comes from :mod:`enginestub.timing`; concurrent prompts share the
  instance's compute (processor sharing), so TTFT grows with the batch as it does on hardware.
- **Decode pulls the KV** ("asynchronous retrieval") over the fabric once it has a batch slot and
  HBM for the request; the transfer shares the decode's ingress (and the prefill's egress) fairly.
  The request joins the running batch at the next iteration.
- **Decode runs continuous batching**: one step emits a token for every running request; the step
  time is the model's TPOT for the current batch and mean context, scheduled on absolute
  deadlines so event-loop overhead does not accumulate into the reported timings.
- **Faults**: the node's device status file (P/D-Serve §3.4) is polled; a die of this instance
  going unhealthy fails its in-flight requests with a clear error and stops admission. Injected
  faults (slow, hang, link down, HBM error) work through :meth:`Engine.inject`.

Every time here is emulated seconds (see :mod:`.clock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from enginestub import timing
from enginestub.engine.clock import Clock
from enginestub.engine.config import EngineConfig
from enginestub.engine.metrics import EngineMetrics
from enginestub.engine.sharing import SharedResource
from enginestub.fabric import Plane, link_bandwidth, link_latency
from matrixserve.api.engine_protocol import count_tokens

log = logging.getLogger("enginestub.engine")

WORDS = ("the", "model", "serves", "tokens", "on", "emulated", "dies", "of", "a", "superpod")
FAULT_KINDS = ("die-down", "link-down", "slow", "hang", "hbm-error")


class EngineError(Exception):
    """A request the engine will not take, with an HTTP status and a machine-readable code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


def synthetic_token(request_id: str, index: int) -> str:
    return WORDS[(hash(request_id) + index) % len(WORDS)] + " "


@dataclass
class GenerateRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    ttft_budget: float | None = None  # emulated seconds the caller still allows for the first token
    queued: bool = False  # admitted into the local queue (admission "queue"): no slot yet
    admission: str | None = None  # "reject" or "queue" for this request; None: the engine's own
    deadline: float | None = None  # emulated time the first token is due by (set on admission)

    @classmethod
    def parse(cls, body: Any, max_prompt: int, max_output: int) -> GenerateRequest:
        if not isinstance(body, dict):
            raise EngineError(400, "invalid_request", "body must be a JSON object")
        rid = body.get("requestId")
        if not isinstance(rid, str) or not 0 < len(rid) <= 200:
            raise EngineError(
                400, "invalid_request", "requestId must be a non-empty string (<= 200 chars)"
            )
        if "promptTokens" in body:
            tokens = body["promptTokens"]
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
                raise EngineError(400, "invalid_request", "promptTokens must be a positive integer")
        elif isinstance(body.get("prompt"), str) and body["prompt"]:
            tokens = count_tokens(body["prompt"])
        else:
            raise EngineError(
                400, "invalid_request", "give prompt (non-empty string) or promptTokens"
            )
        if tokens > max_prompt:
            raise EngineError(
                413,
                "prompt_too_long",
                f"prompt has {tokens} tokens; this engine takes at most {max_prompt}",
            )
        max_tokens = body.get("maxTokens", 16)
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or not 1 <= max_tokens <= max_output
        ):
            raise EngineError(
                400, "invalid_request", f"maxTokens must be an integer in 1..{max_output}"
            )
        budget = body.get("ttftBudget")
        if budget is not None and (not isinstance(budget, int | float) or budget <= 0):
            raise EngineError(
                400, "invalid_request", "ttftBudget must be a positive number of seconds"
            )
        admission = body.get("admission")
        if admission not in (None, "reject", "queue"):
            raise EngineError(400, "invalid_request", 'admission must be "reject" or "queue"')
        return cls(
            rid,
            tokens,
            max_tokens,
            float(budget) if budget is not None else None,
            admission=admission,
        )


@dataclass(eq=False)
class Sequence:
    """One request in the decode batch."""

    request_id: str
    kv_tokens: int
    remaining: int
    events: asyncio.Queue[dict[str, Any] | None]
    emitted: int = 0
    first_step_at: float = 0.0
    last_token_at: float = 0.0
    failed: bool = False


@dataclass
class PendingKV:
    """KV a prefill holds for a decode to pull."""

    request_id: str
    nbytes: float
    tokens: int
    released: asyncio.Event = field(default_factory=asyncio.Event)
    request: GenerateRequest | None = None  # whose prefill slot is held until the pull is done


class Engine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None) -> None:
        self.config = config
        self.clock = Clock(config.time_scale)
        self.metrics = metrics or EngineMetrics(config.role)
        self.role = config.role
        self.shape = config.shape
        self.loaded = False
        self.load_seconds: float | None = None
        self.faults: dict[str, dict[str, Any]] = {}
        self.unhealthy_dies: dict[int, str] = {}
        self.device_links_down: set[str] = set()  # peer RoCE IPs our dies lost a link to
        self.decode_peers: list[str] = list(config.decode_peers)
        self.removed: set[str] = set()
        self.on_health_change: Callable[[], None] = lambda: None
        plane_bw = link_bandwidth(config.kv_plane, same_node=False)
        self.kv_ingress = SharedResource(self.clock, plane_bw * len(config.dies))
        self.kv_egress_flows = 0
        self.compute = SharedResource(self.clock, 1.0)  # 1 emulated second of work per second
        self.prefill_slots = 0
        self.prefill_queue = 0
        self._slot_freed = asyncio.Event()
        self.pending_kv: dict[str, PendingKV] = {}
        self.kv_reserved = 0.0
        self.running: list[Sequence] = []
        self.joining: list[Sequence] = []
        self._decode_wake = asyncio.Event()
        self._decode_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._hung = asyncio.Event()
        self._hung.set()  # set = not hung
        self._peer_rr = itertools.count()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), trust_env=False)
        self.metrics.hbm_capacity.set(config.kv_capacity_bytes + config.weights_bytes)

    # ================================================================ lifecycle
    async def start(self) -> None:
        self._decode_task = asyncio.create_task(self._decode_loop(), name="decode-loop")
        if self.config.device_status_file is not None:
            self._watch_task = asyncio.create_task(self._watch_device_file(), name="device-file")

    async def close(self) -> None:
        for task in (self._decode_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.http.aclose()

    async def load_model(
        self, source: timing.LoadSource | None = None, concurrent: int | None = None
    ) -> float:
        """Load the weights (emulated time from the source's bandwidth); returns the seconds."""
        source = source or self.config.load_source
        seconds = timing.load_seconds(
            self.config.model, self.shape, source, concurrent or self.config.concurrent_loaders
        )
        started = self.clock.now()
        await self.clock.sleep(seconds)
        self.load_seconds = self.clock.now() - started
        self.loaded = True
        self.metrics.load_seconds.labels(source=str(source)).set(self.load_seconds)
        self.metrics.hbm_used.set(self.config.weights_bytes)
        log.info(
            "model %s loaded from %s in %.2f emulated s",
            self.config.model.name,
            source,
            self.load_seconds,
        )
        return self.load_seconds

    # ================================================================ health
    @property
    def serving(self) -> bool:
        return self.loaded and not self.unhealthy_dies and "hbm-error" not in self.faults

    def health(self) -> dict[str, Any]:
        return {
            "instance": self.config.instance,
            "role": self.role,
            "loaded": self.loaded,
            "serving": self.serving,
            "unhealthyDies": {str(k): v for k, v in sorted(self.unhealthy_dies.items())},
            "faults": self.faults,
            "prefillSlots": {"used": self.prefill_slots, "max": self.config.max_batch},
            "prefillQueue": self.prefill_queue,
            "decodeBatch": {
                "running": len(self.running),
                "joining": len(self.joining),
                "max": self.config.max_batch,
            },
            "kvReservedBytes": self.kv_reserved,
            "kvEgressFlows": self.kv_egress_flows,
        }

    async def wait_not_hung(self) -> None:
        await self._hung.wait()

    def _check_serving(self) -> None:
        if not self.loaded:
            raise EngineError(503, "not_ready", "the model is not loaded yet")
        if self.unhealthy_dies:
            dies = ", ".join(f"{d} ({why})" for d, why in sorted(self.unhealthy_dies.items()))
            raise EngineError(503, "device_fault", f"die fault on this instance: {dies}")
        if "hbm-error" in self.faults:
            raise EngineError(503, "device_fault", "HBM error on this instance")

    # ================================================================ faults
    def inject(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        if kind not in FAULT_KINDS:
            raise EngineError(
                400, "invalid_fault", f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}"
            )
        if kind == "slow":
            factor = params.get("factor")
            if not isinstance(factor, int | float) or not 1 <= factor <= 1000:
                raise EngineError(400, "invalid_fault", "slow needs factor in 1..1000")
        if kind == "die-down":
            die = params.get("die")
            if die not in self.config.dies:
                raise EngineError(
                    400,
                    "invalid_fault",
                    f"die must be one of this instance's dies {self.config.dies}",
                )
            self.unhealthy_dies[int(die)] = "DIE_DOWN (injected)"
        if kind == "link-down":
            peer = params.get("peerRoceIp")
            if not isinstance(peer, str):
                raise EngineError(400, "invalid_fault", "link-down needs peerRoceIp")
            self.device_links_down.add(peer)
        if kind == "hang":
            self._hung.clear()
        self.faults[kind] = params
        self.metrics.faults.labels(kind=kind).set(1)
        if kind in ("die-down", "hbm-error"):
            self._fail_running(f"{kind} on this instance")
        self.on_health_change()
        return self.health()

    def heal(self, kind: str) -> dict[str, Any]:
        if kind not in FAULT_KINDS:
            raise EngineError(400, "invalid_fault", f"unknown fault {kind!r}")
        params = self.faults.pop(kind, None)
        if kind == "die-down" and params is not None:
            self.unhealthy_dies.pop(int(params["die"]), None)
        if kind == "link-down" and params is not None:
            self.device_links_down.discard(params["peerRoceIp"])
        if kind == "hang":
            self._hung.set()
        self.metrics.faults.labels(kind=kind).set(0)
        self.on_health_change()
        return self.health()

    @property
    def slow_factor(self) -> float:
        return float(self.faults.get("slow", {}).get("factor", 1.0))

    def _fail_running(self, why: str) -> None:
        for seq in [*self.running, *self.joining]:
            seq.failed = True
            seq.events.put_nowait({"type": "error", "code": "device_fault", "message": why})
            seq.events.put_nowait(None)
            self._release_kv(seq.kv_tokens + seq.remaining)
            self.metrics.requests.labels(stage="decode", outcome="failed").inc()
        self.running.clear()
        self.joining.clear()

    async def _watch_device_file(self) -> None:
        """P/D-Serve §3.4: the node's fault detector writes the device status; we read it."""
        path = self.config.device_status_file
        assert path is not None
        mine = set(self.config.dies)
        last_generation = -1
        last_stamp: tuple[int, int] | None = None
        while True:
            data = None
            try:
                st = path.stat()
                if (st.st_mtime_ns, st.st_size) != last_stamp:
                    data = json.loads(path.read_text())
                    last_stamp = (st.st_mtime_ns, st.st_size)
            except (OSError, ValueError):
                data = None
            if data is not None and data.get("generation") != last_generation:
                last_generation = data.get("generation", -1)
                faulted: dict[int, str] = {}
                for npu in data.get("npus", []):
                    for die in npu.get("dies", []):
                        if die["id"] in mine and die.get("health") != "Healthy":
                            faulted[die["id"]] = (
                                ",".join(f["code"] for f in die.get("faults", [])) or "Unhealthy"
                            )
                links = {
                    link["peerRoceIp"]
                    for link in data.get("links", [])
                    if link.get("die") in mine and link.get("health") == "Down"
                }
                injected = {
                    int(p["die"]): "DIE_DOWN (injected)"
                    for k, p in self.faults.items()
                    if k == "die-down"
                }
                newly = set(faulted) - set(self.unhealthy_dies)
                self.unhealthy_dies = {**faulted, **injected}
                self.device_links_down = links | {
                    p["peerRoceIp"] for k, p in self.faults.items() if k == "link-down"
                }
                if newly:
                    why = ", ".join(f"die {d}: {faulted[d]}" for d in sorted(newly))
                    log.warning("device fault on this instance: %s", why)
                    self._fail_running(f"device fault: {why}")
                self.on_health_change()
            await asyncio.sleep(0.1)

    # ================================================================ KV accounting
    def _kv_bytes(self, tokens: int) -> float:
        return timing.kv_bytes(self.config.model, tokens)

    def _reserve_kv(self, tokens: int) -> bool:
        need = self._kv_bytes(tokens)
        if self.kv_reserved + need > self.config.kv_capacity_bytes:
            return False
        self.kv_reserved += need
        self.metrics.hbm_used.set(self.config.weights_bytes + self.kv_reserved)
        return True

    def _release_kv(self, tokens: int) -> None:
        self.kv_reserved = max(0.0, self.kv_reserved - self._kv_bytes(tokens))
        self.metrics.hbm_used.set(self.config.weights_bytes + self.kv_reserved)

    # ================================================================ prefill
    def admit_prefill(self, req: GenerateRequest) -> None:
        """Accept (take a slot) or raise: P/D-Serve's prefill never queues."""
        self._check_serving()
        if self.role not in ("prefill", "colocated"):
            raise EngineError(409, "wrong_role", f"this instance is a {self.role} instance")
        if self._kv_bytes(req.prompt_tokens) > self.config.kv_capacity_bytes:
            raise EngineError(
                413, "prompt_too_long", "the prompt's KV cache does not fit this instance's HBM"
            )
        if req.ttft_budget is not None:
            req.deadline = self.clock.now() + req.ttft_budget
        if (req.admission or self.config.admission) == "queue":  # the baseline: a local queue
            req.queued = True
            self.prefill_queue += 1
            self.metrics.requests.labels(stage="prefill", outcome="queued").inc()
            return
        if self.prefill_slots >= self.config.max_batch:
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            raise EngineError(
                429,
                "rejected",
                f"prefill busy: {self.prefill_slots}/{self.config.max_batch} slots in use",
            )
        if req.deadline is not None and not self.compute.admits(
            self._prefill_work(req), req.deadline
        ):
            # Early intervention (P/D-Serve §2.2.2) at admission: a prompt that cannot get its
            # first token within its budget beside the prompts in prefill (processor sharing,
            # nothing else arriving), or that would make one of them miss its own, is refused
            # now, while the gateway can still try another prefill, instead of failing the
            # check after prefill.
            self.metrics.requests.labels(stage="prefill", outcome="rejected_deadline").inc()
            raise EngineError(
                429,
                "rejected",
                f"prefill busy: beside the {self.compute.active} prompt(s) in prefill the first "
                f"token would miss its {req.ttft_budget:.3f}s budget, or make one of them miss "
                "its own",
            )
        if not self._reserve_kv(req.prompt_tokens):
            self.metrics.requests.labels(stage="prefill", outcome="rejected").inc()
            raise EngineError(
                429, "rejected", "prefill busy: no HBM left for another prompt's KV cache"
            )
        self.prefill_slots += 1
        self.metrics.requests.labels(stage="prefill", outcome="accepted").inc()
        self.metrics.prefill_slots.set(self.prefill_slots)

    def _free_prefill_slot(self, req: GenerateRequest) -> None:
        self.prefill_slots -= 1
        self._release_kv(req.prompt_tokens)
        self.metrics.prefill_slots.set(self.prefill_slots)
        self._slot_freed.set()

    async def _wait_for_slot(self, req: GenerateRequest) -> None:
        """Queue mode: FIFO-ish wait until a slot and the prompt's KV fit."""
        try:
            while self.prefill_slots >= self.config.max_batch or not self._reserve_kv(
                req.prompt_tokens
            ):
                self._slot_freed.clear()
                await self._slot_freed.wait()
        finally:
            self.prefill_queue -= 1
        self.prefill_slots += 1
        req.queued = False
        self.metrics.prefill_slots.set(self.prefill_slots)

    def _prefill_work(self, req: GenerateRequest) -> float:
        """The prompt's prefill alone on this instance (emulated seconds of its compute)."""
        return (
            timing.prefill_seconds(self.config.model, self.shape, req.prompt_tokens)
            * self.slow_factor
        )

    async def _run_prefill(self, req: GenerateRequest) -> float:
        return await self.compute.consume(self._prefill_work(req), deadline=req.deadline)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """A request accepted by :meth:`admit_prefill`: prefill, then decode (here or remote)."""
        started = self.clock.now()
        slot_held = not req.queued
        try:
            if req.queued:  # time in the local queue counts toward TTFT, as in the baseline
                await self._wait_for_slot(req)
                slot_held = True
                waited = self.clock.now() - started
                if req.ttft_budget is not None and waited > req.ttft_budget:
                    # P/D-Serve §2.2.2 early intervention: checked before prefill too, so a prompt
                    # whose budget ran out in the queue does not use the prefill.
                    self.metrics.requests.labels(stage="prefill", outcome="timeout").inc()
                    yield {
                        "type": "error",
                        "code": "ttft_timeout",
                        "message": f"waited {waited:.3f}s in the prefill queue, over the "
                        f"{req.ttft_budget:.3f}s budget; not prefilled",
                    }
                    return
            prefill_time = await self._run_prefill(req)
            ttft = self.clock.now() - started
            self.metrics.ttft.observe(ttft)
            if req.ttft_budget is not None and ttft > req.ttft_budget:
                # P/D-Serve §3.3: timeouts are checked before and after prefill, not during.
                self.metrics.requests.labels(stage="prefill", outcome="timeout").inc()
                yield {
                    "type": "error",
                    "code": "ttft_timeout",
                    "message": f"first token after {ttft:.3f}s exceeds the {req.ttft_budget:.3f}s budget",
                }
                return
            yield {
                "type": "token",
                "index": 0,
                "text": synthetic_token(req.request_id, 0),
                "t": ttft,
            }
            if req.max_tokens == 1:
                yield self._done(req, 1, started, ttft, prefill_time, [], 0.0, self.config.instance)
                return
            if self.role == "colocated":
                seq = self._new_sequence(req.request_id, req.prompt_tokens, req.max_tokens - 1)
                self._free_prefill_slot(req)
                slot_held = False
                if not self._reserve_kv(req.prompt_tokens + req.max_tokens - 1):
                    yield {
                        "type": "error",
                        "code": "kv_exhausted",
                        "message": "no HBM left to decode this request",
                    }
                    return
                self._join(seq)
                async for event in self._stream_sequence(
                    seq, req, started, ttft, prefill_time, 0.0, self.config.instance
                ):
                    yield event
                return
            # The slot (and the KV) is held until a decode has pulled the KV (P/D-Serve §3.5: "a
            # prompt continuously occupies one slot in prefill if it is waiting for KVCache
            # transfer"); kv_release frees it then, while this stream relays the decode's tokens.
            pending = PendingKV(
                req.request_id, self._kv_bytes(req.prompt_tokens), req.prompt_tokens, request=req
            )
            self.pending_kv[req.request_id] = pending
            slot_held = False  # the pending KV owns it now
            try:
                async for event in self._forward_to_decode(
                    req, started, ttft, prefill_time, pending
                ):
                    yield event
            finally:
                self.pending_kv.pop(req.request_id, None)
                self._free_pending_slot(pending)
        finally:
            if slot_held:
                self._free_prefill_slot(req)

    def _free_pending_slot(self, pending: PendingKV) -> None:
        if pending.request is not None:
            self._free_prefill_slot(pending.request)
            pending.request = None

    def _done(
        self,
        req: GenerateRequest,
        tokens: int,
        started: float,
        ttft: float,
        prefill: float,
        tpots: list[float],
        kv: float,
        decode_instance: str,
    ) -> dict[str, Any]:
        e2e = self.clock.now() - started
        return {
            "type": "done",
            "usage": {"promptTokens": req.prompt_tokens, "completionTokens": tokens},
            "timings": {
                "ttft": ttft,
                "prefill": prefill,
                "kvTransfer": kv,
                "tpotMean": sum(tpots) / len(tpots) if tpots else 0.0,
                "e2e": e2e,
            },
            "instances": {"prefill": self.config.instance, "decode": decode_instance},
        }

    def _decode_candidates(self) -> list[str]:
        peers = [p for p in self.decode_peers if p not in self.removed]
        if not peers:
            return []
        start = next(self._peer_rr) % len(peers)
        return peers[start:] + peers[:start]

    async def _forward_to_decode(
        self,
        req: GenerateRequest,
        started: float,
        ttft: float,
        prefill_time: float,
        pending: PendingKV,
    ) -> AsyncIterator[dict[str, Any]]:
        body = {
            "requestId": req.request_id,
            "promptTokens": req.prompt_tokens,
            "maxTokens": req.max_tokens - 1,
            "prefill": {
                "address": f"{self.config.host}:{self.config.port}",
                "instance": self.config.instance,
                "roceIps": self.config.roce_ips,
            },
        }
        while True:
            candidates = self._decode_candidates()
            if not candidates:
                yield {
                    "type": "error",
                    "code": "no_decode",
                    "message": "no decode instance is available to this prefill",
                }
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
                                event["t"] = self.clock.now() - started
                            if event.get("type") == "done":
                                got_done = True
                                timings = event["timings"]
                                event = self._done(
                                    req,
                                    event["usage"]["completionTokens"] + 1,
                                    started,
                                    ttft,
                                    prefill_time,
                                    [timings["tpotMean"]] if timings["tpotMean"] else [],
                                    timings["kvTransfer"],
                                    event["instances"]["decode"],
                                )
                            yield event
                            if event.get("type") in ("done", "error"):
                                return
                        if not got_done:
                            yield {
                                "type": "error",
                                "code": "decode_failed",
                                "message": f"decode instance {peer} closed the stream before the end",
                            }
                            return
                except httpx.HTTPError as exc:
                    if pending.released.is_set():
                        yield {
                            "type": "error",
                            "code": "decode_failed",
                            "message": f"decode instance {peer} failed mid-stream: {type(exc).__name__}",
                        }
                        return
                    log.warning("decode %s unreachable for %s: %s", peer, req.request_id, exc)
                    continue
            # Every decode rejected: keep the slot and the KV, retry shortly (a finishing
            # request frees a decode slot, P/D-Serve §3.6).
            await self.clock.sleep(0.005)

    # ================================================================ KV pull (prefill side)
    def kv_pull_meta(self, request_id: str) -> dict[str, Any]:
        pending = self.pending_kv.get(request_id)
        if pending is None:
            raise EngineError(404, "unknown_request", f"no KV held for request {request_id}")
        self.kv_egress_flows += 1
        return {
            "bytes": pending.nbytes,
            "tokens": pending.tokens,
            "egressFlows": self.kv_egress_flows,
            "roceIps": self.config.roce_ips,
            "node": self.config.node,
            "superpod": self.config.superpod,
        }

    def kv_release(self, request_id: str, nbytes: float) -> None:
        self.kv_egress_flows = max(0, self.kv_egress_flows - 1)
        pending = self.pending_kv.get(request_id)
        if pending is not None:
            pending.released.set()
            self._free_pending_slot(pending)
        self.metrics.kv_bytes.labels(plane=str(self.config.kv_plane), direction="out").inc(nbytes)

    # ================================================================ decode
    def _new_sequence(self, request_id: str, kv_tokens: int, remaining: int) -> Sequence:
        return Sequence(request_id, kv_tokens, remaining, asyncio.Queue())

    def admit_decode(self, req: GenerateRequest) -> None:
        self._check_serving()
        if self.role != "decode":
            raise EngineError(409, "wrong_role", f"this instance is a {self.role} instance")
        if len(self.running) + len(self.joining) >= self.config.max_batch:
            self.metrics.requests.labels(stage="decode", outcome="rejected").inc()
            raise EngineError(429, "rejected", f"decode batch full: {self.config.max_batch}")
        if not self._reserve_kv(req.prompt_tokens + req.max_tokens):
            self.metrics.requests.labels(stage="decode", outcome="rejected").inc()
            raise EngineError(
                429, "rejected", "decode HBM full: no room for this request's KV cache"
            )
        self.metrics.requests.labels(stage="decode", outcome="accepted").inc()

    async def pull_kv(self, request_id: str, prefill: dict[str, Any]) -> float:
        """Retrieve the KV from the prefill over the fabric (P/D-Serve §3.6); emulated seconds."""
        address = prefill["address"]
        peer_ips = prefill.get("roceIps") or []
        broken = [ip for ip in peer_ips if ip in self.device_links_down]
        if broken:
            raise EngineError(
                502,
                "link_down",
                f"RoCE link to the prefill's device(s) {', '.join(broken)} is down",
            )
        response = await self.http.post(f"http://{address}/v1/kv/{request_id}/pull")
        if response.status_code != 200:
            raise EngineError(
                502,
                "kv_pull_failed",
                f"prefill answered {response.status_code}: {response.text[:200]}",
            )
        meta = response.json()
        nbytes = float(meta["bytes"])
        plane = self.config.kv_plane
        if plane is Plane.UB and meta.get("superpod") != self.config.superpod:
            plane = Plane.ROCE  # UB only reaches inside one SuperPod
        per_die = link_bandwidth(plane, same_node=meta.get("node") == self.config.node)
        egress_cap = (
            per_die
            * len(meta.get("roceIps") or self.config.dies)
            / max(int(meta["egressFlows"]), 1)
        )
        await self.clock.sleep(link_latency(plane, meta.get("node") == self.config.node))
        seconds = await self.kv_ingress.consume(nbytes * self.slow_factor, cap=egress_cap)
        self.metrics.kv_bytes.labels(plane=str(plane), direction="in").inc(nbytes)
        self.metrics.kv_seconds.observe(seconds)
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(
                f"http://{address}/v1/kv/{request_id}/release", json={"bytes": nbytes}
            )
        return seconds

    def _join(self, seq: Sequence) -> None:
        self.joining.append(seq)
        self._decode_wake.set()

    async def decode(
        self, req: GenerateRequest, prefill: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        started = self.clock.now()
        reserved = req.prompt_tokens + req.max_tokens
        try:
            kv_seconds = await self.pull_kv(req.request_id, prefill)
        except EngineError as exc:
            self._release_kv(reserved)
            yield {"type": "error", "code": exc.code, "message": exc.message}
            return
        except httpx.HTTPError as exc:
            self._release_kv(reserved)
            yield {
                "type": "error",
                "code": "kv_pull_failed",
                "message": f"prefill unreachable: {type(exc).__name__}",
            }
            return
        seq = self._new_sequence(req.request_id, req.prompt_tokens, req.max_tokens)
        self._join(seq)
        async for event in self._stream_sequence(
            seq, req, started, 0.0, 0.0, kv_seconds, self.config.instance
        ):
            yield event

    async def _stream_sequence(
        self,
        seq: Sequence,
        req: GenerateRequest,
        started: float,
        ttft: float,
        prefill: float,
        kv: float,
        instance: str,
    ) -> AsyncIterator[dict[str, Any]]:
        tpots: list[float] = []
        offset = 1 if self.role == "colocated" else 0
        try:
            while True:
                event = await seq.events.get()
                if event is None:
                    break
                if event["type"] == "token":
                    tpots.append(event.pop("tpot"))
                    event["index"] += offset
                    event["t"] = self.clock.now() - started
                yield event
                if event["type"] == "error":
                    return
            tokens = seq.emitted + offset
            yield self._done(req, tokens, started, ttft, prefill, tpots, kv, instance)
        finally:
            if not seq.failed and seq.remaining > 0:  # the client went away: leave the batch
                seq.failed = True
                with contextlib.suppress(ValueError):
                    self.running.remove(seq)
                with contextlib.suppress(ValueError):
                    self.joining.remove(seq)
                self._release_kv(seq.kv_tokens + seq.remaining)

    async def _decode_loop(self) -> None:
        """Continuous batching: one token per running request per step (absolute deadlines)."""
        deadline = self.clock.now()
        while True:
            if not self.running and not self.joining:
                self._decode_wake.clear()
                await self._decode_wake.wait()
                deadline = self.clock.now()
            await self._hung.wait()
            if self.joining:
                self.running.extend(self.joining)
                self.joining.clear()
            batch = [s for s in self.running if not s.failed]
            self.running = batch
            if not batch:
                continue
            kv_mean = sum(s.kv_tokens for s in batch) / len(batch)
            step = timing.tpot(
                self.config.model, self.shape, len(batch) / self.shape.npus, int(kv_mean)
            )
            step *= self.slow_factor
            self.metrics.batch_size.set(len(batch))
            if self.config.step_scheduling == "relative":
                await self.clock.sleep(step)  # baseline: the loop's own overhead adds to every step
            else:
                deadline = max(deadline + step, self.clock.now() - step)  # never burst to catch up
                await self.clock.sleep_until(deadline)
            now = self.clock.now()
            for seq in batch:
                if seq.failed:
                    continue
                seq.kv_tokens += 1
                seq.remaining -= 1
                tpot = now - seq.last_token_at if seq.emitted else step
                seq.last_token_at = now
                seq.events.put_nowait(
                    {
                        "type": "token",
                        "index": seq.emitted,
                        "text": synthetic_token(seq.request_id, seq.emitted + 1),
                        "tpot": tpot,
                    }
                )
                seq.emitted += 1
                self.metrics.tpot.observe(tpot)
                if seq.remaining <= 0:
                    seq.events.put_nowait(None)
                    self._release_kv(seq.kv_tokens)
            self.running = [s for s in self.running if s.remaining > 0 and not s.failed]
