"""Pod manifests: the YAML a user would ``kubectl apply``, read the way a static-pod kubelet reads it.

What is validated, and why (docs/kubelet.md repeats this for users):

* Everything the device manager looks at is modelled and validated strictly:
  ``apiVersion: v1``, ``kind: Pod``, ``metadata.name``/``namespace``/``uid``, every
  container's ``name``, ``resources`` and (for init containers) ``restartPolicy``,
  and the pod's ``restartPolicy``. Unknown keys *inside* a container entry or its
  ``resources`` are errors, as with ``kubectl apply`` (strict field validation):
  a misspelt ``limts`` would otherwise silently ask for no device at all.
* Every other field Kubernetes defines for a Pod, a PodSpec or a Container is
  accepted and ignored (``command``, ``volumes``, ``tolerations``, ...), so real
  manifests load unchanged; a key Kubernetes does not define is an error.
  ``metadata`` and ``status`` accept anything (labels, annotations, ...).
* Extended resources follow the API server's rules: the quantity must be an
  integer, and requests must equal limits (a request without a limit is
  refused; a limit without a request implies the same request).

The UID of a pod without ``metadata.uid`` is derived from its content, its
source and the node name, as the kubelet does for static pods: the same file
gives the same UID across kubelet restarts (which is what lets checkpointed
allocations find their pod again), and an edited file is a new pod.
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

from plugvisor.emulators.kubelet import allocation

_POD_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})

_POD_SPEC_FIELDS: Final = frozenset(
    {
        "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers", "dnsConfig",
        "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases", "hostIPC", "hostNetwork",
        "hostPID", "hostUsers", "hostname", "hostnameOverride", "imagePullSecrets", "initContainers",
        "nodeName", "nodeSelector", "os", "overhead", "preemptionPolicy", "priority", "priorityClassName",
        "readinessGates", "resourceClaims", "resources", "restartPolicy", "runtimeClassName",
        "schedulerName", "schedulingGates", "securityContext", "serviceAccount", "serviceAccountName",
        "setHostnameAsFQDN", "shareProcessNamespace", "subdomain", "terminationGracePeriodSeconds",
        "tolerations", "topologySpreadConstraints", "volumes",
    }
)  # fmt: skip

_CONTAINER_FIELDS: Final = frozenset(
    {
        "args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle", "livenessProbe",
        "name", "ports", "readinessProbe", "resizePolicy", "resources", "restartPolicy",
        "restartPolicyRules", "securityContext", "startupProbe", "stdin", "stdinOnce",
        "terminationMessagePath", "terminationMessagePolicy", "tty", "volumeDevices", "volumeMounts",
        "workingDir",
    }
)  # fmt: skip

_DNS1123_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
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


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)


class _Resources(_Strict):
    limits: dict[str, int | float | str] = {}
    requests: dict[str, int | float | str] = {}
    claims: list[dict[str, Any]] = []


class _Container(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    name: str
    image: str
    resources: _Resources = _Resources()
    restart_policy: Literal["Always"] | None = pydantic.Field(default=None, alias="restartPolicy")

    @pydantic.model_validator(mode="after")
    def _known_fields_only(self) -> _Container:
        unknown = sorted(set(self.model_extra or {}) - _CONTAINER_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
        return self


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

    @pydantic.model_validator(mode="after")
    def _known_fields_only(self) -> _Spec:
        unknown = sorted(set(self.model_extra or {}) - _POD_SPEC_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
        return self


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
    return "/" in resource and "kubernetes.io/" not in resource and not resource.startswith("requests.")


def _container_spec(  # noqa: PLR0912 - one branch per API validation rule, in the API's order
    container: _Container, path: str, kind: allocation.ContainerKind
) -> ContainerSpec:
    problems: list[str] = []
    if not _DNS1123_LABEL.fullmatch(container.name) or len(container.name) > 63:
        problems.append(f"{path}.name: Invalid value: {container.name!r}: must be a DNS-1123 label")
    limits: dict[str, int] = {}
    resources = container.resources
    for section, values in (("limits", resources.limits), ("requests", resources.requests)):
        for resource, raw in values.items():
            try:
                quantity = _quantity(raw)
            except ValueError as error:
                problems.append(f"{path}.resources.{section}[{resource}]: Invalid value: {raw!r}: {error}")
                continue
            if _is_extended(resource) and quantity != quantity.to_integral_value():
                problems.append(
                    f"{path}.resources.{section}[{resource}]: Invalid value: {raw!r}: must be an integer"
                )
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
                    f"{path}.resources.requests[{resource}]: Invalid value: {str(raw)!r}: must be equal to "
                    f"{resource} limit of {resources.limits[resource]}"
                )
    if problems:
        raise ManifestError("; ".join(problems))
    return ContainerSpec(name=container.name, kind=kind, limits=limits)


def _format_validation_error(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(document)"
        message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def derive_uid(document: Mapping[str, Any], *, source: str | None, node_name: str) -> str:
    """Hash content, node and source into a UID, as the kubelet's file source does for static pods."""
    hasher = hashlib.md5(usedforsecurity=False)
    hasher.update(json.dumps(document, sort_keys=True, default=str).encode())
    hasher.update(f"host:{node_name}".encode())
    hasher.update(f"file:{source or ''}".encode())
    return hasher.hexdigest()


def parse_document(  # noqa: PLR0912 - one branch per validation rule; splitting hides the order
    document: object, *, source: str | None = None, node_name: str = DEFAULT_NODE_NAME
) -> PodSpec:
    """Validate one decoded manifest; raise :class:`ManifestError` with every problem found."""
    where = f"{source}: " if source else ""
    if not isinstance(document, dict):
        raise ManifestError(f"{where}not a Pod manifest: expected a mapping, got {type(document).__name__}")
    if document.get("kind") != "Pod":
        raise ManifestError(f"{where}not a Pod: kind is {document.get('kind')!r}")
    unknown = sorted(set(document) - _POD_FIELDS)
    if unknown:
        raise ManifestError(f"{where}unknown field(s) {', '.join(map(repr, unknown))}")
    try:
        pod = _Pod.model_validate(document)
    except pydantic.ValidationError as error:
        raise ManifestError(f"{where}{_format_validation_error(error)}") from None
    metadata = pod.metadata
    problems: list[str] = []
    if not _DNS1123_SUBDOMAIN.fullmatch(metadata.name) or len(metadata.name) > 253:
        problems.append(f"metadata.name: Invalid value: {metadata.name!r}: must be a DNS-1123 subdomain")
    if not _DNS1123_LABEL.fullmatch(metadata.namespace) or len(metadata.namespace) > 63:
        problems.append(
            f"metadata.namespace: Invalid value: {metadata.namespace!r}: must be a DNS-1123 label"
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
    names = [container.name for container in (*init, *app)]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"spec.containers: Duplicate value: {', '.join(map(repr, duplicates))}")
    if problems:
        raise ManifestError(where + "; ".join(problems))
    return PodSpec(
        name=metadata.name,
        namespace=metadata.namespace,
        uid=metadata.uid or derive_uid(document, source=source, node_name=node_name),
        restart_policy=pod.spec.restart_policy,
        init_containers=tuple(init),
        containers=tuple(app),
        source=source,
    )


def parse_manifest(text: str, *, source: str | None = None, node_name: str = DEFAULT_NODE_NAME) -> PodSpec:
    """Parse one YAML (or JSON) Pod manifest; raise :class:`ManifestError` when it is not a valid Pod."""
    where = f"{source}: " if source else ""
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise ManifestError(f"{where}not valid YAML: {error}") from None
    if len(documents) != 1:
        raise ManifestError(f"{where}expected exactly one Pod document, found {len(documents)}")
    return parse_document(documents[0], source=source, node_name=node_name)
