"""The node emulator: kubelet + Ascend device plugin + fault detector for emulated NPU servers.

``Emulator.run()``:

1. registers one Node per emulated server (labels for superpod/rack/server/NPU type, capacity
   with ``huawei.com/Ascend910``, a free loopback /24 as ``spec.podCIDR``), marks it Ready and
   lifts the ``node.kubernetes.io/not-ready`` taint that admission puts on new nodes;
2. renews each node's Lease in ``kube-node-lease`` every ``lease_interval`` and re-posts node
   status every ``status_interval``;
3. watches pods bound to its nodes: grants NPUs (annotation), gives each pod a loopback IP, runs
   its containers as processes (:mod:`.runner`), writes ``status`` back as the kubelet would,
   and on deletion stops them within the grace period and finalises the delete;
4. keeps each node's device status file (:mod:`.devicestatus`) and applies faults from the
   control API (:mod:`.control`).

In ``advertise`` mode (kind, where real kubelets run containers) it only does the device-plugin
and fault-file parts for existing nodes.

Kubernetes calls use the synchronous client in worker threads; everything else is asyncio.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from enginestub.node import allocator, devicestatus, podspec, podstatus, services
from enginestub.node.listwatch import watch_events
from enginestub.node.network import (
    POD_LOCKS,
    AddressExhausted,
    NodeAddresses,
    candidate_cidrs,
    lock_cidr,
)
from enginestub.node.runner import ENGINE_ARGV, PodRunner, Zygote, rfc3339
from enginestub.node.topology import LABEL_EMULATED, Server

log = logging.getLogger("enginestub.node")

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
LEASE_NAMESPACE = "kube-node-lease"
KUBELET_VERSION = "v1.20.2-matrixserve-emulated"
ANNOTATION_EMULATOR = "matrixserve.io/node-emulator"
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV")

DEFAULT_IMAGE_MAP: dict[str, list[str]] = {
    "matrixserve/engine-stub": ENGINE_ARGV,  # forked from the zygote (runner.py)
    # The operator/gateway image: its entrypoint is "python -m"; the chart's args name the module.
    "matrixserve/matrixserve": [sys.executable, "-m"],
    # The chart's bundled ZooKeeper: Debian's ZooKeeper on the pod's IP.
    "zookeeper": [sys.executable, "-m", "enginestub.node.zookeeper"],
    # Sleep-like pods for tests and scale runs: the container's command runs on the host.
    "busybox": [],
    "matrixserve/host-command": [],
}


@dataclass
class EmulatorConfig:
    servers: list[Server]
    state_dir: Path
    mode: str = "full"  # "full" or "advertise"
    image_map: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_IMAGE_MAP))
    lease_interval: float = 10.0
    status_interval: float = 60.0
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    control_host: str = "127.0.0.1"
    control_port: int = 0
    apiserver_host: str | None = None
    apiserver_port: int | None = None
    apiserver_ca: str | None = None  # CA bundle file of the API server (for pods' kubeconfigs)
    service_proxy: bool = False  # route Services' ClusterIPs (loopback range) to pods
    delete_nodes_on_exit: bool = False
    stop_grace_on_exit: float = 5.0
    zygote: bool = True  # fork engine-stub containers from a warm process (see .zygote)


@dataclass
class PodRecord:
    """One pod bound to one of our nodes."""

    uid: str
    namespace: str
    name: str
    node: str
    pod: dict[str, Any]
    ip: str | None = None
    npus: list[int] = field(default_factory=list)
    runner: PodRunner | None = None
    fixed_status: dict[str, Any] | None = None  # pods we cannot run (image, config, admission)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    terminating: bool = False
    events_sent: set[str] = field(default_factory=set)


@dataclass
class NodeState:
    server: Server
    addresses: NodeAddresses
    allocator: allocator.NodeAllocator
    devices: devicestatus.DeviceStatus
    device_file: Path
    down: bool = False


class Emulator:
    def __init__(self, config: EmulatorConfig, api: client.ApiClient) -> None:
        self.config = config
        self.api = api
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.identity = f"node-emulator-{os.getpid()}-{secrets.token_hex(3)}"
        self.nodes: dict[str, NodeState] = {}
        self.pods: dict[str, PodRecord] = {}
        self._dirty: set[str] = set()
        self._dirty_event = asyncio.Event()
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: watch.Watch | None = None
        self.control_url: str | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._cidr_locks: list[Any] = []
        self._pod_chains: dict[str, asyncio.Task[None]] = {}
        self._zygote_proc: asyncio.subprocess.Process | None = None
        self.zygote: Zygote | None = None
        self.proxy: services.ServiceProxy | None = None
        if config.service_proxy and config.apiserver_host and config.apiserver_port:
            self.proxy = services.ServiceProxy(
                api, self._backends, (config.apiserver_host, config.apiserver_port)
            )

    # ================================================================== main
    async def run(self) -> None:
        from enginestub.node.control import ControlServer

        self._loop = asyncio.get_running_loop()
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        if self.config.mode == "full" and self.config.zygote:
            # The zygote warms up while the nodes register; pods wait for both.
            await asyncio.gather(self._start_zygote(), self._register_nodes())
        else:
            await self._register_nodes()
        control = ControlServer(self)
        self.control_url = await control.start(self.config.control_host, self.config.control_port)
        # atomically: scripts and tests poll for this file and read it as soon as it exists
        devicestatus.write_atomically(
            self.config.state_dir / "emulator.json",
            {
                "pid": os.getpid(),
                "identity": self.identity,
                "control": self.control_url,
                "mode": self.config.mode,
                "nodes": sorted(self.nodes),
            },
        )
        tasks = [asyncio.create_task(self._heartbeats(), name="heartbeats")]
        if self.config.mode == "full":
            tasks.append(asyncio.create_task(self._status_writer(), name="status-writer"))
            tasks.append(asyncio.create_task(self._pod_events(), name="pod-events"))
            if self.proxy is not None:
                tasks.append(asyncio.create_task(self.proxy.run(), name="service-proxy"))
        log.info(
            "node emulator %s: %d nodes, control %s",
            self.identity,
            len(self.nodes),
            self.control_url,
        )
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()
            await control.stop()

    def _backends(self, namespace: str, selector: Mapping[str, str]) -> list[services.Backend]:
        """Ready pods of ours in the namespace whose labels match the selector."""
        found = []
        for record in list(self.pods.values()):
            labels = (record.pod.get("metadata") or {}).get("labels")
            if (
                record.namespace != namespace
                or record.terminating
                or not record.ip
                or record.runner is None
                or not services.matches(selector, labels)
                or not any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in record.conditions
                )
            ):
                continue
            # the named ports the pod's container plans already hold
            ports = {n: p for plan in record.runner.plans for n, p in plan.ports.items()}
            found.append(services.Backend(record.ip, ports))
        return found

    def _spawn(self, coro: Any) -> None:
        """Run a fire-and-forget coroutine, keeping a reference until it is done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def request_stop(self) -> None:
        self._stop.set()

    async def _start_zygote(self) -> None:
        path = self.config.state_dir / "zygote.sock"
        path.unlink(missing_ok=True)
        log = (self.config.state_dir / "zygote.log").open("ab")
        self._zygote_proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "enginestub.node.zygote",
            str(path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
        log.close()
        for _ in range(200):  # it imports the engine first: ~0.3 s
            if path.exists():
                self.zygote = Zygote(str(path))
                return
            if self._zygote_proc.returncode is not None:
                break
            await asyncio.sleep(0.025)
        log_text = (self.config.state_dir / "zygote.log").read_text()[-500:]
        logging.getLogger("enginestub.node").warning(
            "engine zygote unavailable; fresh interpreters instead: %s", log_text
        )

    async def _shutdown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        runners = [r.runner for r in self.pods.values() if r.runner is not None]
        await asyncio.gather(
            *(r.stop(self.config.stop_grace_on_exit) for r in runners), return_exceptions=True
        )
        if self._zygote_proc is not None and self._zygote_proc.returncode is None:
            self._zygote_proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._zygote_proc.wait(), 5)
        if self.config.delete_nodes_on_exit and self.config.mode == "full":
            for name in self.nodes:
                with contextlib.suppress(client.ApiException):
                    await asyncio.to_thread(self.core.delete_node, name)
                with contextlib.suppress(client.ApiException):
                    await asyncio.to_thread(
                        self.coordination.delete_namespaced_lease, name, LEASE_NAMESPACE
                    )

    # ================================================================== nodes
    def _lock_cidr(self, cidr: str) -> bool:
        """Hold a machine-wide lock on a pod /24 for this process's lifetime; False if held elsewhere."""
        handle = lock_cidr(POD_LOCKS, cidr)
        if handle is None:
            return False
        self._cidr_locks.append(handle)
        return True

    async def _register_nodes(self) -> None:
        existing = await asyncio.to_thread(self.core.list_node)
        ours = {s.node_name for s in self.config.servers}
        by_name = {n.metadata.name: n for n in existing.items}
        taken = [
            n.spec.pod_cidr
            for n in existing.items
            if n.metadata.name not in ours and n.spec.pod_cidr
        ]
        if self.config.mode == "advertise":
            missing = sorted(ours - set(by_name))
            if missing:
                raise RuntimeError(f"advertise mode: nodes {missing} do not exist")
        else:
            for name in ours & set(by_name):
                labels = by_name[name].metadata.labels or {}
                if labels.get(LABEL_EMULATED) != "true":
                    raise RuntimeError(
                        f"node {name} already exists and is not an emulated node; "
                        "choose another superpod name"
                    )
        fresh = candidate_cidrs(taken)
        for server in self.config.servers:
            prior = by_name.get(server.node_name)
            if prior is not None and prior.spec.pod_cidr and self._lock_cidr(prior.spec.pod_cidr):
                cidr = prior.spec.pod_cidr
            else:
                cidr = next((c for c in fresh if self._lock_cidr(c)), "")
                if not cidr:
                    raise AddressExhausted("no free pod /24 left in 127.64.0.0/10 on this machine")
            folder = self.config.state_dir / "nodes" / server.node_name
            state = NodeState(
                server=server,
                addresses=NodeAddresses(cidr),
                allocator=allocator.NodeAllocator(server.npus),
                devices=devicestatus.DeviceStatus(server),
                device_file=folder / "device-status.json",
            )
            self.nodes[server.node_name] = state
            self._write_device_file(state)
            if self.config.mode == "full":
                await self._upsert_node(state, prior is not None)
            else:
                await self._advertise(state)

    async def _upsert_node(self, state: NodeState, exists: bool) -> None:
        server = state.server
        meta = {
            "name": server.node_name,
            "labels": server.labels,
            "annotations": {ANNOTATION_EMULATOR: self.identity},
        }
        spec = {"podCIDR": state.addresses.cidr, "podCIDRs": [state.addresses.cidr]}
        if not exists:
            await asyncio.to_thread(self.core.create_node, {"metadata": meta, "spec": spec})
        else:
            await asyncio.to_thread(self.core.patch_node, server.node_name, {"metadata": meta})
        await self._post_node_status(state)
        await self._set_node_taints(state)

    async def _advertise(self, state: NodeState) -> None:
        server = state.server
        npus = str(server.npus)
        resource = next(k for k in server.capacity if k.startswith("huawei.com/"))
        # Labels first: once the NPUs are allocatable the scheduler may place pods that select
        # on the SuperPod/server labels, so those must already be there.
        labels = {k: v for k, v in server.labels.items() if k.startswith("matrixserve.io/")}
        labels[LABEL_EMULATED] = "advertised"
        await asyncio.to_thread(
            self.core.patch_node, server.node_name, {"metadata": {"labels": labels}}
        )
        await asyncio.to_thread(
            self.core.patch_node_status,
            server.node_name,
            {"status": {"capacity": {resource: npus}, "allocatable": {resource: npus}}},
        )

    def _node_status(self, state: NodeState) -> dict[str, Any]:
        now = rfc3339(time.time())
        if state.down:
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
            cond["lastHeartbeatTime"] = now
            cond.setdefault("lastTransitionTime", now)
        capacity = state.server.capacity
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": state.addresses.host_ip},
                {"type": "Hostname", "address": state.server.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": state.server.node_name,
                "systemUUID": state.server.node_name,
                "bootID": self.identity,
                "kernelVersion": os.uname().release,
                "osImage": "MatrixServe emulated NPU server",
                "containerRuntimeVersion": "emulated://local-processes",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": KUBELET_VERSION,
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    async def _post_node_status(self, state: NodeState) -> None:
        name = state.server.node_name
        current = await asyncio.to_thread(self.core.read_node_status, name)
        status = self._node_status(state)
        before = {c.type: c for c in (current.status.conditions or [])}
        for cond in status["conditions"]:
            old = before.get(cond["type"])
            if old is not None and old.status == cond["status"] and old.last_transition_time:
                cond["lastTransitionTime"] = rfc3339(old.last_transition_time.timestamp())
        await asyncio.to_thread(self.core.patch_node_status, name, {"status": status})

    async def _set_node_taints(self, state: NodeState) -> None:
        name = state.server.node_name
        node = await asyncio.to_thread(self.core.read_node, name)
        keep = [
            t.to_dict()
            for t in node.spec.taints or []
            if t.key not in (NOT_READY_TAINT, UNREACHABLE_TAINT)
        ]
        wanted = keep
        if state.down:
            stamp = rfc3339(time.time())
            wanted = [
                *keep,
                {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"},
                {"key": UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": stamp},
            ]
        cleaned = [
            {
                k: v
                for k, v in {
                    "key": t["key"],
                    "value": t.get("value"),
                    "effect": t["effect"],
                    "timeAdded": t.get("time_added") or t.get("timeAdded"),
                }.items()
                if v
            }
            for t in wanted
        ]
        await asyncio.to_thread(self.core.patch_node, name, {"spec": {"taints": cleaned or None}})

    async def _heartbeats(self) -> None:
        last_status = time.monotonic()
        while True:
            for state in list(self.nodes.values()):
                if state.down or self.config.mode != "full":
                    continue
                try:
                    await self._renew_lease(state.server.node_name)
                except client.ApiException as exc:
                    log.warning(
                        "lease renewal for %s failed: %s", state.server.node_name, exc.reason
                    )
            if (
                self.config.mode == "full"
                and time.monotonic() - last_status >= self.config.status_interval
            ):
                last_status = time.monotonic()
                for state in list(self.nodes.values()):
                    if not state.down:
                        with contextlib.suppress(client.ApiException):
                            await self._post_node_status(state)
            await asyncio.sleep(self.config.lease_interval)

    async def _renew_lease(self, name: str) -> None:
        now = time.time()
        micro = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        body = {
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro},
        }
        try:
            await asyncio.to_thread(
                self.coordination.patch_namespaced_lease,
                name,
                LEASE_NAMESPACE,
                {"spec": body["spec"]},
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            await asyncio.to_thread(
                self.coordination.create_namespaced_lease, LEASE_NAMESPACE, body
            )

    # ================================================================== device status / faults
    def _write_device_file(self, state: NodeState) -> None:
        devicestatus.write_atomically(state.device_file, state.devices.render(rfc3339(time.time())))

    def device_status(self, node: str) -> dict[str, Any]:
        state = self.nodes[node]
        content: dict[str, Any] = json.loads(state.device_file.read_text())
        return content

    def apply_device_fault(self, node: str, fault: devicestatus.Fault, heal: bool) -> bool:
        state = self.nodes[node]
        if heal:
            changed = state.devices.heal(fault.kind, fault.die, fault.peer_roce_ip)
        else:
            changed = state.devices.inject(fault)
        if changed:
            self._write_device_file(state)
        return changed

    async def set_node_down(self, node: str, down: bool) -> bool:
        state = self.nodes[node]
        if state.down == down:
            return False
        state.down = down
        records = [r for r in self.pods.values() if r.node == node]
        for record in records:
            if record.runner is None:
                continue
            if down:
                record.runner.kill()
            else:
                record.runner.revive()
        if self.config.mode == "full":
            # The node lifecycle controller is off in the dev cluster: we mark pods not ready
            # (as it would) by rendering them with node_ready=False.
            for record in records:
                self._mark_dirty(record.uid)
            await self._post_node_status(state)
            await self._set_node_taints(state)
            await self._node_event(
                node,
                "NodeNotReady" if down else "NodeReady",
                f"Node {node} status is now: {'NodeNotReady (fault injected)' if down else 'NodeReady'}",
                "Warning" if down else "Normal",
            )
        return True

    def find_pod(self, namespace: str, name: str) -> PodRecord | None:
        for record in self.pods.values():
            if record.namespace == namespace and record.name == name and not record.terminating:
                return record
        return None

    # ================================================================== pods
    async def _pod_events(self) -> None:
        """List+watch the pods bound to any node (our nodes' are ours to run)."""

        def keep(stream: watch.Watch) -> None:
            self._watch = stream  # so that shutdown can stop it

        async for kind, pod in watch_events(
            self.core.list_pod_for_all_namespaces,
            stopped=self._stop.is_set,
            key=lambda pod: pod["metadata"]["uid"],
            known=lambda: ((uid, r.pod) for uid, r in list(self.pods.items())),
            what="pod",
            on_stream=keep,
            field_selector="spec.nodeName!=",
        ):
            if kind != "SYNCED":
                self._dispatch(kind, pod)

    def _dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        """Handle pods concurrently (a kubelet admits pods in parallel), but each pod's events
        strictly in order: a pod's handler waits for its previous one."""
        uid = pod["metadata"]["uid"]
        previous = self._pod_chains.get(uid)

        async def handle() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            try:
                await self._on_pod(kind, pod)
            except Exception:
                log.exception(
                    "handling %s of pod %s failed", kind, pod.get("metadata", {}).get("name")
                )

        task = asyncio.create_task(handle())
        self._pod_chains[uid] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._pod_chains.get(uid) is done:
                del self._pod_chains[uid]

        task.add_done_callback(forget)

    async def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        node = pod.get("spec", {}).get("nodeName")
        if node not in self.nodes:
            return
        record = self.pods.get(uid)
        if kind == "DELETED":
            if record is not None:
                await self._terminate(record, grace=0.0, finalize=False)
            return
        if record is not None:
            record.pod = pod
        if meta.get("deletionTimestamp"):
            if record is None:
                await self._finalize_delete(meta["namespace"], meta["name"], uid)
            elif not record.terminating:
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                self._spawn(self._terminate(record, grace=grace, finalize=True))
            return
        if record is None:
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                return
            await self._admit(pod)

    async def _admit(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        state = self.nodes[pod["spec"]["nodeName"]]
        record = PodRecord(
            meta["uid"], meta["namespace"], meta["name"], state.server.node_name, pod
        )
        self.pods[record.uid] = record
        # --- device plugin: which NPUs -------------------------------------------------
        wanted = podspec.npu_request(pod)
        granted_text = (meta.get("annotations") or {}).get(allocator.ANNOTATION)
        try:
            if granted_text is not None:
                record.npus = allocator.parse_grant(granted_text)
                state.allocator.adopt(record.uid, record.npus)
            else:
                record.npus = state.allocator.allocate(record.uid, wanted)
                await asyncio.to_thread(
                    self.core.patch_namespaced_pod,
                    record.name,
                    record.namespace,
                    {
                        "metadata": {
                            "annotations": {
                                allocator.ANNOTATION: allocator.format_grant(record.npus)
                            }
                        }
                    },
                )
        except (allocator.AllocationError, ValueError) as exc:
            record.fixed_status = _failed_status(
                "UnexpectedAdmissionError", f"Allocate failed due to {exc}, which is unexpected"
            )
            await self._event(record, "UnexpectedAdmissionError", str(exc), "Warning")
            self._mark_dirty(record.uid)
            return
        record.ip = state.addresses.claim((pod.get("status") or {}).get("podIP"))
        # --- containers ----------------------------------------------------------------
        base_env = self._base_env(state, record)
        if self.proxy is not None:
            try:
                await asyncio.wait_for(self.proxy.synced.wait(), 30)
            except TimeoutError:
                log.warning("Services not listed after 30 s: %s starts without them", record.name)
            base_env.update(self.proxy.namespace_env(record.namespace))
        workdir = self.config.state_dir / "pods" / f"{record.namespace}_{record.name}_{record.uid}"
        try:
            base_env.update(await self._service_account_env(record.namespace, pod, workdir))
            lookup = await self._lookup_for(record.namespace, pod)
            plans = podspec.plan_containers(
                _with_status(pod, record.ip, state.addresses.host_ip),
                self.config.image_map,
                lookup,
                base_env,
            )
        except podspec.UnknownImageError as exc:
            record.fixed_status = _waiting_status(pod, "ErrImagePull", str(exc), record, state)
            await self._event(record, "Failed", f"Failed to pull image: {exc}", "Warning")
            self._mark_dirty(record.uid)
            return
        except podspec.ContainerConfigError as exc:
            record.fixed_status = _waiting_status(
                pod, "CreateContainerConfigError", str(exc), record, state
            )
            await self._event(record, "Failed", f"Error: {exc}", "Warning")
            self._mark_dirty(record.uid)
            return
        runner = PodRunner(
            namespace=record.namespace,
            name=record.name,
            uid=record.uid,
            pod_ip=record.ip,
            plans=plans,
            restart_policy=pod["spec"].get("restartPolicy", "Always"),
            workdir=workdir,
            on_change=lambda r: self._runner_changed(record, r),
            backoff_base=self.config.backoff_base,
            backoff_max=self.config.backoff_max,
            zygote=self.zygote,
        )
        record.runner = runner
        if state.down:
            runner.kill()
        runner.start()

    def _base_env(self, state: NodeState, record: PodRecord) -> dict[str, str]:
        dies = state.server.dies_of(record.npus)
        env = {k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ}
        env.update(
            {
                "ASCEND_VISIBLE_DEVICES": ",".join(map(str, record.npus)),
                "MATRIXSERVE_NPUS": ",".join(map(str, record.npus)),
                "MATRIXSERVE_DIES": ",".join(str(d.index) for d in dies),
                "MATRIXSERVE_ROCE_IPS": ",".join(d.roce_ip for d in dies),
                "MATRIXSERVE_UB_ADDRESSES": ",".join(d.ub_address for d in dies),
                "MATRIXSERVE_DEVICE_STATUS_FILE": str(state.device_file),
                "MATRIXSERVE_NODE_NAME": state.server.node_name,
                "MATRIXSERVE_SUPERPOD": state.server.superpod,
                "MATRIXSERVE_POD_IP": record.ip or "",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.config.apiserver_host and self.config.apiserver_port:
            env["KUBERNETES_SERVICE_HOST"] = self.config.apiserver_host
            env["KUBERNETES_SERVICE_PORT"] = str(self.config.apiserver_port)
        return env

    async def _service_account_env(
        self, namespace: str, pod: dict[str, Any], workdir: Path
    ) -> dict[str, str]:
        """The pod's service-account credentials, as a kubelet would mount them: the token Secret
        the ServiceAccount admission plugin put in the pod's volumes. A process here cannot see
        /var/run/secrets, so the emulator writes a kubeconfig for that token into the pod's
        directory and points ``KUBECONFIG`` at it (clients then run as the ServiceAccount, under
        its RBAC, exactly as in a pod)."""
        secret_name = podspec.service_account_secret(pod)
        if not (self.config.apiserver_host and self.config.apiserver_port):
            return {}
        if secret_name is None:
            # No token (automountServiceAccountToken: false): no credentials at all, rather than
            # a client falling back to the developer's ~/.kube/config through $HOME.
            return {"KUBECONFIG": str(workdir / "no-service-account-token")}
        try:
            data = await self._read_secret(namespace, secret_name)
        except client.ApiException as exc:
            raise podspec.ContainerConfigError(
                f'service-account token Secret "{secret_name}": {exc.status} {exc.reason}'
            ) from exc
        if not data.get("token"):
            raise podspec.ContainerConfigError(f'Secret "{secret_name}" holds no token')
        folder = workdir / "serviceaccount"
        folder.mkdir(parents=True, exist_ok=True)
        for key in ("token", "ca.crt", "namespace"):
            if key in data:
                path = folder / key
                path.touch(mode=0o600)
                path.write_bytes(data[key])
        ca = str(folder / "ca.crt") if "ca.crt" in data else self.config.apiserver_ca
        kubeconfig = folder / "kubeconfig"
        kubeconfig.touch(mode=0o600)
        kubeconfig.write_text(
            podspec.token_kubeconfig(
                f"https://{self.config.apiserver_host}:{self.config.apiserver_port}",
                ca,
                data["token"].decode(),
            )
        )
        return {"KUBECONFIG": str(kubeconfig)}

    async def _read_secret(self, namespace: str, name: str) -> dict[str, bytes]:
        secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    async def _lookup_for(self, namespace: str, pod: dict[str, Any]) -> podspec.SecretLookup:
        """Prefetch the ConfigMaps and Secrets the pod's env refers to (the lookup stays pure)."""
        wanted: set[tuple[str, str]] = set()
        for container in pod["spec"].get("containers") or []:
            for item in container.get("env") or []:
                source = item.get("valueFrom") or {}
                if "secretKeyRef" in source:
                    wanted.add(("Secret", source["secretKeyRef"]["name"]))
                if "configMapKeyRef" in source:
                    wanted.add(("ConfigMap", source["configMapKeyRef"]["name"]))
            for item in container.get("envFrom") or []:
                if "secretRef" in item:
                    wanted.add(("Secret", item["secretRef"]["name"]))
                if "configMapRef" in item:
                    wanted.add(("ConfigMap", item["configMapRef"]["name"]))
        found: dict[tuple[str, str], dict[str, str]] = {}
        for kind, name in wanted:
            try:
                if kind == "Secret":
                    raw = await self._read_secret(namespace, name)
                    found[(kind, name)] = {k: v.decode("utf-8", "replace") for k, v in raw.items()}
                else:
                    cm = await asyncio.to_thread(
                        self.core.read_namespaced_config_map, name, namespace
                    )
                    found[(kind, name)] = dict(cm.data or {})
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        return lambda kind, name: found.get((kind, name))

    def _runner_changed(self, record: PodRecord, runner: PodRunner) -> None:
        self._mark_dirty(record.uid)
        for state in runner.containers.values():
            if state.phase == "waiting" and state.waiting_reason == "CrashLoopBackOff":
                key = f"backoff-{state.name}-{state.restart_count}"
                if key not in record.events_sent:
                    record.events_sent.add(key)
                    self._spawn(
                        self._event(
                            record,
                            "BackOff",
                            f"Back-off restarting failed container {state.name}",
                            "Warning",
                        )
                    )
            if state.phase == "running":
                key = f"started-{state.name}-{state.restart_count}"
                if key not in record.events_sent:
                    record.events_sent.add(key)
                    self._spawn(
                        self._event(record, "Started", f"Started container {state.name}", "Normal")
                    )

    def _mark_dirty(self, uid: str) -> None:
        self._dirty.add(uid)
        self._dirty_event.set()

    async def _status_writer(self) -> None:
        while True:
            await self._dirty_event.wait()
            await asyncio.sleep(0.02)  # coalesce bursts
            self._dirty_event.clear()
            batch, self._dirty = self._dirty, set()
            for uid in batch:
                record = self.pods.get(uid)
                if record is None or (record.terminating and record.runner is None):
                    continue
                try:
                    await self._write_status(record)
                except client.ApiException as exc:
                    if exc.status != 404:
                        log.warning(
                            "status of %s/%s: %s", record.namespace, record.name, exc.reason
                        )
                        self._mark_dirty(uid)
                        await asyncio.sleep(0.5)

    async def _write_status(self, record: PodRecord) -> None:
        state = self.nodes[record.node]
        if record.fixed_status is not None:
            status = dict(record.fixed_status)
        elif record.runner is not None:
            runner = record.runner
            status = podstatus.render(
                list(runner.containers.values()),
                restart_policy=runner.restart_policy,
                pod_ip=runner.pod_ip,
                host_ip=state.addresses.host_ip,
                started_at=runner.started_at,
                now=time.time(),
                previous_conditions=record.conditions,
                node_ready=not state.down,
            )
            record.conditions = status["conditions"]
        else:
            return
        await asyncio.to_thread(
            self.core.patch_namespaced_pod_status, record.name, record.namespace, {"status": status}
        )

    async def _terminate(self, record: PodRecord, *, grace: float, finalize: bool) -> None:
        record.terminating = True
        if record.runner is not None:
            if finalize:
                await self._event(record, "Killing", "Stopping container(s)", "Normal")
            await record.runner.stop(grace)
        state = self.nodes[record.node]
        state.allocator.release(record.uid)
        if record.ip:
            state.addresses.release(record.ip)
        self.pods.pop(record.uid, None)
        if finalize:
            await self._finalize_delete(record.namespace, record.name, record.uid)

    async def _finalize_delete(self, namespace: str, name: str, uid: str) -> None:
        with contextlib.suppress(client.ApiException):
            await asyncio.to_thread(
                self.core.delete_namespaced_pod,
                name,
                namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
                ),
            )

    # ================================================================== events
    async def _event(self, record: PodRecord, reason: str, message: str, kind: str) -> None:
        involved = {
            "kind": "Pod",
            "namespace": record.namespace,
            "name": record.name,
            "uid": record.uid,
            "apiVersion": "v1",
        }
        await self._post_event(record.namespace, involved, reason, message, kind, record.node)

    async def _node_event(self, node: str, reason: str, message: str, kind: str) -> None:
        involved = {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"}
        await self._post_event("default", involved, reason, message, kind, node)

    async def _post_event(
        self,
        namespace: str,
        involved: Mapping[str, str],
        reason: str,
        message: str,
        kind: str,
        node: str,
    ) -> None:
        now = rfc3339(time.time())
        body = {
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": dict(involved),
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "matrixserve-node-emulator",
            "reportingInstance": node,
        }
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, namespace, body)
        except client.ApiException as exc:
            log.debug("event %s for %s not recorded: %s", reason, involved.get("name"), exc.reason)


def _with_status(pod: dict[str, Any], pod_ip: str, host_ip: str) -> dict[str, Any]:
    status = dict(pod.get("status") or {})
    status.update({"podIP": pod_ip, "hostIP": host_ip})
    return {**pod, "status": status}


def _failed_status(reason: str, message: str) -> dict[str, Any]:
    return {"phase": "Failed", "reason": reason, "message": message}


def _waiting_status(
    pod: dict[str, Any], reason: str, message: str, record: PodRecord, state: NodeState
) -> dict[str, Any]:
    now = rfc3339(time.time())
    return {
        "phase": "Pending",
        "hostIP": state.addresses.host_ip,
        "podIP": record.ip,
        "podIPs": [{"ip": record.ip}] if record.ip else [],
        "startTime": now,
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {
                "type": "Ready",
                "status": "False",
                "reason": "ContainersNotReady",
                "lastTransitionTime": now,
            },
            {
                "type": "ContainersReady",
                "status": "False",
                "reason": "ContainersNotReady",
                "lastTransitionTime": now,
            },
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}},
                "lastState": {},
            }
            for c in pod["spec"].get("containers") or []
        ],
    }
