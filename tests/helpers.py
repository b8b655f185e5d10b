"""Small helpers shared by the tests (``pythonpath`` in pyproject puts this folder on the path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60, what: str = "condition", every: float = 0.1
) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
