"""Pod manifests: the YAML a user would ``kubectl apply``, read the way a static-pod kubelet reads it.

Validation runs in two steps, like a manifest that reaches a real kubelet:

1. **The Kubernetes object schema of the release played** (``--kubelet-version``),
   shipped by the ``kubernetes-validate`` package, in strict mode: a field the
   release does not define is an error (a misspelt ``limts`` would otherwise
   silently ask for no device at all, and ``restartPolicy`` on an init container
   is unknown to 1.26), and every type is checked. No hand-written field list
   can drift from the API this way.
2. **The API server's and the kubelet's own checks** that a schema cannot
   express (``ValidatePod``): names are DNS-1123 labels/subdomains, quantities
   parse and are not negative, extended resources are integers with requests
   equal to limits (a request without a limit is refused; a limit without a
   request implies the same request), container names are unique, only init
   containers may set ``restartPolicy``.

A **static pod** (a file in the pods directory) is renamed ``<name>-<node name>``
as the kubelet's file source does, so PodResources and the pod status show the
name a real node shows. The UID of a pod without ``metadata.uid`` is derived
from its content, its source and the node name, as the kubelet does for static
pods: the same file gives the same UID across kubelet restarts (which is what
lets checkpointed allocations find their pod again), and an edited file is a new
pod.
"""

from __future__ import annotations

import decimal
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import pydantic
import yaml

from plugvisor.common import extras
from plugvisor.common.validation import huge_integer_problem
from plugvisor.common.yamlfile import BoundedLoader
from plugvisor.emulators.kubelet import allocation, names, versions

try:
    import kubernetes_validate
except ModuleNotFoundError as missing:  # a node's install: see plugvisor.common.extras
    raise extras.MissingExtraError("the emulated kubelet", extras.EMULATORS, missing) from None

_QUANTITY: Final = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
)
_SUFFIXES: Final[dict[str, decimal.Decimal]] = {
    "": decimal.Decimal(1), "m": decimal.Decimal("0.001"),
    "k": decimal.Decimal(10**3), "M": decimal.Decimal(10**6), "G": decimal.Decimal(10**9),
    "T": decimal.Decimal(10**12), "P": decimal.Decimal(10**15), "E": decimal.Decimal(10**18),
    "Ki": decimal.Decimal(2**10), "Mi": decimal.Decimal(2**20), "Gi": decimal.Decimal(2**30),
    "Ti": decimal.Decimal(2**40), "Pi": decimal.Decimal(2**50), "Ei": decimal.Decimal(2**60),
}  # fmt: skip

DEFAULT_NAMESPACE: Final = "default"
DEFAULT_NODE_NAME: Final = "emulated-node"

RestartPolicy = Literal["Always", "OnFailure", "Never"]


class ManifestError(ValueError):
    """A manifest that Kubernetes would refuse; ``str()`` names the file and every problem."""


class _Resources(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", populate_by_name=True)

    limits: dict[str, int | float | str] = {}
    requests: dict[str, int | float | str] = {}


class _Container(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    name: str
    image: str
    resources: _Resources = _Resources()
    restart_policy: Literal["Always"] | None = pydantic.Field(default=None, alias="restartPolicy")


class _Metadata(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    name: str
    namespace: str = DEFAULT_NAMESPACE
    uid: str | None = None


class _Spec(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", populate_by_name=True)

    containers: list[_Container] = pydantic.Field(min_length=1)
    init_containers: list[_Container] = pydantic.Field(default=[], alias="initContainers")
    restart_policy: RestartPolicy = pydantic.Field(default="Always", alias="restartPolicy")


class _Pod(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow", populate_by_name=True)

    api_version: Literal["v1"] = pydantic.Field(alias="apiVersion")
    kind: Literal["Pod"]
    metadata: _Metadata
    spec: _Spec


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """One container as admission sees it: its kind and its extended-resource limits."""

    name: str
    kind: allocation.ContainerKind
    limits: Mapping[str, int]
    """Extended resources (``domain/name``) by integer count; native ones are left out."""


@dataclass(frozen=True, slots=True)
class PodSpec:
    """A validated pod: identity, restart policy and containers in admission order."""

    name: str
    namespace: str
    uid: str
    restart_policy: RestartPolicy
    init_containers: tuple[ContainerSpec, ...]
    containers: tuple[ContainerSpec, ...]
    source: str | None

    @property
    def key(self) -> tuple[str, str]:
        """``(namespace, name)``: what identifies the pod to a user and to PodResources Get."""
        return (self.namespace, self.name)

    @property
    def full_name(self) -> str:
        """``namespace/name`` for messages."""
        return f"{self.namespace}/{self.name}"

    def all_containers(self) -> tuple[ContainerSpec, ...]:
        """Init containers first, then app containers: the kubelet's admission order."""
        return self.init_containers + self.containers


def _quantity(value: int | float | str) -> decimal.Decimal:
    if isinstance(value, bool):  # YAML's true/false: not a quantity, reported like a bad string
        raise ValueError(  # noqa: TRY004 - collected into the manifest's list of problems
            "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
        )
    if isinstance(value, int | float):
        return decimal.Decimal(str(value))
    match = _QUANTITY.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
        )
    number, suffix = decimal.Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * (decimal.Decimal(10) ** int(suffix[1:]))
    return number * _SUFFIXES[suffix]


def _is_extended(resource: str) -> bool:
    """Extended resources, as the API server sees them: a domain, not kubernetes.io, not quota."""
    return not names.is_native_resource(resource) and not resource.startswith("requests.")


def _invalid(where: str, value: object, message: str) -> str:
    """``field.Invalid(...).Error()``: the path, the value under ``%q``, the reason."""
    return f"{where}: Invalid value: {names.go_quote(str(value))}: {message}"


def _container_spec(  # noqa: PLR0912 - one branch per API validation rule, in the API's order
    container: _Container, path: str, kind: allocation.ContainerKind
) -> ContainerSpec:
    problems: list[str] = []
    for message in names.dns1123_label_errors(container.name):
        problems.append(_invalid(f"{path}.name", container.name, message))
    limits: dict[str, int] = {}
    resources = container.resources
    for section, values in (("limits", resources.limits), ("requests", resources.requests)):
        for resource, raw in values.items():
            where = f"{path}.resources.{section}[{resource}]"
            try:
                quantity = _quantity(raw)
            except ValueError as error:
                problems.append(_invalid(where, raw, str(error)))
                continue
            if quantity < 0:
                problems.append(_invalid(where, raw, "must be greater than or equal to 0"))
            elif _is_extended(resource) and quantity != quantity.to_integral_value():
                problems.append(_invalid(where, raw, "must be an integer"))
            elif _is_extended(resource) and section == "limits":
                limits[resource] = int(quantity)
    for resource, raw in resources.requests.items():
        if not _is_extended(resource):
            continue
        if resource not in resources.limits:
            problems.append(
                f"{path}.resources.limits: Required value: Limit must be set for non overcommitable resources"
                f" ({resource})"
            )
        else:
            try:
                equal = _quantity(raw) == _quantity(resources.limits[resource])
            except ValueError:
                continue  # already reported
            if not equal:
                problems.append(
                    _invalid(
                        f"{path}.resources.requests[{resource}]",
                        raw,
                        f"must be equal to {resource} limit of {resources.limits[resource]}",
                    )
                )
    if problems:
        raise ManifestError("; ".join(problems))
    return ContainerSpec(name=container.name, kind=kind, limits=limits)


def _format_validation_error(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(document)"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _schema_problem(document: dict[str, Any], version: str) -> str | None:
    """Validate against the strict object schema of ``version``; return the problem, if any.

    ``kubernetes-validate`` ships the OpenAPI-derived JSON schemas of every
    Kubernetes release; strict mode refuses properties the release does not
    define.
    """
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.path)
        return f"{where.lstrip('.') or '(document)'}: {error.message} (Kubernetes {version} Pod schema)"
    return None


def static_pod_name(name: str, node_name: str) -> str:
    """The name the kubelet gives a pod from its manifest directory: ``<name>-<node name>``."""
    return f"{name}-{node_name.lower()}"


def derive_uid(document: Mapping[str, Any], *, source: str | None, node_name: str) -> str:
    """Hash content, node and source into a UID, as the kubelet's file source does for static pods."""
    hasher = hashlib.md5(usedforsecurity=False)
    hasher.update(json.dumps(document, sort_keys=True, default=str).encode())
    hasher.update(f"host:{node_name}".encode())
    hasher.update(f"file:{source or ''}".encode())
    return hasher.hexdigest()


def parse_document(
    document: object,
    *,
    source: str | None = None,
    node_name: str = DEFAULT_NODE_NAME,
    kubelet_version: str = versions.DEFAULT_VERSION,
    static: bool = False,
) -> PodSpec:
    """Validate one decoded manifest; raise :class:`ManifestError` with every problem found.

    ``static`` marks a pod from the manifest directory: it is renamed
    ``<name>-<node name>`` as the kubelet's file source does.
    """
    where = f"{source}: " if source else ""
    if not isinstance(document, dict):
        raise ManifestError(f"{where}not a Pod manifest: expected a mapping, got {type(document).__name__}")
    if document.get("kind") != "Pod":
        raise ManifestError(f"{where}not a Pod: kind is {document.get('kind')!r}")
    if document.get("apiVersion") != "v1":
        raise ManifestError(f"{where}apiVersion: expected 'v1' for a Pod, got {document.get('apiVersion')!r}")
    problem = _schema_problem(document, versions.check_version(kubelet_version))
    if problem is not None:
        raise ManifestError(where + problem)
    try:
        pod = _Pod.model_validate(document)
    except pydantic.ValidationError as error:
        raise ManifestError(f"{where}{_format_validation_error(error)}") from None
    metadata = pod.metadata
    name = static_pod_name(metadata.name, node_name) if static else metadata.name
    problems: list[str] = [
        _invalid("metadata.name", name, message) for message in names.dns1123_subdomain_errors(name)
    ]
    problems.extend(
        _invalid("metadata.namespace", metadata.namespace, message)
        for message in names.dns1123_label_errors(metadata.namespace)
    )
    init: list[ContainerSpec] = []
    app: list[ContainerSpec] = []
    for index, container in enumerate(pod.spec.init_containers):
        kind = (
            allocation.ContainerKind.SIDECAR
            if container.restart_policy == "Always"
            else allocation.ContainerKind.INIT
        )
        try:
            init.append(_container_spec(container, f"spec.initContainers[{index}]", kind))
        except ManifestError as error:
            problems.append(str(error))
    for index, container in enumerate(pod.spec.containers):
        if container.restart_policy is not None:
            problems.append(
                f"spec.containers[{index}].restartPolicy: Forbidden: may not be set for non-init containers"
            )
        try:
            app.append(_container_spec(container, f"spec.containers[{index}]", allocation.ContainerKind.APP))
        except ManifestError as error:
            problems.append(str(error))
    container_names = [container.name for container in (*init, *app)]
    duplicates = sorted({name for name in container_names if container_names.count(name) > 1})
    if duplicates:
        problems.append(f"spec.containers: Duplicate value: {', '.join(map(repr, duplicates))}")
    if problems:
        raise ManifestError(where + "; ".join(problems))
    return PodSpec(
        name=name,
        namespace=metadata.namespace,
        uid=metadata.uid or derive_uid(document, source=source, node_name=node_name),
        restart_policy=pod.spec.restart_policy,
        init_containers=tuple(init),
        containers=tuple(app),
        source=source,
    )


def parse_manifest(
    text: str,
    *,
    source: str | None = None,
    node_name: str = DEFAULT_NODE_NAME,
    kubelet_version: str = versions.DEFAULT_VERSION,
    static: bool = False,
) -> PodSpec:
    """Parse one YAML (or JSON) Pod manifest; raise :class:`ManifestError` when it is not a valid Pod."""
    where = f"{source}: " if source else ""
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=BoundedLoader) if doc is not None]
    except yaml.YAMLError as error:
        raise ManifestError(f"{where}not valid YAML: {error}") from None
    if len(documents) != 1:
        raise ManifestError(f"{where}expected exactly one Pod document, found {len(documents)}")
    problem = huge_integer_problem(documents[0])
    if problem is not None:
        raise ManifestError(f"{where}{problem}")
    return parse_document(
        documents[0], source=source, node_name=node_name, kubelet_version=kubelet_version, static=static
    )
