"""The MatrixServe gateway (P/D-Serve §3.5): an OpenAI-compatible API in front of the P/D groups.

``python -m matrixserve.gateway``. Requests are routed by scenario (header
``X-MatrixServe-Scenario`` or the ``model`` name) to the groups serving it, and forwarded on
demand to a prefill entrance that accepts, within the scenario's TTFT budget. See
``docs/gateway.md``.
"""
