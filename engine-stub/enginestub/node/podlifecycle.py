"""The emulated kubelet's pod side (SYSTEM.md §5): watch the pods bound to our nodes, admit them
(the Ascend device plugin's NPU grant, a loopback pod IP, the environment from :mod:`.podenv`),
run their containers as processes (:mod:`.runner`), write their ``status`` back as the kubelet
would, and on deletion stop them within the grace period and finalise the delete.

Pods are handled concurrently, as a kubelet admits them in parallel, but each pod's watch events
strictly in order. Status writes are coalesced: a change marks the pod dirty and one writer
patches the dirty pods' status every few tens of milliseconds.

A pod whose Secret volume cannot be set up yet (its Secret missing) waits in ContainerCreating
with the kubelet's ``FailedMount`` Warning Event, and the mount is tried again with a growing
pause (``MOUNT_RETRY``), in the pod's order of events (a deletion meanwhile wins).

A down node's kubelet (the node-down fault) does nothing for its pods: no admission, no
status write, no finalised delete; a pod deleted meanwhile stays Terminating. Each pod's latest
event waits ("parked") until the node is back; then the kubelet acts as one returning: it
replays that event (a pod deleted meanwhile is finalised, one gone is cleaned up: processes,
NPUs, address, volumes), and restarts the others' containers by their ``restartPolicy``. On
start, the volumes and credentials of pods gone while the emulator was not running are removed
(the kubelet's orphaned pod directories).

The pods' cluster DNS names (:mod:`.hosts`) are written into hosts files for the namespaces of
the pods run here: a pod's own before its containers start, and every half second what changed
(pods come and go, turn Ready or not, Services change; pods other kubelets run, by the IP their
status shows, are named too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from enginestub.node import allocator, podspec, podstatus, services
from enginestub.node.events import Events
from enginestub.node.hosts import HostsFiles, NamedPod, named_pod, published
from enginestub.node.listwatch import watch_events
from enginestub.node.podenv import PodEnvironment, remove_volumes
from enginestub.node.runner import PodRunner, Zygote
from enginestub.node.state import EmulatorState, NodeState, PodRecord
from matrixserve.api import rfc3339

log = logging.getLogger("enginestub.node")
MOUNT_RETRY = (0.5, 8.0)  # the first pause before a failed mount is tried again, and the longest
HOSTS_EVERY = 0.5  # seconds between two looks at what the hosts files should say


class PodLifecycle:
    """Runs the pods bound to our nodes, from admission to the finalised delete."""

    def __init__(
        self, shared: EmulatorState, events: Events, proxy: services.ServiceProxy | None
    ) -> None:
        self.shared = shared
        self.events = events
        self.proxy = proxy
        self.env = PodEnvironment(shared.config, shared.core)
        self.zygote: Zygote | None = None  # set by the emulator once the zygote is up
        self._watch: watch.Watch | None = None
        self._pod_chains: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._dirty_event = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        # uid -> (kind, pod): the latest event of a pod on a down node, for when it is back
        self._parked: dict[str, tuple[str, dict[str, Any]]] = {}
        self.hosts = HostsFiles(shared.config.state_dir)
        # uid -> pod: other kubelets' pods with a hostname and subdomain (their DNS names)
        self._foreign: dict[str, dict[str, Any]] = {}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a fire-and-forget coroutine, keeping a reference until it is done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ watch and dispatch
    async def watch(self) -> None:
        """List+watch the pods bound to any node (our nodes' are ours to run)."""

        def keep(stream: watch.Watch) -> None:
            self._watch = stream  # so that shutdown can stop it

        listed: set[str] | None = set()  # the first listing's pods, until it is complete
        async for kind, pod in watch_events(
            self.shared.core.list_pod_for_all_namespaces,
            stopped=self.shared.stop.is_set,
            key=lambda pod: pod["metadata"]["uid"],
            known=self._known,
            what="pod",
            on_stream=keep,
            field_selector="spec.nodeName!=",
        ):
            if kind == "SYNCED":
                if listed is not None:
                    self._remove_orphans(listed)
                    listed = None
                continue
            if kind == "SYNC" and listed is not None:
                listed.add(pod["metadata"]["uid"])
            self._dispatch(kind, pod)

    def _known(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The pods a relisting must account for: those run here, those of a down node not
        admitted yet, and other kubelets' pods with DNS names (a deletion missed while the watch
        was broken is then still seen)."""
        for uid, record in list(self.shared.pods.items()):
            yield uid, record.pod
        for uid, (kind, pod) in list(self._parked.items()):
            if kind != "DELETED" and uid not in self.shared.pods:
                yield uid, pod
        yield from list(self._foreign.items())

    def _workdir(self, namespace: str, name: str, uid: str) -> Path:
        """The pod's folder: its logs, credentials and volumes."""
        return self.shared.config.state_dir / "pods" / f"{namespace}_{name}_{uid}"

    def _remove_orphans(self, listed: set[str]) -> None:
        """The volumes and credentials of pods gone while this emulator was not running (the
        kubelet's orphaned pod directories); their logs stay, as a kubelet keeps them."""
        folder = self.shared.config.state_dir / "pods"
        if not folder.is_dir():
            return
        for workdir in folder.iterdir():
            uid = workdir.name.rsplit("_", 1)[-1]
            if workdir.is_dir() and uid not in listed and uid not in self.shared.pods:
                remove_volumes(workdir)

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
        if node not in self.shared.nodes:
            self._other_kubelets_pod(kind, uid, pod)
            return
        state = self.shared.nodes[node]
        if state.down:
            # A down server's kubelet sees nothing; the latest word on the pod waits for it.
            if kind not in ("MOUNT", "RESUME"):
                self._parked[uid] = (kind, pod)
            return
        if kind == "RESUME":
            await self._resume(uid, state)
            return
        # An event newer than one parked while the node was down (the node is back, the pod's
        # resume not handled yet): the parked one is stale.
        self._parked.pop(uid, None)
        record = self.shared.pods.get(uid)
        if kind == "DELETED":
            if record is not None:
                await self._terminate(record, grace=0.0, finalize=False)
            return
        if kind == "MOUNT":  # a failed mount tried again (see _mount_failed)
            if record is not None and record.mounting and not record.terminating:
                await self._start(record, self.shared.nodes[node])
            return
        if record is not None:
            record.pod = pod
        if meta.get("deletionTimestamp"):
            if record is None:
                # run before this emulator's start or its node's fault: its files go too
                remove_volumes(self._workdir(meta["namespace"], meta["name"], uid))
                await self._finalize_delete(meta["namespace"], meta["name"], uid)
            elif not record.terminating:
                record.terminating = True  # now: nothing restarts it while it stops
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                self._spawn(self._terminate(record, grace=grace, finalize=True))
            return
        if record is None:
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                return
            await self._admit(pod)

    # ------------------------------------------------------------------ DNS names
    def _other_kubelets_pod(self, kind: str, uid: str, pod: dict[str, Any]) -> None:
        """Another kubelet runs it (another emulator's, a real one): only its DNS names matter
        here."""
        spec = pod.get("spec") or {}
        if kind == "DELETED" or not (spec.get("hostname") and spec.get("subdomain")):
            self._foreign.pop(uid, None)
        else:
            self._foreign[uid] = pod

    def named_pods(self) -> list[NamedPod]:
        """Every pod the cluster DNS may name: ours by the IP given, others' by their status."""
        found = []
        for record in list(self.shared.pods.values()):
            ready = not record.terminating and podstatus.is_ready(record.conditions)
            found.append(named_pod(record.pod, record.ip, ready))
        for pod in list(self._foreign.values()):
            status = pod.get("status") or {}
            ready = not pod["metadata"].get("deletionTimestamp") and podstatus.is_ready(
                status.get("conditions") or []
            )
            found.append(named_pod(pod, status.get("podIP"), ready))
        return [pod for pod in found if pod is not None]

    def write_hosts(self) -> None:
        """The hosts file of each namespace a pod here runs in, where it changed."""
        services = self.proxy.services if self.proxy is not None else None
        namespaces = {record.namespace for record in list(self.shared.pods.values())}
        try:
            self.hosts.update(published(self.named_pods(), services), sorted(namespaces))
        except OSError as exc:
            log.warning("hosts files: %s", exc)

    async def hosts_writer(self) -> None:
        while True:
            self.write_hosts()
            await asyncio.sleep(HOSTS_EVERY)

    # ------------------------------------------------------------------ node down and back
    def node_down(self, node: str) -> None:
        """The node went down: every process of its pods is killed and held down."""
        for record in list(self.shared.pods.values()):
            if record.node == node and record.runner is not None:
                record.runner.kill()

    async def mark_not_ready(self, node: str) -> None:
        """What the node lifecycle controller does for a node gone NotReady (the dev cluster
        does not run it): each of its pods' Ready condition turns False, nothing else."""
        stamp = rfc3339.format_seconds(time.time())
        for record in list(self.shared.pods.values()):
            ready = next((c for c in record.conditions if c.get("type") == "Ready"), None)
            if record.node != node or ready is None or ready.get("status") == "False":
                continue
            ready.update(status="False", lastTransitionTime=stamp)
            with contextlib.suppress(client.ApiException):
                await asyncio.to_thread(
                    self.shared.core.patch_namespaced_pod_status,
                    record.name,
                    record.namespace,
                    {"status": {"conditions": [dict(ready)]}},
                )

    def node_back(self, node: str) -> None:
        """The node is back: each of its pods is resumed, in the pod's order of events."""
        pods = {uid: r.pod for uid, r in self.shared.pods.items() if r.node == node}
        for uid, (_, pod) in list(self._parked.items()):
            if pod.get("spec", {}).get("nodeName") == node:
                pods.setdefault(uid, pod)
        for pod in pods.values():
            self._dispatch("RESUME", pod)

    async def _resume(self, uid: str, state: NodeState) -> None:
        """A returning kubelet's sync of one pod: its latest event while the node was down is
        handled now; if the pod still runs here, its containers start again (by restartPolicy)
        and its status is written."""
        parked = self._parked.pop(uid, None)
        if parked is not None:
            await self._on_pod(*parked)
        record = self.shared.pods.get(uid)
        if record is None or record.terminating:
            return
        if record.runner is not None:
            record.runner.revive()
        elif record.mounting:
            await self._start(record, state)
        self.mark_dirty(uid)

    # ------------------------------------------------------------------ admission
    async def _admit(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        state = self.shared.nodes[pod["spec"]["nodeName"]]
        record = PodRecord(
            meta["uid"], meta["namespace"], meta["name"], state.server.node_name, pod
        )
        self.shared.pods[record.uid] = record
        wanted = podspec.npu_request(pod)
        try:
            await self._grant_npus(state, record, wanted)
        except (allocator.AllocationError, ValueError) as exc:
            failed = podstatus.failed(
                "UnexpectedAdmissionError", f"Allocate failed due to {exc}, which is unexpected"
            )
            await self._cannot_run(record, failed, "UnexpectedAdmissionError", str(exc))
            return
        record.ip = state.addresses.claim((pod.get("status") or {}).get("podIP"))
        await self._start(record, state)

    async def _start(self, record: PodRecord, state: NodeState) -> None:
        """Set up the pod's volumes and environment and run its containers."""
        pod = record.pod
        base_env = self.env.base(state, record)
        if self.proxy is not None:
            try:
                await asyncio.wait_for(self.proxy.synced.wait(), 30)
            except TimeoutError:
                log.warning("Services not listed after 30 s: %s starts without them", record.name)
            base_env.update(self.proxy.namespace_env(record.namespace))
        config = self.shared.config
        workdir = self._workdir(record.namespace, record.name, record.uid)
        record.workdir = workdir
        try:
            base_env.update(await self.env.service_account(record.namespace, pod, workdir))
            volumes = await self.env.secret_volumes(record.namespace, pod, workdir)
            lookup = await self.env.lookup(record.namespace, pod)
            plans = podspec.plan_containers(
                _with_status(pod, record.ip or "", state.addresses.host_ip),
                config.image_map,
                lookup,
                base_env,
                volumes,
            )
        except podspec.MountError as exc:
            await self._mount_failed(record, state, str(exc))
            return
        except podspec.UnknownImageError as exc:
            waiting = _waiting(record, state, "ErrImagePull", str(exc))
            await self._cannot_run(record, waiting, "Failed", f"Failed to pull image: {exc}")
            return
        except podspec.ContainerConfigError as exc:
            waiting = _waiting(record, state, "CreateContainerConfigError", str(exc))
            await self._cannot_run(record, waiting, "Failed", f"Error: {exc}")
            return
        if record.terminating or self.shared.pods.get(record.uid) is not record:
            remove_volumes(workdir)  # deleted while its volumes were set up
            return
        record.mounting, record.fixed_status = 0.0, None
        self.write_hosts()  # the pod's own name before it runs (its peers' ones are there)
        runner = PodRunner(
            namespace=record.namespace,
            name=record.name,
            uid=record.uid,
            pod_ip=record.ip or "",
            plans=plans,
            restart_policy=pod["spec"].get("restartPolicy", "Always"),
            workdir=workdir,
            on_change=lambda r: self._runner_changed(record, r),
            backoff_base=config.backoff_base,
            backoff_max=config.backoff_max,
            zygote=self.zygote,
        )
        record.runner = runner
        if state.down:
            runner.kill()
        runner.start()

    async def _mount_failed(self, record: PodRecord, state: NodeState, message: str) -> None:
        """The kubelet's way: the pod stays in ContainerCreating, a FailedMount Warning Event
        (once per message), the mount tried again after a pause that doubles up to a bound."""
        pause = MOUNT_RETRY[0] if not record.mounting else min(2 * record.mounting, MOUNT_RETRY[1])
        record.mounting = pause
        record.fixed_status = _waiting(record, state, "ContainerCreating", "")
        self.mark_dirty(record.uid)
        if f"mount-{message}" not in record.events_sent:
            record.events_sent.add(f"mount-{message}")
            await self.events.pod(record, "FailedMount", message, "Warning")

        async def again() -> None:
            await asyncio.sleep(pause)
            if self.shared.pods.get(record.uid) is record and not record.terminating:
                self._dispatch("MOUNT", record.pod)  # in the pod's order of events

        self._spawn(again())

    async def _grant_npus(self, state: NodeState, record: PodRecord, wanted: int) -> None:
        """The device plugin's part: which NPUs (never a faulty one). A grant already on the pod
        (an emulator restart) is adopted; a new one is recorded on the pod before anything
        runs."""
        granted_text = (record.pod["metadata"].get("annotations") or {}).get(allocator.ANNOTATION)
        if granted_text is not None:
            record.npus = allocator.parse_grant(granted_text)
            state.allocator.adopt(record.uid, record.npus)
            return
        record.npus = state.allocator.allocate(record.uid, wanted, state.devices.faulty_npus())
        grant = {allocator.ANNOTATION: allocator.format_grant(record.npus)}
        await asyncio.to_thread(
            self.shared.core.patch_namespaced_pod,
            record.name,
            record.namespace,
            {"metadata": {"annotations": grant}},
        )

    async def _cannot_run(
        self, record: PodRecord, status: dict[str, Any], reason: str, message: str
    ) -> None:
        """A pod this node will not run: its status stays fixed; a Warning Event says why."""
        record.fixed_status = status
        await self.events.pod(record, reason, message, "Warning")
        self.mark_dirty(record.uid)

    # ------------------------------------------------------------------ status
    def _runner_changed(self, record: PodRecord, runner: PodRunner) -> None:
        self.mark_dirty(record.uid)
        for state in runner.containers.values():
            if state.phase == "waiting" and state.waiting_reason == "CrashLoopBackOff":
                key = f"backoff-{state.name}-{state.restart_count}"
                if key not in record.events_sent:
                    record.events_sent.add(key)
                    self._spawn(
                        self.events.pod(
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
                        self.events.pod(
                            record, "Started", f"Started container {state.name}", "Normal"
                        )
                    )

    def mark_dirty(self, uid: str) -> None:
        """The pod's status changed: the status writer patches it soon."""
        self._dirty.add(uid)
        self._dirty_event.set()

    async def status_writer(self) -> None:
        while True:
            await self._dirty_event.wait()
            await asyncio.sleep(0.02)  # coalesce bursts
            self._dirty_event.clear()
            batch, self._dirty = self._dirty, set()
            for uid in batch:
                record = self.shared.pods.get(uid)
                if record is None or (record.terminating and record.runner is None):
                    continue
                if self.shared.nodes[record.node].down:
                    continue  # a down kubelet writes nothing; the node's return marks it again
                try:
                    await self._write_status(record)
                except client.ApiException as exc:
                    if exc.status != 404:
                        log.warning(
                            "status of %s/%s: %s", record.namespace, record.name, exc.reason
                        )
                        self.mark_dirty(uid)
                        await asyncio.sleep(0.5)

    async def _write_status(self, record: PodRecord) -> None:
        state = self.shared.nodes[record.node]
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
            self.shared.core.patch_namespaced_pod_status,
            record.name,
            record.namespace,
            {"status": status},
        )

    # ------------------------------------------------------------------ deletion
    async def _terminate(self, record: PodRecord, *, grace: float, finalize: bool) -> None:
        record.terminating = True
        if record.runner is not None:
            if finalize:
                await self.events.pod(record, "Killing", "Stopping container(s)", "Normal")
            await record.runner.stop(grace)
        if record.workdir is not None:
            remove_volumes(record.workdir)
        state = self.shared.nodes[record.node]
        state.allocator.release(record.uid)
        if record.ip:
            state.addresses.release(record.ip)
        self.shared.pods.pop(record.uid, None)
        if finalize and state.down:
            # The node went down while the pod stopped: the delete is finalised on its return.
            self._parked.setdefault(record.uid, ("MODIFIED", record.pod))
        elif finalize:
            await self._finalize_delete(record.namespace, record.name, record.uid)

    async def _finalize_delete(self, namespace: str, name: str, uid: str) -> None:
        with contextlib.suppress(client.ApiException):
            await asyncio.to_thread(
                self.shared.core.delete_namespaced_pod,
                name,
                namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
                ),
            )

    async def stop_all(self, grace: float) -> None:
        """On exit: stop watching and stop every pod's processes (the pods stay bound; an
        emulator restart starts them again)."""
        if self._watch is not None:
            self._watch.stop()
        runners = [r.runner for r in self.shared.pods.values() if r.runner is not None]
        await asyncio.gather(*(r.stop(grace) for r in runners), return_exceptions=True)


def _waiting(record: PodRecord, state: NodeState, reason: str, message: str) -> dict[str, Any]:
    return podstatus.waiting(
        record.pod,
        reason,
        message,
        pod_ip=record.ip,
        host_ip=state.addresses.host_ip,
        now=time.time(),
    )


def _with_status(pod: dict[str, Any], pod_ip: str, host_ip: str) -> dict[str, Any]:
    status = dict(pod.get("status") or {})
    status.update({"podIP": pod_ip, "hostIP": host_ip})
    return {**pod, "status": status}
