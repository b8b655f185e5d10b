"""Namespaces on the dev cluster that are ready for pods.

The ServiceAccount admission plugin rejects pods until the namespace's ``default`` service
account exists with its token; the controller-manager creates both a moment after the namespace.
"""

from __future__ import annotations

import time

from kubernetes import client


def wait_for_service_account(core: client.CoreV1Api, namespace: str, timeout: float = 30) -> None:
    """Return once ``namespace``'s default service account has its token; TimeoutError if not."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if core.read_namespaced_service_account("default", namespace).secrets:
                return
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"namespace {namespace}: default service account got no token within {timeout:.0f}s"
            )
        time.sleep(0.1)
