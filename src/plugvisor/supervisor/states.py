# This module must not import anything, so that every other module can import it without a cycle.
"""The states a supervised child can be in, and the groups the supervisor reasons with.

Modelled on supervisord's ``ProcessStates`` without FATAL: plugvisor never gives
up on a resource for good (a crash-looping child is retried at the backoff cap
and reported instead), and without EXITED, which would only ever be transient.
"""


class ChildState:
    """One state; instances are singletons compared by identity and named for humans and JSON."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<ChildState {self.name}>"

    def __str__(self) -> str:
        return self.name


STOPPED = ChildState("STOPPED")
"""No process, and none wanted (before the first start, after a stop, or removed by a reload)."""
STARTING = ChildState("STARTING")
"""A process runs but has not registered with the kubelet yet."""
RUNNING = ChildState("RUNNING")
"""The process has registered with the kubelet at least once."""
BACKOFF = ChildState("BACKOFF")
"""The process exited unexpectedly; a new one starts when the delay is over."""
STOPPING = ChildState("STOPPING")
"""The process was asked to stop (SIGTERM) and is killed if it overruns its bound."""

ALL = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING)
BY_NAME = {state.name: state for state in ALL}
ALIVE = frozenset({STARTING, RUNNING, STOPPING})
"""States in which the child has a process that may be signalled and must be reaped."""
