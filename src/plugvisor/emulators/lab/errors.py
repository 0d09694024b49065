"""The lab's error taxonomy.

Callers decide what to do from the class alone: a :class:`ProfileError` or a
:class:`UsageError` is the user's input (the CLI exits 2), everything else is an
environment or state problem (exit 1). Every message names the input that was
wrong and what was expected, because the person reading it is usually looking at
a CI log, not at the lab.
"""

from __future__ import annotations


class LabError(Exception):
    """Base of every error the lab raises on purpose."""

    exit_code: int = 1


class UsageError(LabError):
    """The caller asked for something that can never work (unknown device, fault kind, count)."""

    exit_code = 2


class ProfileError(UsageError):
    """A hardware profile is invalid; nothing has been written.

    ``problems`` holds one ``(field, message)`` pair per problem, with the field
    spelled as in the YAML (``nics[0].numVfs``), so a profile author can fix all
    of them in one pass rather than one per run.
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = tuple(problems)
        lines = [
            f"{source}: {field}: {message}" if field else f"{source}: {message}"
            for field, message in problems
        ]
        super().__init__("invalid profile\n  " + "\n  ".join(lines) if len(lines) > 1 else lines[0])


class UnsafeRootError(LabError):
    """The root is, or looks like, a real ``/sys``, ``/dev`` or ``/proc``; the lab refuses to touch it."""


class NotALabError(LabError):
    """The root holds no lab (no state file), so there is nothing to show, fault or plug."""


class LabExistsError(LabError):
    """``create`` found a lab already there; replacing it must be asked for explicitly."""


class DeviceBusyError(LabError):
    """The kernel would answer EBUSY (for example ``sriov_numvfs`` N -> M without 0 in between)."""


class MknodNotPermittedError(LabError):
    """Real character nodes were asked for but this process lacks CAP_MKNOD."""


class StateError(LabError):
    """The lab's ``state.json`` is unreadable, not UTF-8, or not the shape the lab writes.

    Exit 2 like any other bad input: the message names the file and the first problems,
    and the lab refuses to act on it rather than render a tree from it.
    """

    exit_code = 2
