"""MatrixServe: a Kubernetes operator and control plane for disaggregated LLM/MoE serving.

Layers (checked by import-linter, see ``pyproject.toml``):

- :mod:`matrixserve.domain` and :mod:`matrixserve.api` — pure decision logic and the resource
  models; no I/O libraries, no clock.
- :mod:`matrixserve.adapters` — Kubernetes, ZooKeeper and engine HTTP clients.
- :mod:`matrixserve.handlers` — kopf handlers: parse → observe → plan → apply → write status.

:mod:`matrixserve.devcluster` is developer tooling: a real local Kubernetes control plane and
ZooKeeper for tests and the demo.
"""

__version__ = "0.1.0"
