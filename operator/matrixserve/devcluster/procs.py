"""Start local processes detached, remember them by pid, stop exactly those.

A pid file records the pid *and* the process start time from ``/proc/<pid>/stat``; a process is
only ever signalled when both match, so a recycled pid never gets a signal meant for ours.
Each process leads its own session, so stopping it stops its whole process group (and nothing
else).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it is gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    start_time: int
    argv: tuple[str, ...]
    log: str

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time


class Supervisor:
    """Processes of one state dir: ``<state>/pids/<name>.json``, ``<state>/logs/<name>.log``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.pid_dir = state_dir / "pids"
        self.log_dir = state_dir / "logs"
        # Children started by this Supervisor; polled so they never linger as zombies while the
        # starting process (a test session, say) is still alive.
        self._children: list[subprocess.Popen[bytes]] = []

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ProcessRecord:
        """Start ``argv`` detached (own session), stdout+stderr to its log; record its pid."""
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        existing = self.record(name)
        if existing is not None and existing.alive():
            raise RuntimeError(f"{name} is already running as pid {existing.pid}")
        log = self.log_path(name)
        with log.open("ab") as out:
            out.write(
                f"\n=== start {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(argv)}\n".encode()
            )
            out.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )
        start_time = None
        for _ in range(100):
            start_time = process_start_time(proc.pid)
            if start_time is not None:
                break
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        record = ProcessRecord(name, proc.pid, start_time or -1, tuple(argv), str(log))
        (self.pid_dir / f"{name}.json").write_text(
            json.dumps(record.__dict__ | {"argv": list(argv)})
        )
        self._children.append(proc)
        return record

    def record(self, name: str) -> ProcessRecord | None:
        path = self.pid_dir / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return ProcessRecord(
            data["name"],
            int(data["pid"]),
            int(data["start_time"]),
            tuple(data["argv"]),
            data["log"],
        )

    def records(self) -> list[ProcessRecord]:
        if not self.pid_dir.exists():
            return []
        found = (self.record(p.stem) for p in sorted(self.pid_dir.glob("*.json")))
        return [r for r in found if r is not None]

    def exited(self, name: str) -> bool:
        """True if the named process was started and is gone (reaping it if it is our child)."""
        self._reap()
        record = self.record(name)
        return record is not None and not record.alive()

    def returncode(self, name: str) -> int | None:
        """The exit status of the named process if it was our child and has exited."""
        self._reap()
        record = self.record(name)
        for proc in self._children:
            if record is not None and proc.pid == record.pid:
                return proc.poll()
        return None

    def stop(self, name: str, grace: float = 10.0) -> bool:
        """SIGTERM the process group, SIGKILL after ``grace`` s. True if something was stopped."""
        record = self.record(name)
        if record is None:
            return False
        stopped = False
        if record.alive():
            stopped = True
            _signal_group(record.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and record.alive():
                self._reap()
                time.sleep(0.05)
            if record.alive():
                _signal_group(record.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and record.alive():
                    self._reap()
                    time.sleep(0.05)
        (self.pid_dir / f"{name}.json").unlink(missing_ok=True)
        return stopped

    def _reap(self) -> None:
        for child in self._children:
            child.poll()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # The process was started with start_new_session=True, so its pgid is its pid; fall back to
    # the pid alone if it has already left its group.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        os.kill(pid, sig)
