"""Pod status as the kubelet reports it: derived from the containers' states, or fixed for a pod
the node refuses or cannot start (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from enginestub.node.runner import ContainerState, Terminated
from matrixserve.api import rfc3339


def _terminated(t: Terminated) -> dict[str, Any]:
    out: dict[str, Any] = {
        "exitCode": t.exit_code,
        "reason": t.reason,
        "startedAt": rfc3339.format_seconds(t.started_at),
        "finishedAt": rfc3339.format_seconds(t.finished_at),
    }
    if t.message:
        out["message"] = t.message
    if t.signal is not None:
        out["signal"] = t.signal
    return out


def container_status(state: ContainerState, container_id_prefix: str) -> dict[str, Any]:
    current: dict[str, Any]
    if state.phase == "running" and state.started_at is not None:
        current = {"running": {"startedAt": rfc3339.format_seconds(state.started_at)}}
    elif state.phase == "terminated" and state.terminated is not None:
        current = {"terminated": _terminated(state.terminated)}
    else:
        waiting: dict[str, Any] = {"reason": state.waiting_reason}
        if state.waiting_message:
            waiting["message"] = state.waiting_message
        current = {"waiting": waiting}
    # While it waits to restart, its last state is the exit it waits after (as the kubelet
    # shows a CrashLoopBackOff: lastState.terminated is the latest exit, not the one before).
    last = state.last_terminated
    if state.phase == "waiting" and state.terminated is not None:
        last = state.terminated
    out: dict[str, Any] = {
        "name": state.name,
        "image": state.image,
        "imageID": "",
        "ready": state.ready,
        "started": state.phase == "running",
        "restartCount": state.restart_count,
        "state": current,
        "lastState": {"terminated": _terminated(last)} if last else {},
    }
    if state.pid is not None:
        out["containerID"] = f"{container_id_prefix}://{state.pid}"
    return out


def pod_phase(states: Sequence[ContainerState], restart_policy: str) -> str:
    if not states:
        return "Pending"
    if any(s.phase == "running" for s in states):
        return "Running"
    finished = [s for s in states if s.phase == "terminated" and s.terminated is not None]
    if len(finished) == len(states):
        codes = [s.terminated.exit_code for s in finished if s.terminated is not None]
        if restart_policy == "Always":
            return "Running"
        if all(c == 0 for c in codes):
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    if any(s.restart_count > 0 or s.terminated is not None for s in states):
        return "Running"  # crash-looping containers keep the pod Running
    return "Pending"


def is_ready(conditions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a pod's conditions say Ready."""
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _condition(kind: str, ok: bool, now: str, reason: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": kind,
        "status": "True" if ok else "False",
        "lastProbeTime": None,
        "lastTransitionTime": now,
    }
    if reason:
        # null when it holds: the status is written as a merge patch, which would otherwise
        # keep a reason that no longer applies ("True, ContainersNotReady")
        out["reason"] = None if ok else reason
    return out


def render(
    states: Sequence[ContainerState],
    *,
    restart_policy: str,
    pod_ip: str,
    host_ip: str,
    started_at: float,
    now: float,
    previous_conditions: Sequence[dict[str, Any]] = (),
    node_ready: bool = True,
) -> dict[str, Any]:
    """The pod's ``status``; ``lastTransitionTime`` only moves when a condition flips."""
    all_ready = bool(states) and all(s.ready for s in states) and node_ready
    before = {c.get("type"): c for c in previous_conditions}
    # A condition flips now; one written for the first time holds since the pod started, as
    # a kubelet's first status says (not since this write, which may come after the
    # containers started: a pod not Ready since then has never been Ready).
    stamp = rfc3339.format_seconds(now) if before else rfc3339.format_seconds(started_at)
    wanted = [
        _condition("Initialized", True, stamp),
        _condition("Ready", all_ready, stamp, "ContainersNotReady"),
        _condition("ContainersReady", all_ready, stamp, "ContainersNotReady"),
        _condition("PodScheduled", True, stamp),
    ]
    for cond in wanted:
        old = before.get(cond["type"])
        if (
            old is not None
            and old.get("status") == cond["status"]
            and old.get("lastTransitionTime")
        ):
            cond["lastTransitionTime"] = old["lastTransitionTime"]
    return {
        "phase": pod_phase(states, restart_policy),
        "conditions": wanted,
        "hostIP": host_ip,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": rfc3339.format_seconds(started_at),
        "containerStatuses": [container_status(s, "emulated") for s in states],
    }


def failed(reason: str, message: str) -> dict[str, Any]:
    """The status of a pod the node refuses (admission failed): Failed, with no containers."""
    return {"phase": "Failed", "reason": reason, "message": message}


def waiting(
    pod: dict[str, Any], reason: str, message: str, *, pod_ip: str | None, host_ip: str, now: float
) -> dict[str, Any]:
    """The status of a pod whose containers cannot start (``ErrImagePull``,
    ``CreateContainerConfigError``): Pending, every container waiting with that reason."""
    stamp = rfc3339.format_seconds(now)
    return {
        "phase": "Pending",
        "hostIP": host_ip,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}] if pod_ip else [],
        "startTime": stamp,
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
            {
                "type": "Ready",
                "status": "False",
                "reason": "ContainersNotReady",
                "lastTransitionTime": stamp,
            },
            {
                "type": "ContainersReady",
                "status": "False",
                "reason": "ContainersNotReady",
                "lastTransitionTime": stamp,
            },
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                # the kubelet leaves the message out where it has none (ContainerCreating)
                "state": {
                    "waiting": {"reason": reason, **({"message": message} if message else {})}
                },
                "lastState": {},
            }
            for c in pod["spec"].get("containers") or []
        ],
    }
