"""An instance's faults: its dies' health from the node's device status file (P/D-Serve §3.4:
the node's fault detector writes it, the engine reads it) and the faults tests inject through
``POST /v1/faults`` (die down, link down, slow, hang, HBM error).

What a fault does to requests in flight (a die or HBM fault fails them) the engine decides
(:meth:`enginestub.engine.core.Engine.inject`); here is only what is faulty, and, for the
engine's health (Faulty, not silent), each device fault as the typed
:class:`~matrixserve.api.zk_layout.EngineFault` the operator plans from: ``npu`` when every die of
one NPU is down, ``die`` for fewer, ``hbm`` for an HBM error, each with the wall time this
engine first saw it (detection latency counts from it). The leader of an instance of several pods
holds its lost or faulty ranks here too (``Rank``, :mod:`.ranks`): their dies are the
instance's, so the instance is as faulty as by a die of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from enginestub.engine.config import EngineConfig
from enginestub.engine.metrics import EngineMetrics
from matrixserve.api import zk_layout as zl
from matrixserve.api.catalog import DIES_PER_NPU
from matrixserve.api.engine_protocol import EngineError

log = logging.getLogger("enginestub.engine")

FAULT_KINDS = ("die-down", "link-down", "slow", "hang", "hbm-error")
_INJECTED_DIE = "DIE_DOWN (injected)"
STATUS_POLL_SECONDS = 0.1  # wall s
_HBM_CODE = "HBM"  # the device plugin's HBM codes (HBM_UNCORRECTABLE_ECC) name it


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
        self.npu_of: dict[int, int] = {}  # die -> its NPU, as the device status file groups them
        self.first_seen: dict[str, float] = {}  # fault key -> wall time (epoch s) first seen
        self.ranks_lost: dict[int, zl.EngineFault] = {}  # a leader's lost or faulty ranks

    @property
    def healthy(self) -> bool:
        return not self.unhealthy_dies and "hbm-error" not in self.injected and not self.ranks_lost

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
        if self.ranks_lost:
            lost = "; ".join(f.detail for _, f in sorted(self.ranks_lost.items()))
            raise EngineError(503, "device_fault", f"rank fault on this instance: {lost}")

    def set_ranks_lost(self, faults: dict[int, zl.EngineFault]) -> str | None:
        """The instance's lost or faulty ranks now (none: formed whole again); returns what
        newly failed, if anything did."""
        newly = sorted(set(faults) - set(self.ranks_lost))
        self.ranks_lost = dict(faults)
        if not newly:
            return None
        return "; ".join(faults[k].detail for k in newly)

    # ------------------------------------------------------------------ injected
    def inject(self, kind: str, params: dict[str, Any]) -> None:
        """Inject a fault; one of the same kind injected before is replaced (healed first: a
        die or peer it named must not stay faulty once nothing names it)."""
        self._check(kind, params)
        if kind in self.injected:
            self.heal(kind)
        if kind == "die-down":
            self.unhealthy_dies[int(params["die"])] = _INJECTED_DIE
        if kind == "link-down":
            self.links_down.add(params["peerRoceIp"])
        if kind == "hang":
            self.not_hung.clear()
        self.injected[kind] = params
        self.metrics.faults.labels(kind=kind).set(1)
        self._seen()

    def _check(self, kind: str, params: dict[str, Any]) -> None:
        if kind not in FAULT_KINDS:
            raise _invalid(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
        if kind == "slow":
            factor = params.get("factor")
            if not isinstance(factor, int | float) or not 1 <= factor <= 1000:
                raise _invalid("slow needs factor in 1..1000")
        die = params.get("die")
        if (kind == "die-down" or (kind == "hbm-error" and "die" in params)) and (
            isinstance(die, bool) or die not in self.config.dies
        ):
            raise _invalid(f"die must be one of this instance's dies {self.config.dies}")
        if kind == "link-down" and not isinstance(params.get("peerRoceIp"), str):
            raise _invalid("link-down needs peerRoceIp")

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
        self._seen()

    # ------------------------------------------------------------------ the device status file
    def apply_status(self, data: dict[str, Any]) -> str | None:
        """Take the dies' and links' health from a device status file (this instance's dies
        only; injected faults stay); returns what newly failed, if anything did."""
        mine = set(self.config.dies)
        faulted: dict[int, str] = {}
        for npu in data.get("npus", []):
            for die in npu.get("dies", []):
                if die["id"] in mine:
                    self.npu_of[die["id"]] = npu["id"]
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
        self._seen()
        if not newly:
            return None
        return ", ".join(f"die {d}: {faulted[d]}" for d in sorted(newly))

    # ------------------------------------------------------------------ as the health says them
    def _seen(self) -> None:
        """Stamp the faults present now with the wall time first seen; forget the healed ones."""
        now = time.time()
        keys = {f"die:{d}" for d in self.unhealthy_dies}
        keys |= {f"injected:{kind}" for kind in self.injected}
        self.first_seen = {k: self.first_seen.get(k, now) for k in keys}

    def _since(self, keys: Iterable[str]) -> float:
        return min((self.first_seen[k] for k in keys if k in self.first_seen), default=time.time())

    def _npu(self, die: int) -> int:
        return self.npu_of.get(die, die // DIES_PER_NPU)

    def engine_faults(self) -> list[zl.EngineFault]:
        """The device faults of this instance, one per NPU touched: ``npu`` when all its dies
        (of this instance) are down, ``die`` otherwise, ``hbm`` for HBM errors."""
        hbm = {d for d, why in self.unhealthy_dies.items() if _HBM_CODE in why}
        faults: list[zl.EngineFault] = []
        down = sorted(set(self.unhealthy_dies) - hbm)
        for npu in sorted({self._npu(d) for d in down}):
            dies = [d for d in down if self._npu(d) == npu]
            whole = [d for d in self.config.dies if self._npu(d) == npu]
            kind = (
                zl.EngineFaultKind.NPU
                if len(whole) > 1 and dies == whole
                else zl.EngineFaultKind.DIE
            )
            why = ", ".join(f"die {d}: {self.unhealthy_dies[d]}" for d in dies)
            faults.append(
                zl.EngineFault(
                    kind=kind,
                    since=self._since(f"die:{d}" for d in dies),
                    detail=f"NPU {npu}: {why}" if kind is zl.EngineFaultKind.NPU else why,
                    dies=dies,
                )
            )
        injected: list[int] = []
        if "hbm-error" in self.injected:  # on one die if said, else on the instance's HBM
            params = self.injected["hbm-error"]
            injected = [int(params["die"])] if "die" in params else list(self.config.dies)
        if hbm or injected:
            dies = sorted(hbm | set(injected))
            faults.append(
                zl.EngineFault(
                    kind=zl.EngineFaultKind.HBM,
                    since=self._since([*(f"die:{d}" for d in hbm), "injected:hbm-error"]),
                    detail="HBM error on die(s) " + ", ".join(map(str, dies)),
                    dies=dies,
                )
            )
        return [*faults, *(f for _, f in sorted(self.ranks_lost.items()))]

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
