"""Dev-cluster pieces without a cluster: ports, process supervision, errors, certificates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from matrixserve.devcluster import pki
from matrixserve.devcluster.cluster import _hint_from_log, _write_kubeconfig, free_ports
from matrixserve.devcluster.errors import DevClusterError
from matrixserve.devcluster.procs import Supervisor, process_start_time


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(1024 < p < 65536 for p in ports)


def test_supervisor_starts_detached_and_stops_by_pid(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    record = sup.start("sleeper", ["sleep", "30"])
    assert record.alive()
    assert os.getpgid(record.pid) == record.pid, "must lead its own process group"
    assert sup.stop("sleeper", grace=5) is True
    assert (
        process_start_time(record.pid) is None
        or process_start_time(record.pid) != record.start_time
    )
    assert sup.records() == []


def test_supervisor_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    record = sup.start("stubborn", ["bash", "-c", "trap '' TERM; sleep 30 & wait; sleep 30"])
    time.sleep(0.2)
    started = time.monotonic()
    assert sup.stop("stubborn", grace=0.5)
    assert time.monotonic() - started < 5
    assert not record.alive()


def test_supervisor_never_signals_a_recycled_pid(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    record = sup.start("victim", ["sleep", "30"])
    pid_file = tmp_path / "pids" / "victim.json"
    data = json.loads(pid_file.read_text())
    data["start_time"] = record.start_time + 1  # as if the pid now belonged to another process
    pid_file.write_text(json.dumps(data))
    try:
        assert sup.stop("victim") is False
        assert process_start_time(record.pid) == record.start_time, (
            "an unrelated process was signalled"
        )
    finally:
        os.killpg(record.pid, signal.SIGKILL)
        for child in sup._children:
            child.wait(5)


def test_supervisor_refuses_to_start_a_second_copy(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    sup.start("once", ["sleep", "30"])
    try:
        with pytest.raises(RuntimeError, match="already running"):
            sup.start("once", ["sleep", "30"])
    finally:
        sup.stop("once", grace=2)


def test_error_names_step_log_tail_and_hint(tmp_path: Path) -> None:
    log = tmp_path / "etcd.log"
    log.write_text(
        "\n".join(f"line {i}" for i in range(100)) + "\nlisten tcp: bind: address already in use\n"
    )
    error = DevClusterError(
        "etcd", "etcd exited during start-up", log=log, hint=_hint_from_log(log)
    )
    text = str(error)
    assert "step 'etcd' failed: etcd exited during start-up" in text
    assert str(log) in text
    assert "address already in use" in text
    assert "line 99" in text
    assert "line 10\n" not in text
    assert "another process holds one of the chosen ports" in text


def test_unknown_failure_gets_the_generic_hint(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("something odd\n")
    assert "devcluster down" in _hint_from_log(log)


def test_serving_certificate_has_loopback_san_and_verifies_against_ca(tmp_path: Path) -> None:
    ca = pki.ensure_ca(tmp_path)
    pair = pki.issue_certificate(
        ca, tmp_path, "server", "kube-apiserver", ["IP:127.0.0.1", "DNS:localhost"]
    )
    text = subprocess.run(
        ["openssl", "x509", "-in", str(pair.cert), "-noout", "-text"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "IP Address:127.0.0.1" in text
    assert "DNS:localhost" in text
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca.cert), str(pair.cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    again = pki.issue_certificate(ca, tmp_path, "server", "kube-apiserver", ["IP:127.0.0.1"])
    assert again.cert.read_bytes() == pair.cert.read_bytes(), "re-issuing must be idempotent"


def test_kubeconfig_is_loadable_by_the_kubernetes_client(tmp_path: Path) -> None:
    from kubernetes import config

    ca = pki.ensure_ca(tmp_path)
    path = tmp_path / "kubeconfig"
    _write_kubeconfig(path, "https://127.0.0.1:6443", ca.cert, "secret-token")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    api = config.new_client_from_config(config_file=str(path))
    assert api.configuration.host == "https://127.0.0.1:6443"
    assert api.configuration.api_key["BearerToken"] == "Bearer secret-token"


def test_go_is_the_newest_usable_else_debians_else_a_toolchain_fetched_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: v1.37 needs Go >= 1.21 to build (it fetches the 1.26 its go.mod asks for);
    with none, Debian's golang-go, and if that is older (bookworm's 1.19), the toolchain
    fetched as a module with it."""
    from matrixserve.devcluster import tools

    installed: list[tuple[str, ...]] = []
    here: list[tuple[tuple[int, int], str]] = [((1, 19), "/usr/lib/go-1.19/bin/go")]
    monkeypatch.setattr(tools, "_gos", lambda: list(here))
    monkeypatch.setattr(tools, "ensure_apt_packages", lambda log, pkgs: installed.append(pkgs))
    monkeypatch.setattr(tools, "bootstrap_go", lambda old, log: f"fetched with {old}")
    log = tmp_path / "log"
    assert tools.go_command(log) == "fetched with /usr/lib/go-1.19/bin/go"
    assert installed == [("golang-go",)]
    here += [((1, 26), "/usr/local/go/bin/go"), ((1, 22), "/usr/bin/go")]
    assert tools.go_command(log) == "/usr/local/go/bin/go"
    assert installed == [("golang-go",)]  # a usable one: nothing installed
    here.clear()
    with pytest.raises(DevClusterError, match=r"needs Go >= 1\.21"):
        tools.go_command(log)


def test_a_module_download_logs_into_a_state_dir_not_made_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh machine (CI): the first thing ``setup`` logs on the 1.37 path is a module
    download, before anything has made ``<state>/logs``."""
    from matrixserve.devcluster import tools

    monkeypatch.setenv("MATRIXSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()  # (ensure_kubernetes makes its build folder in it first)
    log = tmp_path / "state" / "logs" / "setup.log"
    fake_go = tmp_path / "go"
    # Go 1.26's ``-json`` names the .info file but gives no Time: the build date is read there
    (tmp_path / "v1.info").write_text('{"Version": "v1", "Time": "2026-10-14T09:00:00Z"}')
    fake_go.write_text(
        '#!/bin/sh\necho \'{"Path": "m", "GoMod": "/x/go.mod", "Dir": "/x", '
        f'"Info": "{tmp_path}/v1.info"}}\'\n'
    )
    fake_go.chmod(0o755)
    info = tools._module_info(str(fake_go), "m@v1", {**os.environ}, log)
    assert info["GoMod"] == "/x/go.mod"
    assert info["Time"] == "2026-10-14T09:00:00Z"
    assert "=== go mod download -json m@v1" in log.read_text()
