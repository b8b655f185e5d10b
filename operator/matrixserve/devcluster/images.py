"""``python -m matrixserve.devcluster images`` (``make images``): build the two images.

With a running Docker engine: ``docker build`` of the ``Dockerfile``'s two targets
(``matrixserve/matrixserve`` and ``matrixserve/engine-stub``) on their standard ``python:3.11.7-slim-bookworm`` base. Without one (these machines have only the
Docker client): podman with the vfs storage driver and chroot isolation (no overlay, no cgroups
needed), on a base image imported from a ``debootstrap`` rootfs of Debian bookworm with Python
3.11 (cached in the tool cache); pip reaches PyPI through the host's CA bundle, mounted at build
time only. Each podman-built image is then checked without running a container: its filesystem
is mounted and ``python3 -m matrixserve --help`` / ``python3 -m enginestub --help`` run in it by
chroot as the image's user (10001).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from matrixserve import __version__
from matrixserve.devcluster import tools
from matrixserve.devcluster.errors import DevClusterError
from matrixserve.devcluster.paths import cache_dir

REPO = Path(__file__).resolve().parents[3]
VERSION = __version__  # image tags follow the package version
IMAGES = (
    ("matrixserve/matrixserve", "matrixserve", ["matrixserve", "--help"]),
    ("matrixserve/engine-stub", "engine-stub", ["enginestub", "--help"]),
)
BASE = "localhost/matrixserve/python-base:bookworm"
PODMAN = ("podman", "--storage-driver", "vfs")


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=30)
    return probe.returncode == 0


def _base_image(log: Path) -> None:
    present = subprocess.run([*PODMAN, "image", "exists", BASE], check=False).returncode == 0
    if present:
        return
    tarball = cache_dir() / "python-base-bookworm.tar"
    if not tarball.exists():
        rootfs = cache_dir() / "python-base-bookworm"
        shutil.rmtree(rootfs, ignore_errors=True)
        tools.say("debootstrap: Debian bookworm + Python 3.11 (once; cached)")
        tools.run_logged(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-pip,ca-certificates",
                "bookworm",
                str(rootfs),
                "http://deb.debian.org/debian",
            ],
            step="debootstrap the base image",
            log=log,
            hint="needs root and Debian's package mirror",
        )
        tools.run_logged(
            ["tar", "-C", str(rootfs), "-cf", str(tarball), "."], step="pack the base", log=log
        )
        shutil.rmtree(rootfs, ignore_errors=True)
    tools.run_logged(
        [*PODMAN, "import", str(tarball), BASE], step="podman import the base", log=log
    )


def _check(image: str, argv: list[str], log: Path) -> None:
    mounted = subprocess.run(
        [*PODMAN, "image", "mount", image], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        raise DevClusterError(f"mount {image}", mounted.stderr.strip())
    root = mounted.stdout.strip()
    try:
        tools.run_logged(
            ["chroot", "--userspec=10001:10001", root, "python3", "-m", *argv],
            step=f"run python3 -m {' '.join(argv)} in {image} as user 10001",
            log=log,
        )
    finally:
        subprocess.run([*PODMAN, "image", "unmount", image], capture_output=True, check=False)


def build(log: Path) -> list[str]:
    """Build both images; the tags built."""
    docker = _docker_engine()
    if docker:
        command = ["docker", "build"]
    else:
        if os.geteuid() != 0:
            raise DevClusterError(
                "build images",
                "no Docker engine, and podman with debootstrap needs root here",
                hint="run `make images` as root (CI does), or with a running Docker engine",
            )
        tools.ensure_apt_packages(log, ("podman", "debootstrap"))
        _base_image(log)
        command = [
            *PODMAN,
            "build",
            "--isolation",
            "chroot",
            "--layers=false",  # vfs copies every layer whole: commit the final image only
            "-v",
            "/etc/ssl/certs:/host-certs:ro",
            "--build-arg",
            "PIP_CERT=/host-certs/ca-certificates.crt",
            "--build-arg",
            f"BASE={BASE}",
        ]
    built = []
    for name, target, smoke in IMAGES:
        tag = f"{name}:{VERSION}"
        tool = "docker" if docker else "podman"
        tools.say(f"{tool} build {tag}" + ("" if docker else " (vfs, chroot isolation)"))
        tools.run_logged(
            [*command, "--target", target, "-t", tag, "."],
            step=f"{tool} build {tag}",
            log=log,
            cwd=REPO,
            timeout=1800 if docker else 1200,
        )
        if not docker:
            _check(tag, smoke, log)
        built.append(tag)
    return built
