"""The emulated kubelet's errors, and the Go renderings its messages depend on.

The point of the emulator is that a plugin sees *the kubelet's* text: the
kubelet builds its messages with ``fmt.Errorf`` and ``%v`` of gRPC status
errors, so a plugin author greps logs for ``rpc error: code = Unknown desc =``.
This module keeps those renderings in one place, next to the exceptions that
carry them.

The taxonomy is small and decides behaviour for callers:

* :class:`AllocationError` - pod admission failed; the pod would be rejected with
  reason ``UnexpectedAdmissionError`` (no retry, as in the real kubelet).
* :class:`PreStartError` - the container could not start; the kubelet would
  retry the start, so the allocation itself stands.
* :class:`NotDevicePluginResourceError` - the resource is not one the device
  manager handles at all; the real kubelet would skip it silently and let
  another admission handler reject the pod, so the emulator says so plainly.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Final

import grpc

if TYPE_CHECKING:
    from plugvisor.emulators.kubelet import model

#: Go's ``codes.Code.String()`` names; note Go spells CANCELLED with one L.
_GO_CODE_NAMES: Final[dict[grpc.StatusCode, str]] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}

#: What grpc-go says when a context deadline (not a server) ended the call.
GO_DEADLINE_EXCEEDED: Final = "context deadline exceeded"

UNEXPECTED_ADMISSION_ERROR: Final = "UnexpectedAdmissionError"
CREATE_CONTAINER_CONFIG_ERROR: Final = "CreateContainerConfigError"


def go_status_error(code: grpc.StatusCode, details: str) -> str:
    """Render a gRPC status as grpc-go's ``status.Error(...).Error()`` does.

    A client-side deadline is reported by grpc-python as "Deadline Exceeded";
    grpc-go reports the context's own error text, which is what kubelet logs
    and messages contain, so that case is translated.
    """
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
        details = GO_DEADLINE_EXCEEDED
    return f"rpc error: code = {_GO_CODE_NAMES.get(code, str(code.value[0]))} desc = {details}"


def go_rpc_error(error: grpc.aio.AioRpcError) -> str:
    """Render a failed call the way the kubelet's ``%v`` of the returned error does."""
    return go_status_error(error.code(), error.details() or "")


def go_join(directory: str, name: str) -> str:
    """Join like Go's ``filepath.Join``: every element is appended, then the result is cleaned.

    Unlike :func:`os.path.join`, an absolute ``name`` does not replace the
    directory, and ``..`` is resolved lexically - which decides where the kubelet
    dials when a plugin sends an odd ``endpoint``.
    """
    parts = [part for part in (directory, name) if part]
    if not parts:
        return ""
    cleaned = posixpath.normpath("/".join(parts))
    # POSIX normpath keeps exactly two leading slashes; Go's Clean does not.
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


class KubeletError(Exception):
    """A failure the real kubelet would report, carrying its exact text.

    ``message`` is the device manager's error text (what ``err.Error()`` gives in
    the kubelet), ``reason`` the machine-readable reason the pod or container
    status would show, ``status_message`` the human message shown next to it.
    """

    reason: str = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def status_message(self) -> str:
        """The message the pod or container status would show."""
        return self.message


class AllocationError(KubeletError):
    """Pod admission failed in the device manager: the pod is rejected, never retried."""

    reason = UNEXPECTED_ADMISSION_ERROR

    @property
    def status_message(self) -> str:
        """``Allocate failed due to <err>, which is unexpected``: the admit result's message."""
        return f"Allocate failed due to {self.message}, which is unexpected"

    @property
    def pod_status_message(self) -> str:
        """What ``kubectl get pod -o yaml`` shows: the kubelet prefixes rejections."""
        return "Pod was rejected: " + self.status_message


class PreStartError(KubeletError):
    """PreStartContainer (or the checks before it) failed: the container does not start this time."""

    reason = CREATE_CONTAINER_CONFIG_ERROR

    def __init__(self, message: str, *, allocation: model.Allocation | None = None) -> None:
        super().__init__(message)
        self.allocation = allocation
        """The allocation that stands despite the failed start, when admission had succeeded."""


class NotDevicePluginResourceError(KubeletError, LookupError):
    """The resource was never registered nor allocated: the device manager would not handle it."""
