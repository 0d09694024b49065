"""The ``generic`` kind: devices from path globs under the host root.

Modelled on squat's generic-device-plugin, the most used plugin of its sort:
each *group* of paths forms devices; when a path is a glob, its i-th match (in
sorted order) joins the i-th device of the group, so ``/dev/ttyUSB*`` gives one
device per serial port; ``count`` hands each device out that many times (for
shareable nodes such as ``/dev/fuse``); a path's ``limit`` lets one match be
reused by several devices of its group. A path that appears or vanishes reaches
the kubelet as a new list at once (inotify on the glob's directories).

Unlike squat, device IDs are readable and stable (``fuse-3``, ``ttyUSB0``), not
SHA-1 hashes: they appear in pod status, podresources and metrics.
"""

from __future__ import annotations

import glob
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final

import pydantic
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import absolute_path
from plugvisor.deviceplugin.devices import MAX_DEVICE_ID_LENGTH, Device, DeviceSpec, Health, Mount
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.plugins.kinds import PluginKind

_ID_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]+")
_GLOB_MAGIC: Final = re.compile(r"[*?\[]")


class PathType(StrEnum):
    """How a matched path reaches the container."""

    DEVICE = "Device"
    MOUNT = "Mount"


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


AbsolutePath = Annotated[str, pydantic.AfterValidator(absolute_path)]


class PathSpec(_Model):
    """One path (or glob) of a group, as it is on the host."""

    path: AbsolutePath
    mount_path: AbsolutePath | None = pydantic.Field(default=None, alias="mountPath")
    type: PathType = PathType.DEVICE
    permissions: Annotated[str, pydantic.StringConstraints(pattern=r"^[rwm]+$")] = "rw"
    read_only: bool = pydantic.Field(default=False, alias="readOnly", strict=True)
    limit: Annotated[int, pydantic.Field(ge=1, strict=True)] = 1


def _path_spec(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


class Group(_Model):
    """Paths that together form one device (per match), handed out ``count`` times."""

    paths: Annotated[
        list[Annotated[PathSpec, pydantic.BeforeValidator(_path_spec)]], pydantic.Field(min_length=1)
    ]
    count: Annotated[int, pydantic.Field(ge=1, le=100_000, strict=True)] = 1


class GenericOptions(_Model):
    """The ``generic`` keys of a resource entry: either ``paths`` (+``count``) or ``groups``."""

    paths: list[Annotated[PathSpec, pydantic.BeforeValidator(_path_spec)]] | None = None
    count: Annotated[int, pydantic.Field(ge=1, le=100_000, strict=True)] | None = None
    groups: list[Group] | None = None

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> GenericOptions:
        if self.groups is not None and (self.paths is not None or self.count is not None):
            raise ValueError("give either 'paths' (with an optional 'count') or 'groups', not both")
        if self.groups is None and not self.paths:
            raise ValueError("'paths' must list at least one path (or use 'groups')")
        if self.groups is not None and not self.groups:
            raise ValueError("'groups' must list at least one group")
        return self

    def resolved_groups(self) -> list[Group]:
        """The options in their full form: a list of groups."""
        if self.groups is not None:
            return list(self.groups)
        assert self.paths is not None
        return [Group(paths=list(self.paths), count=self.count or 1)]


def _static_prefix(pattern: str) -> PurePosixPath:
    parts = PurePosixPath(pattern).parts
    prefix: list[str] = []
    for part in parts[:-1]:
        if _GLOB_MAGIC.search(part):
            break
        prefix.append(part)
    return PurePosixPath(*prefix) if prefix else PurePosixPath("/")


def _short_id(raw: str) -> str:
    cleaned = _ID_UNSAFE.sub("_", raw).strip("_") or "device"
    if len(cleaned) <= MAX_DEVICE_ID_LENGTH:
        return cleaned
    digest = hashlib.sha256(raw.encode()).hexdigest()[:10]
    return f"{cleaned[: MAX_DEVICE_ID_LENGTH - 11]}-{digest}"


@dataclass(frozen=True)
class GenericSource:
    """Device source for path globs (the ``generic`` kind)."""

    options: GenericOptions
    paths: HostPaths
    resource: str = ""
    log_as: str | None = None
    """The name its log lines give the process (a DRA driver's name); None: ``resource``."""

    def __post_init__(self) -> None:
        """Warn, once per source, about each path that matches nothing yet, naming where it looked.

        A typo, or a host root (a lab) without that node, would otherwise register zero devices in
        silence. It is not an error: hot-plugged devices appear later and are picked up then.
        """
        log = structlog.get_logger("plugvisor.plugins.generic").bind(resource=self.log_as or self.resource)
        for path in self.unmatched_paths():
            log.warning(
                "path_matches_nothing",
                path=path,
                looked_in=str(self.paths.host(path)),
                hint="no device until a matching path appears (is hostRoot right?)",
            )

    def _matches(self, spec: PathSpec) -> list[Path]:
        # The static prefix is resolved inside the host root (a host's /dev -> /something must not
        # lead to this process's own); the user's glob follows it. Path.glob cannot take an absolute
        # pattern; the resolved prefix is escaped, the user's glob is not.
        static = _static_prefix(spec.path)
        rest = PurePosixPath(spec.path).relative_to(static)
        pattern = glob.escape(str(self.paths.host(static)).rstrip("/")) + "/" + str(rest)
        return [Path(p) for p in sorted(glob.glob(pattern))]  # noqa: PTH207

    def unmatched_paths(self) -> list[str]:
        """The configured paths (or globs) that match nothing under the host root now."""
        specs = [spec for group in self.options.resolved_groups() for spec in group.paths]
        return [spec.path for spec in specs if not self._matches(spec)]

    def _host_absolute(self, local: Path) -> str:
        return "/" + str(local.relative_to(self.paths.root))

    def scan(self) -> Snapshot[None]:
        """Glob every group's paths and build one device per match tuple and replica."""
        devices: list[Device] = []
        used: set[str] = set()
        for group_index, group in enumerate(self.options.resolved_groups()):
            matches = [self._matches(spec) for spec in group.paths]
            natural = max(len(m) for m in matches)
            reusable = min(len(m) * spec.limit for m, spec in zip(matches, group.paths, strict=True))
            for index in range(min(natural, reusable)):
                chosen = [m[index % len(m)] for m in matches]
                base = "+".join(p.name for p in chosen)
                for replica in range(group.count):
                    raw = f"{base}-{replica}" if group.count > 1 else base
                    device_id = _short_id(raw)
                    if device_id in used:
                        device_id = _short_id(f"g{group_index}-{raw}")
                    used.add(device_id)
                    devices.append(self._device(device_id, group.paths, chosen))
        return Snapshot(devices, watch=self._watch_dirs())

    def _reaches_something(self, local: Path) -> bool:
        """Whether a matched path leads to a file when its links are followed inside the host root.

        A glob matches a dangling link too. The spec names the link itself (the
        runtime follows it on the host, where an absolute target means the
        host's own tree, and a link such as ``/dev/disk/by-id/...`` keeps
        following its device), so it is checked as the runtime will see it:
        resolved inside the root, never through this process's own ``/``.
        """
        try:
            return self.paths.inside(local).exists()
        except OSError:  # a link loop
            return False

    def _device(self, device_id: str, specs: Sequence[PathSpec], chosen: Sequence[Path]) -> Device:
        nodes: list[DeviceSpec] = []
        mounts: list[Mount] = []
        for spec, local in zip(specs, chosen, strict=True):
            host_path = self.paths.for_kubelet(local)
            container_path = spec.mount_path or self._host_absolute(local)
            if spec.type is PathType.DEVICE:
                nodes.append(DeviceSpec(container_path, host_path, spec.permissions))
            else:
                mounts.append(Mount(container_path, host_path, spec.read_only))
        reachable = all(self._reaches_something(local) for local in chosen)
        health = Health.HEALTHY if reachable else Health.UNHEALTHY
        return Device(device_id, health=health, specs=nodes, mounts=mounts)

    def _watch_dirs(self) -> list[Path]:
        """The directories where a matching path could appear or vanish.

        inotify is not recursive, so for ``/dev/bus/usb/*/*`` this is the static
        prefix ``/dev/bus/usb`` plus every directory its ``*`` level matches now.
        """
        root = glob.escape(str(self.paths.root).rstrip("/"))
        dirs: set[Path] = set()
        for group in self.options.resolved_groups():
            for spec in group.paths:
                static = _static_prefix(spec.path)
                dirs.add(self.paths.host(static))
                parent = str(PurePosixPath(spec.path).parent)
                if _GLOB_MAGIC.search(parent):
                    dirs.update(Path(p) for p in glob.glob(root + parent) if Path(p).is_dir())  # noqa: PTH207
        return sorted(dirs, key=str)


KIND: Final = PluginKind("generic", GenericOptions, GenericSource, names_logs=True)
