"""Certificates for the dev cluster, made with the openssl CLI.

kopf's self-signed certificate path needs ``certbuilder``/``oscrypto``, which fail on this
OpenSSL; the openssl CLI is always here. One CA signs the API server's serving certificate and,
later, the operator's webhook certificate.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matrixserve.devcluster.errors import DevClusterError


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _openssl(args: Sequence[str], cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise DevClusterError(
            "certificates",
            f"openssl {args[0]} failed: {result.stderr.strip()[-800:]}",
            hint="apt-get install openssl",
        )


def ensure_ca(directory: Path, name: str = "matrixserve-devcluster-ca") -> KeyPair:
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / "ca.crt", directory / "ca.key")
    if not (pair.cert.exists() and pair.key.exists()):
        _openssl(
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-sha256",
                "-days",
                "3650",
                "-keyout",
                pair.key.name,
                "-out",
                pair.cert.name,
                "-subj",
                f"/CN={name}",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            ],
            directory,
        )
    return pair


def issue_certificate(
    ca: KeyPair, directory: Path, name: str, common_name: str, sans: Sequence[str]
) -> KeyPair:
    """A serving certificate signed by ``ca`` for the given subjectAltNames (``IP:…``/``DNS:…``)."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
    if pair.cert.exists() and pair.key.exists():
        return pair
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        f"subjectAltName={','.join(sans)}\n"
    )
    _openssl(
        [
            "req",
            "-new",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            pair.key.name,
            "-out",
            csr.name,
            "-subj",
            f"/CN={common_name}",
        ],
        directory,
    )
    _openssl(
        [
            "x509",
            "-req",
            "-in",
            csr.name,
            "-CA",
            str(ca.cert),
            "-CAkey",
            str(ca.key),
            "-CAcreateserial",
            "-sha256",
            "-days",
            "3650",
            "-out",
            pair.cert.name,
            "-extfile",
            ext.name,
        ],
        directory,
    )
    csr.unlink(missing_ok=True)
    ext.unlink(missing_ok=True)
    return pair


def ensure_service_account_keys(directory: Path) -> KeyPair:
    """RSA key pair that signs service-account tokens (``cert`` holds the public key)."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / "sa.pub", directory / "sa.key")
    if not pair.key.exists():
        _openssl(["genrsa", "-out", pair.key.name, "2048"], directory)
    if not pair.cert.exists():
        _openssl(["rsa", "-in", pair.key.name, "-pubout", "-out", pair.cert.name], directory)
    return pair
