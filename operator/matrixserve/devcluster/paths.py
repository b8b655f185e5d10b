"""Where the dev cluster keeps its build cache and its per-cluster state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Build and tool cache, shared by every cluster on this machine (outside the checkout)."""
    explicit = os.environ.get("MATRIXSERVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "matrixserve"


def default_state_dir() -> Path:
    """State of the default cluster (``make cluster-up``): pids, logs, data, kubeconfig."""
    explicit = os.environ.get("MATRIXSERVE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "matrixserve" / "devcluster"
