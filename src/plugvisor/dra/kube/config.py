"""How a driver finds its API server and its node, the way client-go programs do.

Order (client-go's deferred loading, with the in-cluster account before the home file):

1. ``KUBECONFIG``, when set: a ``:``-separated list of files, merged as kubectl
   merges them (the first file that names a cluster, user or context wins; the
   first ``current-context`` wins; missing files are skipped; relative paths are
   relative to the file that holds them);
2. the pod's service account, when ``KUBERNETES_SERVICE_HOST`` and
   ``KUBERNETES_SERVICE_PORT`` are set (the DaemonSet case): the token file is
   re-read when the API server answers 401, as the kubelet rotates it;
3. ``~/.kube/config`` (a bare-metal node under systemd, an operator's shell).

An explicit ``KUBECONFIG`` wins over the service account because someone set it
on purpose; the home file comes last so that a stray file in an image never
hides the pod's own account. The node's name comes from the configuration
(``--node-name``) or ``NODE_NAME`` (the downward API). Every failure is a
:class:`KubeConfigError` naming what was tried.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError as LightkubeConfigError

from plugvisor.common.names import node_name_problem
from plugvisor.common.validation import shorten
from plugvisor.common.yamlfile import YamlFileError, read_yaml

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
NODE_NAME_ENV: Final = "NODE_NAME"
FIELD_MANAGER: Final = "plugvisor"
"""Named in every object's managedFields, so ``kubectl get -o yaml`` shows who wrote what."""
REQUEST_TIMEOUT: Final = 10.0
"""Seconds for one request (connect, write, read); a watch's read has no timeout."""

# Fields of a kubeconfig that name files, per section; resolved against the file that holds them.
_PATH_FIELDS: Final = {
    "clusters": ("cluster", ("certificate-authority",)),
    "users": ("user", ("client-certificate", "client-key", "tokenFile")),
}


class KubeConfigError(Exception):
    """No usable API server configuration (or node name); the message says what was tried."""


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Where the API server is and how to authenticate, with where that came from (for logs)."""

    kubeconfig: KubeConfig
    source: str


def _resolve_paths(conf: dict[str, Any], base: Path) -> None:
    """Make the relative file names of one file's entries absolute, as kubectl does before merging."""
    for section, (key, fields) in _PATH_FIELDS.items():
        for entry in conf.get(section) or ():
            body = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(body, dict):
                continue
            for name in fields:
                value = body.get(name)
                if isinstance(value, str) and value and not Path(value).is_absolute():
                    body[name] = str(base / value)


def _merge(files: list[Path]) -> dict[str, Any]:
    """Kubectl's merge of several kubeconfig files: the first definition of each name wins."""
    merged: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    seen: dict[str, set[str]] = {section: set() for section in merged}
    for path in files:
        try:
            conf = read_yaml(path)
        except YamlFileError as exc:
            raise KubeConfigError(str(exc)) from None
        if conf is None:
            continue
        if not isinstance(conf, dict):
            raise KubeConfigError(f"{path}: expected a kubeconfig mapping, got {type(conf).__name__}")
        _resolve_paths(conf, path.parent)
        for section, names in seen.items():
            entries = conf.get(section) or []
            if not isinstance(entries, list):
                raise KubeConfigError(f"{path}: {section}: expected a list, got {type(entries).__name__}")
            for entry in entries:
                name = entry.get("name") if isinstance(entry, dict) else None
                if not isinstance(name, str):
                    raise KubeConfigError(f"{path}: {section}: every entry needs a name")
                if name not in names:
                    names.add(name)
                    merged[section].append(entry)
        if "current-context" not in merged and conf.get("current-context"):
            merged["current-context"] = conf["current-context"]
    return merged


def _from_files(files: list[Path], source: str) -> ApiConfig:
    present = [path for path in files if path.exists()]
    if not present:
        raise KubeConfigError(f"{source}: no such file ({', '.join(str(p) for p in files)})")
    merged = _merge(present)
    try:
        kubeconfig = KubeConfig.from_dict(merged, fname=present[0])
        chosen = kubeconfig.get()  # the current context must exist, with its cluster
    except (LightkubeConfigError, KeyError, TypeError, ValueError) as exc:
        raise KubeConfigError(f"{source}: {shorten(str(exc), 300)}") from None
    if chosen is None or chosen.user is None:
        raise KubeConfigError(f"{source}: the current context names no user (no credentials to use)")
    return ApiConfig(kubeconfig, source)


def _in_cluster(env: Mapping[str, str], account: Path) -> ApiConfig:
    """The pod's own service account, as client-go's in-cluster configuration reads it."""
    token = account / "token"
    if not token.is_file():
        raise KubeConfigError(
            f"in-cluster: KUBERNETES_SERVICE_HOST is set but {token} is missing "
            "(is automountServiceAccountToken false?)"
        )
    host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    cluster = Cluster(server=server, certificate_auth=str(account / "ca.crt"))
    # tokenFile, not the token itself: it is read again when the API server answers 401 (the
    # kubelet rotates projected tokens every hour or so).
    kubeconfig = KubeConfig.from_one(cluster=cluster, user=User(token_file=str(token)))
    return ApiConfig(kubeconfig, f"in-cluster service account ({host}:{port})")


def load_api_config(
    *,
    env: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    home: Path | None = None,
) -> ApiConfig:
    """Find the API server (the module docstring has the order); :class:`KubeConfigError` if none."""
    env = os.environ if env is None else env
    listed = env.get("KUBECONFIG", "")
    if listed:
        files = [Path(part).expanduser() for part in listed.split(os.pathsep) if part]
        return _from_files(files, f"KUBECONFIG={shorten(listed, 200)}")
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT"):
        return _in_cluster(env, service_account_dir)
    default = (home if home is not None else Path.home()) / ".kube" / "config"
    if default.exists():
        return _from_files([default], str(default))
    raise KubeConfigError(
        "no API server configuration: KUBECONFIG is not set, this is not a pod "
        f"(KUBERNETES_SERVICE_HOST is not set) and {default} does not exist"
    )


def node_name(configured: str | None = None, *, env: Mapping[str, str] | None = None) -> str:
    """The node the driver runs on: ``configured`` (``--node-name``) if given, else ``NODE_NAME``."""
    env = os.environ if env is None else env
    name, source = (configured, "--node-name") if configured else (env.get(NODE_NAME_ENV, ""), NODE_NAME_ENV)
    if not name:
        raise KubeConfigError(
            f"the node's name is unknown: set {NODE_NAME_ENV} (in a DaemonSet, from the downward API: "
            "fieldRef spec.nodeName) or pass --node-name"
        )
    problem = node_name_problem(name)
    if problem is not None:
        raise KubeConfigError(f"{source}: {problem}")
    return name


def api_client(config: ApiConfig, *, transport: httpx2.AsyncBaseTransport | None = None) -> AsyncClient:
    """An API client for ``config`` (``transport``: the tests' fake API server)."""
    return AsyncClient(
        config.kubeconfig,
        timeout=httpx2.Timeout(REQUEST_TIMEOUT),
        field_manager=FIELD_MANAGER,
        lazy=False,
        transport=transport,
    )
