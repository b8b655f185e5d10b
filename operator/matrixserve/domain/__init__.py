"""Pure decision logic: ratio model, scale-out path, recovery planning, EPLB, placement.

Everything here is a pure function over frozen snapshots (no kopf, kubernetes, kazoo, httpx or
prometheus_client imports, no clock: callers pass ``now``). See ``docs/architecture.md``.
"""
