"""MatrixServe: a Kubernetes operator and control plane for disaggregated LLM/MoE serving.

Layers (checked by import-linter, see ``pyproject.toml``):

- :mod:`matrixserve.api` — the contract: resource models, names, the ZooKeeper layout, the
  engine protocol, the catalogue of hardware and model facts; pure.
- :mod:`matrixserve.domain` — pure decisions: one package per kind and kind-neutral modules; no
  I/O libraries, no clock.
- :mod:`matrixserve.coordination` — the one ZooKeeper session owner (the engine stub uses it too).
- :mod:`matrixserve.adapters` — the Kubernetes adapter and each kind's ZooKeeper store.
- :mod:`matrixserve.handlers` — kopf handlers: parse → observe → plan → apply → write status.
- :mod:`matrixserve.gateway` — the OpenAI-compatible gateway, a program of its own beside the
  handlers.

See ``docs/architecture.md``.

:mod:`matrixserve.devcluster` is developer tooling: a real local Kubernetes control plane and
ZooKeeper for tests and the demo.
"""

__version__ = "0.1.0"
