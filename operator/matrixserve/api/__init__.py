"""Pydantic models of the MatrixServe custom resources (group ``matrixserve.io``, ``v1alpha1``).

The CRDs in ``crds/`` are the contract; these models mirror them and a contract test checks that
they agree. Pure: no I/O imports.
"""
