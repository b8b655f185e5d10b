"""One list+watch loop, as an informer runs it, for the emulator (pods, Services).

``list_watch`` lists the objects, reports each as ``("SYNC", obj)``, reports the known objects
missing from the listing as ``("DELETED", obj)``, then ``("SYNCED", {})``, then follows the watch
from the listing's resourceVersion (``ADDED``/``MODIFIED``/``DELETED``). On expiry (410 Gone), an
``ERROR`` event or any failure it pauses a second and lists again, until ``stopped()``. It runs
in a thread (the kubernetes client blocks); :func:`watch_events` hands its events to a coroutine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Any

from kubernetes import watch

log = logging.getLogger("enginestub.node")

Event = tuple[str, dict[str, Any]]


def list_watch(
    list_func: Callable[..., Any],
    emit: Callable[[Event], None],
    *,
    stopped: Callable[[], bool],
    key: Callable[[dict[str, Any]], Hashable],
    known: Callable[[], Iterable[tuple[Hashable, dict[str, Any]]]],
    what: str,
    on_stream: Callable[[watch.Watch], None] | None = None,
    **selectors: Any,
) -> None:
    while not stopped():
        try:
            listing = json.loads(list_func(_preload_content=False, **selectors).data)
            seen = set()
            for item in listing["items"]:
                seen.add(key(item))
                emit(("SYNC", item))
            for k, obj in list(known()):
                if k not in seen:
                    emit(("DELETED", obj))
            emit(("SYNCED", {}))
            stream = watch.Watch()
            if on_stream is not None:
                on_stream(stream)
            for event in stream.stream(
                list_func,
                resource_version=listing["metadata"]["resourceVersion"],
                timeout_seconds=240,
                allow_watch_bookmarks=True,
                **selectors,
            ):
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    emit((event["type"], event["raw_object"]))
                elif event["type"] == "ERROR":
                    break
                if stopped():
                    stream.stop()
        except Exception as exc:  # network, 410 Gone, API restarts: relist after a pause
            if stopped():
                return
            log.warning("%s watch restarting: %s", what, exc)
            time.sleep(1)


async def watch_events(
    list_func: Callable[..., Any],
    *,
    stopped: Callable[[], bool],
    key: Callable[[dict[str, Any]], Hashable],
    known: Callable[[], Iterable[tuple[Hashable, dict[str, Any]]]],
    what: str,
    on_stream: Callable[[watch.Watch], None] | None = None,
    **selectors: Any,
) -> AsyncIterator[Event]:
    """:func:`list_watch` in a daemon thread; its events, in order, to the running loop."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    threading.Thread(
        target=list_watch,
        args=(list_func, emit),
        kwargs={
            "stopped": stopped,
            "key": key,
            "known": known,
            "what": what,
            "on_stream": on_stream,
            **selectors,
        },
        daemon=True,
        name=f"{what}-watch",
    ).start()
    while True:
        yield await events.get()
