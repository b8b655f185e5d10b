"""The Node as the emulated kubelet and device plugin show it (pure): its ``status`` and its
taints, both derived from the node's state alone (SYSTEM.md §5).

- **Status**: Ready, or Unknown while a node-down fault is injected; ``allocatable``
  ``huawei.com/Ascend910`` is the capacity less the faulty NPUs (a die, NPU or HBM fault in the
  device status file: xDeepServe §6.2, "a faulty NPU stops being allocatable"); capacity stays.
- **Taints**: the one place that computes them. The emulator owns the
  ``node.kubernetes.io/unreachable`` pair while a node is down (NoSchedule + NoExecute, as the
  node lifecycle controller puts them), ``matrixserve.io/npu-fault`` (NoSchedule, not NoExecute:
  the instances still serving there stay; its value names the faulty NPUs) and, in full mode,
  lifts ``node.kubernetes.io/not-ready`` that admission puts on a new Node. Every other taint
  (a cordon's, an operator's, a user's) is kept exactly as it is.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from enginestub.node.topology import Server
from matrixserve.api import rfc3339
from matrixserve.api.kinds import NPU_RESOURCE, TAINT_NPU_FAULT

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
# the emulated kubelet reports the API server's version (no skew), marked as emulated
KUBELET_SUFFIX = "-matrixserve-emulated"
UNKNOWN_VERSION = "v0.0.0"  # the API server's version not read yet
LABEL_VALUE_MAX = 63  # a taint's value must be a label value

# The taints each mode owns: in advertise mode (kind) a real kubelet owns readiness.
OWNED_FULL = frozenset({NOT_READY_TAINT, UNREACHABLE_TAINT, TAINT_NPU_FAULT})
OWNED_ADVERTISE = frozenset({TAINT_NPU_FAULT})


def allocatable(capacity: Mapping[str, str], faulty: Collection[int]) -> dict[str, str]:
    """The node's ``allocatable``: its capacity, less the faulty NPUs."""
    out = dict(capacity)
    if NPU_RESOURCE in out:
        out[NPU_RESOURCE] = str(max(int(out[NPU_RESOURCE]) - len(faulty), 0))
    return out


def npu_fault_taint_value(npus: Collection[int]) -> str:
    """The npu-fault taint's value: each faulty NPU by name (``npu-3.npu-5``); where that would
    pass a label value's 63 characters, runs of consecutive NPUs (``npu-0-6.npu-9``); a server
    too large even for that (not one of the catalogue's) gets the count (``npus-40``)."""
    ordered = sorted(set(npus))
    each = ".".join(f"npu-{n}" for n in ordered)
    if len(each) <= LABEL_VALUE_MAX:
        return each
    runs: list[list[int]] = []
    for n in ordered:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    compact = ".".join(
        f"npu-{run[0]}" if len(run) == 1 else f"npu-{run[0]}-{run[-1]}" for run in runs
    )
    return compact if len(compact) <= LABEL_VALUE_MAX else f"npus-{len(ordered)}"


def node_taints(
    current: Sequence[Mapping[str, Any]],
    *,
    full: bool,
    down: bool,
    faulty: Collection[int],
    now: float,
) -> list[dict[str, Any]]:
    """The node's taints as the node's state says, given the taints it has now (the API's JSON
    shape: key, value, effect, timeAdded). Others' taints are kept as they are and in their
    order; a taint of ours already there is kept too (its ``timeAdded`` with it)."""
    owned = OWNED_FULL if full else OWNED_ADVERTISE
    wanted: list[dict[str, Any]] = []
    if down and full:
        wanted.append({"key": UNREACHABLE_TAINT, "effect": "NoSchedule"})
        wanted.append(
            {
                "key": UNREACHABLE_TAINT,
                "effect": "NoExecute",
                "timeAdded": rfc3339.format_seconds(now),
            }
        )
    if faulty:
        value = npu_fault_taint_value(faulty)
        wanted.append({"key": TAINT_NPU_FAULT, "value": value, "effect": "NoSchedule"})
    present = {(t.get("key"), t.get("value"), t.get("effect")): t for t in current}
    ours = [dict(present.get((w["key"], w.get("value"), w["effect"]), w)) for w in wanted]
    return [dict(t) for t in current if t.get("key") not in owned] + ours


def node_status(
    server: Server,
    host_ip: str,
    *,
    down: bool,
    faulty: Collection[int],
    boot_id: str,
    now: float,
    server_version: str = UNKNOWN_VERSION,
) -> dict[str, Any]:
    """The node's ``status`` as a kubelet posts it: Ready (or Unknown while a node-down fault is
    injected), no pressure, allocatable = capacity less the faulty NPUs, the node's
    InternalIP."""
    stamp = rfc3339.format_seconds(now)
    if down:
        ready = {
            "type": "Ready",
            "status": "Unknown",
            "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status (node-down fault injected).",
        }
    else:
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "emulated kubelet is posting ready status",
        }
    conditions = [
        {"type": t, "status": "False", "reason": f"KubeletHasNo{t}", "message": "emulated"}
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
    ] + [ready]
    for cond in conditions:
        cond["lastHeartbeatTime"] = stamp
        cond.setdefault("lastTransitionTime", stamp)
    return {
        "capacity": server.capacity,
        "allocatable": allocatable(server.capacity, faulty),
        "conditions": conditions,
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": server.node_name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": server.node_name,
            "systemUUID": server.node_name,
            "bootID": boot_id,
            "kernelVersion": os.uname().release,
            "osImage": "MatrixServe emulated NPU server",
            "containerRuntimeVersion": "emulated://local-processes",
            "kubeletVersion": server_version + KUBELET_SUFFIX,
            "kubeProxyVersion": server_version + KUBELET_SUFFIX,
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }
