"""An instance's faults: its dies' health from the node's device status file (P/D-Serve §3.4:
the node's fault detector writes it, the engine reads it) and the faults tests inject through
``POST /v1/faults`` (die down, link down, slow, hang, HBM error).

What a fault does to requests in flight (a die or HBM fault fails them) the engine decides
(:meth:`enginestub.engine.core.Engine.inject`); here is only what is faulty.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from enginestub.engine.config import EngineConfig
from enginestub.engine.metrics import EngineMetrics
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.engine")

FAULT_KINDS = ("die-down", "link-down", "slow", "hang", "hbm-error")
_INJECTED_DIE = "DIE_DOWN (injected)"
STATUS_POLL_SECONDS = 0.1  # wall s


def _invalid(message: str) -> EngineError:
    return EngineError(400, "invalid_fault", message)


class DeviceFaults:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.injected: dict[str, dict[str, Any]] = {}  # fault kind -> its parameters
        self.unhealthy_dies: dict[int, str] = {}  # die -> why
        self.links_down: set[str] = set()  # peer RoCE IPs our dies lost a link to
        self.not_hung = asyncio.Event()  # cleared while a hang is injected
        self.not_hung.set()

    @property
    def healthy(self) -> bool:
        return not self.unhealthy_dies and "hbm-error" not in self.injected

    @property
    def slow_factor(self) -> float:
        return float(self.injected.get("slow", {}).get("factor", 1.0))

    def check(self) -> None:
        """Raise the 503 a faulty instance answers."""
        if self.unhealthy_dies:
            dies = ", ".join(f"{d} ({why})" for d, why in sorted(self.unhealthy_dies.items()))
            raise EngineError(503, "device_fault", f"die fault on this instance: {dies}")
        if "hbm-error" in self.injected:
            raise EngineError(503, "device_fault", "HBM error on this instance")

    # ------------------------------------------------------------------ injected
    def inject(self, kind: str, params: dict[str, Any]) -> None:
        if kind not in FAULT_KINDS:
            raise _invalid(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
        if kind == "slow":
            factor = params.get("factor")
            if not isinstance(factor, int | float) or not 1 <= factor <= 1000:
                raise _invalid("slow needs factor in 1..1000")
        if kind == "die-down":
            die = params.get("die")
            if die not in self.config.dies:
                raise _invalid(f"die must be one of this instance's dies {self.config.dies}")
            self.unhealthy_dies[int(die)] = _INJECTED_DIE
        if kind == "link-down":
            peer = params.get("peerRoceIp")
            if not isinstance(peer, str):
                raise _invalid("link-down needs peerRoceIp")
            self.links_down.add(peer)
        if kind == "hang":
            self.not_hung.clear()
        self.injected[kind] = params
        self.metrics.faults.labels(kind=kind).set(1)

    def heal(self, kind: str) -> None:
        if kind not in FAULT_KINDS:
            raise _invalid(f"unknown fault {kind!r}")
        params = self.injected.pop(kind, None)
        if kind == "die-down" and params is not None:
            self.unhealthy_dies.pop(int(params["die"]), None)
        if kind == "link-down" and params is not None:
            self.links_down.discard(params["peerRoceIp"])
        if kind == "hang":
            self.not_hung.set()
        self.metrics.faults.labels(kind=kind).set(0)

    # ------------------------------------------------------------------ the device status file
    def apply_status(self, data: dict[str, Any]) -> str | None:
        """Take the dies' and links' health from a device status file (this instance's dies
        only; injected faults stay); returns what newly failed, if anything did."""
        mine = set(self.config.dies)
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
            int(p["die"]): _INJECTED_DIE for k, p in self.injected.items() if k == "die-down"
        }
        newly = set(faulted) - set(self.unhealthy_dies)
        self.unhealthy_dies = {**faulted, **injected}
        self.links_down = links | {
            p["peerRoceIp"] for k, p in self.injected.items() if k == "link-down"
        }
        if not newly:
            return None
        return ", ".join(f"die {d}: {faulted[d]}" for d in sorted(newly))

    async def watch(
        self, path: Path, on_fault: Callable[[str], None], on_change: Callable[[], None]
    ) -> None:
        """Poll the device status file; a new generation is applied, ``on_fault`` told what
        newly failed, then ``on_change`` called."""
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
                why = self.apply_status(data)
                if why is not None:
                    log.warning("device fault on this instance: %s", why)
                    on_fault(f"device fault: {why}")
                on_change()
            await asyncio.sleep(STATUS_POLL_SECONDS)
