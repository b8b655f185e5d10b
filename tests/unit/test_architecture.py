"""The import contracts ``make lint`` enforces (``[tool.importlinter]`` in pyproject.toml) catch
what they are for: each deliberately wrong import below, added to a copy of the tree, breaks the
contract named beside it, while the untouched copy keeps every contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(REPO / "operator" / "matrixserve", root / "matrixserve")
    shutil.copytree(REPO / "engine-stub" / "enginestub", root / "enginestub")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint(root: Path) -> dict[str, bool]:
    """Contract name -> kept, from ``lint-imports`` run on the tree at ``root``."""
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        check=False,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "COLUMNS": "500"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdicts = {}
    for line in done.stdout.splitlines():
        for verdict in (" KEPT", " BROKEN"):
            if verdict in line and not line.startswith(("-", " ")):
                verdicts[line.split(verdict)[0].strip()] = verdict == " KEPT"
    assert verdicts, done.stdout + done.stderr
    assert (done.returncode == 0) == all(verdicts.values()), done.stdout
    return verdicts


def test_the_tree_as_it_is_keeps_every_contract(pristine: Path) -> None:
    verdicts = lint(pristine)
    assert len(verdicts) >= 13
    assert all(verdicts.values()), [name for name, kept in verdicts.items() if not kept]


WRONG = [
    # (file to add the import to, the import, the contract it breaks)
    (
        "matrixserve/domain/gateway/routing.py",
        "from matrixserve.domain import pdgroup",
        "Kinds are independent: domain",
    ),
    (
        # a new kind's package is covered without being listed anywhere
        "matrixserve/domain/warmpool/__init__.py",
        "from matrixserve.domain.pdgroup import plan",
        "Kinds are independent: domain",
    ),
    (
        "matrixserve/handlers/warmpool.py",
        "from matrixserve.handlers.pdgroup import install",
        "Kinds are independent: handlers",
    ),
    (
        "matrixserve/handlers/reconciler.py",
        "from matrixserve.domain.pdgroup import plan",
        "PDGroup's packages are its own",
    ),
    (
        # another kind's handlers, across layers
        "matrixserve/handlers/warmpool.py",
        "from matrixserve.domain.pdgroup.pods import pod_manifest",
        "PDGroup's packages are its own",
    ),
    (
        "matrixserve/gateway/discovery.py",
        "from matrixserve.adapters.zk_groups import GroupStore",
        "PDGroup's packages are its own",
    ),
    (
        # the PDGroup's handlers may not reach into the WarmPool's packages: claims go through
        # the API server
        "matrixserve/handlers/pdgroup/controller.py",
        "from matrixserve.adapters.zk_warm import WarmStore",
        "WarmPool's packages are its own",
    ),
    (
        "matrixserve/adapters/zk_experts.py",
        "from matrixserve.adapters.zk_groups import GroupStore",
        "Kinds are independent: adapters",
    ),
    (
        "matrixserve/domain/observed.py",
        "import enginestub.fabric",
        "The pure layers (domain, api) import no I/O library and nothing above them",
    ),
    (
        "matrixserve/domain/effects.py",
        "import kazoo.client",
        "The pure layers (domain, api) import no I/O library and nothing above them",
    ),
    (
        "matrixserve/gateway/app.py",
        "import enginestub.timing",
        "The operator and the gateway never import their emulator (only the dev-cluster tooling may)",
    ),
    (
        "enginestub/fabric.py",
        "import matrixserve.domain.observed",
        "The engine stub imports only the API and the shared ZooKeeper session from matrixserve",
    ),
    ("matrixserve/adapters/kube.py", "import kopf", "Only the handlers talk to kopf"),
    # inside handlers/: a kind is a Controller; only the registration, runtime and loop use kopf
    (
        "matrixserve/handlers/pdgroup/controller.py",
        "import kopf",
        "Only the registration, the runtime and the loop talk to kopf in handlers",
    ),
    (
        # a new kind's handler module is covered without being listed
        "matrixserve/handlers/expertpool.py",
        "from kopf import AdmissionError",
        "Only the registration, the runtime and the loop talk to kopf in handlers",
    ),
    (
        "matrixserve/handlers/reconciler.py",
        "import matrixserve.handlers.runtime",
        "Handlers' layers: registration -> kinds -> runtime -> loop -> protocol",
    ),
    (
        "matrixserve/handlers/runtime.py",
        "import matrixserve.handlers.kinds",
        "Handlers' layers: registration -> kinds -> runtime -> loop -> protocol",
    ),
    (
        "matrixserve/handlers/warmpool.py",
        "from matrixserve.coordination import Session",
        "A kind's handlers reach ZooKeeper only through their store",
    ),
    (
        "matrixserve/handlers/pdgroup/controller.py",
        "import kazoo.client",
        "A kind's handlers reach ZooKeeper only through their store",
    ),
    (
        "matrixserve/coordination/session.py",
        "import matrixserve.adapters.kube",
        "Operator layers: handlers | gateway -> adapters -> coordination -> domain -> api",
    ),
    (
        "matrixserve/handlers/pdgroup/controller.py",
        "import matrixserve.gateway.upstream",
        "Operator layers: handlers | gateway -> adapters -> coordination -> domain -> api",
    ),
]


@pytest.mark.parametrize(("path", "line", "contract"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_import_breaks_its_contract(
    pristine: Path, tmp_path: Path, path: str, line: str, contract: str
) -> None:
    root = tmp_path / "tree"
    shutil.copytree(pristine, root)
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.write(f"\n{line}  # deliberately wrong\n")
    verdicts = lint(root)
    assert verdicts.get(contract) is False, verdicts
