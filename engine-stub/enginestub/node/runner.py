"""Run a pod's containers as local processes, the kubelet's way.

Each container is one process in its own session (its process group is the "container"), with
stdout/stderr in ``<pod dir>/<container>.log``. Readiness and liveness probes run on the pod's
loopback IP. Restarts follow ``restartPolicy`` with the kubelet's exponential back-off
(base doubling to a cap, reset after 10 minutes of good running). Stopping sends SIGTERM to the
group, then SIGKILL after the grace period.

Faults for tests: :meth:`PodRunner.hang` (SIGSTOP, the P/D-Serve "hang"), :meth:`PodRunner.kill`
(node down: everything SIGKILLed and held down until :meth:`PodRunner.revive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from enginestub.node.podspec import ContainerPlan, Probe
from matrixserve.api import rfc3339

ENGINE_ARGV = [sys.executable, "-m", "enginestub"]


class ZygoteProcess:
    """A container forked by the zygote; looks enough like an asyncio subprocess for the runner."""

    def __init__(self, socket_path: str, pid: int) -> None:
        self.socket_path = socket_path
        self.pid = pid
        self.returncode: int | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
            try:
                writer.write(json.dumps({"wait": self.pid}).encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
                self.returncode = int(json.loads(line)["code"]) if line else -9
            finally:
                writer.close()
        return self.returncode


class Zygote:
    """Client of the engine fork server (:mod:`enginestub.node.zygote`)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def spawn(self, plan: ContainerPlan, log: Path, cwd: Path) -> ZygoteProcess:
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        try:
            spec = {"argv": list(plan.argv), "env": plan.env, "cwd": str(cwd), "log": str(log)}
            writer.write(json.dumps({"spawn": spec}).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        if not line:
            raise OSError("the zygote closed the connection")
        return ZygoteProcess(self.socket_path, int(json.loads(line)["pid"]))


BACKOFF_RESET_AFTER = 600.0
# kubelet: back-off resets after 10 min of running


@dataclass
class Terminated:
    exit_code: int
    reason: str
    started_at: float
    finished_at: float
    message: str = ""
    signal: int | None = None


@dataclass
class ContainerState:
    """What the kubelet would report for one container."""

    name: str
    image: str
    phase: str = "waiting"  # waiting | running | terminated
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    started_at: float | None = None
    terminated: Terminated | None = None
    last_terminated: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    pid: int | None = None


@dataclass
class PodRunner:
    """The processes of one pod on one emulated node."""

    namespace: str
    name: str
    uid: str
    pod_ip: str
    plans: list[ContainerPlan]
    restart_policy: str
    workdir: Path
    on_change: Callable[[PodRunner], None]
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    containers: dict[str, ContainerState] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    zygote: Zygote | None = None
    _procs: dict[str, Any] = field(default_factory=dict)  # asyncio Process or ZygoteProcess
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False
    _held: bool = False  # node down: do not restart
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _http: httpx.AsyncClient | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for plan in self.plans:
            self.containers[plan.name] = ContainerState(plan.name, plan.image)
            self._tasks.append(asyncio.create_task(self._run(plan), name=f"{self.key}/{plan.name}"))

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items() if p.returncode is None}

    # ------------------------------------------------------------------ lifecycle
    async def _run(self, plan: ContainerPlan) -> None:
        state = self.containers[plan.name]
        backoff = self.backoff_base
        # The kubelet restarts a container at once the first time it exits, and backs off from
        # the second (0 s, then 10 s doubling: kubernetes/kubernetes#133472, website#41570).
        immediate = True
        while not self._stopping:
            if self._held:
                await self._wait_wake(None)
                continue
            began = time.time()
            proc = await self._spawn(plan, state)
            if proc is None:
                exit_code = 128
            else:
                probes = [
                    asyncio.create_task(self._probe_loop(plan, state, plan.readiness, "readiness")),
                    asyncio.create_task(self._probe_loop(plan, state, plan.liveness, "liveness")),
                ]
                exit_code = await proc.wait()
                for task in probes:
                    task.cancel()
                for task in probes:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self._procs.pop(plan.name, None)
            ended = time.time()
            if proc is not None:
                sig = -exit_code if exit_code < 0 else None
                code = 128 + sig if sig is not None else exit_code
                reason = "Completed" if code == 0 else "Error"
                message = ""
                if self._held and not self._stopping:
                    reason, message = "NodeDown", "the node went down (injected fault)"
                state.terminated = Terminated(code, reason, began, ended, message, sig)
            state.phase, state.ready, state.pid = "terminated", False, None
            if self._held and not self._stopping:
                self._notify()
                # Node down: nothing runs until it is back; then, as a kubelet after a reboot,
                # the container starts again only if its pod's restartPolicy says so.
                while self._held and not self._stopping:
                    await self._wait_wake(None)
                if not self._stopping and self._restarts(state):
                    state.last_terminated, state.terminated = state.terminated, None
                    state.restart_count += 1
                    continue
                return
            if self._stopping or not self._restarts(state):
                self._notify()
                return
            if ended - began > BACKOFF_RESET_AFTER:
                backoff, immediate = self.backoff_base, True
            if not immediate:
                # The exit and the back-off in one status (the back-off decided before anything
                # is posted): a reader never has to guess how long the restart will wait.
                state.phase = "waiting"
                state.waiting_reason = "CrashLoopBackOff"
                code_now = state.terminated.exit_code if state.terminated else -1
                state.waiting_message = (
                    f"back-off {backoff:g}s restarting failed container={plan.name} "
                    f"pod={self.name}_{self.namespace}({self.uid}) (exit code {code_now})"
                )
                self._notify()
                await self._wait_wake(backoff)
                backoff = min(backoff * 2, self.backoff_max)
            else:
                self._notify()  # exited; restarted at once
            immediate = False
            if self._stopping:
                return
            state.last_terminated = state.terminated
            state.terminated = None
            state.restart_count += 1

    def _restarts(self, state: ContainerState) -> bool:
        """Whether a container that ended starts again, by the pod's ``restartPolicy``."""
        if self.restart_policy == "Never":
            return False
        clean = state.terminated is not None and state.terminated.exit_code == 0
        return not (self.restart_policy == "OnFailure" and clean)

    async def _spawn(self, plan: ContainerPlan, state: ContainerState) -> Any:
        log = self.workdir / f"{plan.name}.log"
        cwd = (
            Path(plan.working_dir)
            if plan.working_dir and Path(plan.working_dir).is_dir()
            else self.workdir
        )
        proc = await self._fork_from_zygote(plan, log, cwd)
        if proc is None:
            try:
                with log.open("ab") as out:
                    stamp = rfc3339.format_seconds(time.time())
                    out.write(f"=== start {stamp}: {' '.join(plan.argv)}\n".encode())
                    out.flush()
                    proc = await asyncio.create_subprocess_exec(
                        *plan.argv,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=out,
                        stderr=asyncio.subprocess.STDOUT,
                        env=plan.env,
                        cwd=str(cwd),
                        start_new_session=True,
                    )
            except OSError as exc:
                now = time.time()
                state.terminated = Terminated(
                    128,
                    "StartError",
                    now,
                    now,
                    f"failed to start {plan.argv[0]!r}: {exc.strerror or exc}",
                )
                return None
        self._procs[plan.name] = proc
        if self._held:
            _signal_group(proc.pid, signal.SIGKILL)  # the node went down while it was starting
        state.phase, state.started_at, state.pid = "running", time.time(), proc.pid
        state.ready = plan.readiness is None
        self._notify()
        return proc

    async def _fork_from_zygote(self, plan: ContainerPlan, log: Path, cwd: Path) -> Any:
        """Engine-stub containers fork from the warm zygote when there is one."""
        if self.zygote is None or list(plan.argv[:3]) != ENGINE_ARGV:
            return None
        try:
            with log.open("ab") as out:
                stamp = rfc3339.format_seconds(time.time())
                out.write(f"=== start {stamp} (zygote fork): {' '.join(plan.argv)}\n".encode())
            return await self.zygote.spawn(plan, log, cwd)
        except OSError:
            return None  # no zygote: a fresh interpreter, as usual

    async def _wait_wake(self, timeout: float | None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    # ------------------------------------------------------------------ probes
    async def _probe_loop(
        self, plan: ContainerPlan, state: ContainerState, spec: Probe | None, kind: str
    ) -> None:
        if spec is None:
            return
        await asyncio.sleep(spec.initial_delay)
        successes = failures = 0
        while True:
            ok = await self._probe_once(spec, plan)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if kind == "readiness":
                if ok and successes >= spec.success_threshold and not state.ready:
                    state.ready = True
                    self._notify()
                elif not ok and failures >= spec.failure_threshold and state.ready:
                    state.ready = False
                    self._notify()
            elif not ok and failures >= spec.failure_threshold:
                proc = self._procs.get(plan.name)
                if proc is not None:
                    _signal_group(proc.pid, signal.SIGKILL)
                return
            await asyncio.sleep(spec.period)

    async def _probe_once(self, spec: Probe, plan: ContainerPlan) -> bool:
        try:
            if spec.kind == "http":
                if self._http is None:
                    self._http = httpx.AsyncClient(trust_env=False)
                response = await self._http.get(
                    f"http://{self.pod_ip}:{spec.port}{spec.path}", timeout=spec.timeout
                )
                return 200 <= response.status_code < 400
            if spec.kind == "tcp":
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.pod_ip, spec.port), spec.timeout
                )
                writer.close()
                return True
            proc = await asyncio.create_subprocess_exec(
                *spec.command,
                env=plan.env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                return await asyncio.wait_for(proc.wait(), spec.timeout) == 0
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return False
        except (httpx.HTTPError, OSError, TimeoutError):
            return False

    # ------------------------------------------------------------------ control
    async def stop(self, grace: float) -> None:
        """SIGTERM every container's group, SIGKILL after ``grace`` seconds; wait for exit."""
        self._stopping = True
        self._wake.set()
        for proc in list(self._procs.values()):
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGCONT)  # a hung (stopped) process must see TERM
                _signal_group(proc.pid, signal.SIGTERM)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=max(grace, 0.0))
            if pending:
                for proc in list(self._procs.values()):
                    if proc.returncode is None:
                        _signal_group(proc.pid, signal.SIGKILL)
                await asyncio.wait(pending, timeout=10)
        if self._http is not None:
            await self._http.aclose()

    def kill(self) -> None:
        """Node down: SIGKILL everything now and keep it down until :meth:`revive`."""
        self._held = True
        for proc in list(self._procs.values()):
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGKILL)

    def revive(self) -> None:
        """Node back: each container the node's fault killed starts again if the pod's
        ``restartPolicy`` says so (counting a restart); one never started starts now."""
        if not self._held:
            return
        self._held = False
        self._wake.set()

    @property
    def held(self) -> bool:
        """Whether the runner is held down by a node-down fault."""
        return self._held

    def hang(self, stopped: bool) -> list[int]:
        """SIGSTOP (hang) or SIGCONT every container's group; returns the pids touched."""
        touched = []
        for proc in list(self._procs.values()):
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                touched.append(proc.pid)
        return touched

    def _notify(self) -> None:
        self.on_change(self)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
