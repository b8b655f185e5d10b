"""Namespaces on the dev cluster that are ready for pods.

The ServiceAccount admission plugin rejects pods until the namespace's ``default`` service
account exists with its token; the controller-manager creates both a moment after the namespace.
"""

from __future__ import annotations

import time

from kubernetes import client

from matrixserve.devcluster import tools

ROOT_CA = "kube-root-ca.crt"  # the root-ca-cert-publisher's ConfigMap in every namespace


def wait_for_service_account(core: client.CoreV1Api, namespace: str, timeout: float = 30) -> None:
    """Return once a pod of ``namespace`` can have the default service account's token: the
    account exists, and the cluster's CA is published in the namespace (``kube-root-ca.crt``,
    which a projected token's volume holds) or, on Kubernetes 1.20, the account has its token
    Secret. TimeoutError if not."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            account = core.read_namespaced_service_account("default", namespace)
            # 1.20 admits a pod only once the account has its token Secret; later releases
            # project a requested token and the CA published in the namespace
            if account.secrets or (
                not tools.legacy() and core.read_namespaced_config_map(ROOT_CA, namespace)
            ):
                return
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"namespace {namespace}: default service account got no token within {timeout:.0f}s"
            )
        time.sleep(0.1)
