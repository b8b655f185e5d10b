"""A fork server for engine-stub containers: the engine's modules are imported once, and each
container is a fork of this warm process instead of a fresh interpreter.

A real node starts a container from an image already on disk in well under a second; a fresh
Python interpreter importing the engine costs ~0.3 s of CPU, and eight of them at once on a
2-core machine cost seconds that have nothing to do with the control plane. The zygote removes
that artefact of the emulation (DeepServe's pre-warmed pods make the same point about real
start-up).

Protocol on a Unix socket, one JSON object per line:

- ``{"spawn": {"argv": [...], "env": {...}, "cwd": "...", "log": "..."}}`` -> ``{"pid": N}``; the child
  leads its own session, writes stdout/stderr to ``log`` and runs ``python -m enginestub`` with
  ``argv[3:]`` (``argv`` is ``[python, "-m", "enginestub", ...]``);
- ``{"wait": N}`` -> ``{"code": C}`` once child N has exited (C as ``subprocess`` reports it:
  negative for a signal).

Single-threaded (a select loop and a self-pipe for SIGCHLD), so forking is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any

# Warm the engine: everything ``python -m enginestub`` imports.
import enginestub.__main__
import enginestub.engine.core
import enginestub.engine.resident
import enginestub.engine.server
import enginestub.engine.warm  # noqa: F401


def _child(spec: dict[str, Any], listener: socket.socket) -> None:
    code = 1
    try:
        listener.close()
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        argv = spec["argv"][3:]
        sys.argv = ["python -m enginestub", *argv]
        from enginestub.__main__ import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    exited: dict[int, int] = {}
    waiting: dict[int, list[socket.socket]] = {}
    buffers: dict[socket.socket, bytes] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")

    def reply(conn: socket.socket, payload: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(payload).encode() + b"\n")

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            exited[pid] = code
            for conn in waiting.pop(pid, []):
                reply(conn, {"code": code})

    while not stop:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _addr = listener.accept()
                buffers[conn] = b""
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "wake":
                os.read(wake_r, 4096)
                reap()
            else:
                conn = key.fileobj  # type: ignore[assignment]
                data = conn.recv(65536)
                if not data:
                    sel.unregister(conn)
                    buffers.pop(conn, None)
                    conn.close()
                    continue
                buffers[conn] += data
                while b"\n" in buffers[conn]:
                    line, buffers[conn] = buffers[conn].split(b"\n", 1)
                    request = json.loads(line)
                    if "spawn" in request:
                        pid = os.fork()
                        if pid == 0:
                            _child(request["spawn"], listener)
                        reply(conn, {"pid": pid})
                    elif "wait" in request:
                        pid = int(request["wait"])
                        if pid in exited:
                            reply(conn, {"code": exited[pid]})
                        else:
                            waiting.setdefault(pid, []).append(conn)
        reap()
    listener.close()


if __name__ == "__main__":
    serve(sys.argv[1])
