"""The local cluster's certificates: one CA, a serving certificate for the API server, a client certificate
per component, and the service-account signing key. Made with the openssl command line (a Debian package
the build script installs), fresh for every cluster, valid for a week.

Identities follow upstream's conventions, so the default RBAC bindings apply: the controller-manager is
system:kube-controller-manager, the scheduler system:kube-scheduler, kube-proxy system:kube-proxy, the
kubelet system:node:<node> in system:nodes (the Node authorizer and NodeRestriction see a real node), and
the administrator (tests, kubectl) and the API server's client to the kubelet are in system:masters.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .hostbin import system_binary

DAYS = "7"


@dataclass(frozen=True)
class Identity:
    """A client certificate's subject: the user name (CN) and groups (O)."""

    name: str
    groups: tuple[str, ...] = ()


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [system_binary("openssl"), *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


def _subject(identity: Identity) -> str:
    return "".join(f"/O={group}" for group in identity.groups) + f"/CN={identity.name}"


def _issue(directory: Path, name: str, subject: str, extensions: list[str]) -> None:
    """A P-256 key and a certificate for it, signed by the CA in ``directory``."""
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=directory)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=directory)
    (directory / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", DAYS, "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.csr").unlink()
    (directory / f"{name}.ext").unlink()


def make(
    directory: Path, *, server_names: list[str], server_ips: list[str], clients: dict[str, Identity]
) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <client>.{crt,key} for each client, sa.{key,pub}."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=directory)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=plugvisor-e2e-ca", "-days", DAYS,
        "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", "ca.crt",
        cwd=directory,
    )  # fmt: skip
    names = [f"DNS:{n}" for n in server_names] + [f"IP:{ip}" for ip in server_ips]
    _issue(
        directory,
        "apiserver",
        "/CN=kube-apiserver",
        [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth",
            f"subjectAltName={','.join(names)}",
        ],
    )
    for name, identity in clients.items():
        _issue(
            directory,
            name,
            _subject(identity),
            [
                "basicConstraints=critical,CA:FALSE",
                "keyUsage=critical,digitalSignature,keyEncipherment",
                "extendedKeyUsage=clientAuth",
            ],
        )
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=directory)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
