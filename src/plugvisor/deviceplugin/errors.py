"""The framework's error taxonomy: each class decides what happens next.

* :class:`RequestError` - the kubelet (or another caller) sent something wrong;
  the servicer turns it into a gRPC status with a message naming the offending
  input, and keeps serving.
* :class:`ConfigurationError` - the plugin cannot run as configured; the process
  exits with status 2 and one clear line (the supervisor will not retry quickly).
* :class:`RegistrationRejectedError` - the kubelet refused the registration for a
  reason retrying cannot fix (version, resource name).
"""

from __future__ import annotations

import grpc


class PlugvisorError(Exception):
    """Base class of the errors plugvisor raises on purpose."""


class RequestError(PlugvisorError):
    """A bad request from the kubelet side; carries the gRPC status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConfigurationError(PlugvisorError):
    """The plugin's configuration cannot work; exit status 2."""


class RegistrationRejectedError(PlugvisorError):
    """The kubelet refused our Register call for a reason that retrying cannot fix."""


class SocketInUseError(PlugvisorError):
    """Another live process already serves on the socket path we were about to bind."""
