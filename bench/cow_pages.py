"""What a forked plugin writes of the fork server's memory: each child's copied pages, by what was written.

Run (root): python bench/cow_pages.py [--resources 3]

A child of the agent starts sharing every page of the fork server's heap; each
page it writes to is copied (copy on write) and becomes its own. bench_footprint.py
counts these pages ("its own"); this says what they hold. For every page of a
child's heap whose frame differs from the fork server's page at the same
address, the two are compared word by word (``/proc/PID/mem``), and each changed
word is matched to the Python object it belongs to (the nearest preceding word
that reads as a reference count followed by a pointer to a type with a name).
A page counts once, under the first of:

- identical content: written and written back, as taking and dropping a reference does;
- code objects: CPython 3.11 counts each function's calls in its code object until it
  specialises its bytecode (the warm-up counter), then writes the inline caches;
- str: reference counts of strings (interned names and constants are not immortal before 3.12);
- other objects (functions, types, dicts, tuples, ...), pymalloc's pool headers (the child
  allocating into the fork server's partly used pools), and words no object claims.

Needs root (another process's page frames and memory); the figures are for the
interpreter that runs this script.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from bench_footprint import Node, comm, descendants, run_argv, terminate
from bytecode import compile_plugvisor

from plugvisor.emulators.kubelet import EmulatedKubelet

PAGE = os.sysconf("SC_PAGE_SIZE")
WORDS = PAGE // 8
POOL = 16 << 10  # pymalloc's pool size on 64-bit CPython 3.10+
_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1
KINDS = (
    "identical content (a write undone: a reference taken and dropped)",
    "code objects (warm-up counters, inline caches, references)",
    "str (reference counts)",
    "other objects",
    "pymalloc pool headers only",
    "words no object claims",
)


def heap_frames(pid: int) -> dict[int, int]:
    """Page address -> frame number of every present page of ``pid``'s writable anonymous memory."""
    frames: dict[int, int] = {}
    with Path(f"/proc/{pid}/maps").open() as maps, Path(f"/proc/{pid}/pagemap").open("rb") as pagemap:
        for row in maps:
            fields = row.split()
            name = fields[5] if len(fields) > 5 else ""
            if name not in ("", "[heap]") or not fields[1].startswith("rw"):
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            entries = array("Q")
            entries.frombytes(pagemap.read((end - start) // PAGE * 8))
            for index, entry in enumerate(entries):
                if entry & _PRESENT:
                    frames[start + index * PAGE] = entry & _PFN_MASK
    return frames


class Memory:
    """Another process's memory, read through ``/proc/PID/mem``, with type names resolved and cached."""

    def __init__(self, pid: int) -> None:
        self.file = Path(f"/proc/{pid}/mem").open("rb")  # noqa: SIM115 - closed by close()
        self.names: dict[int, str | None] = {}

    def read(self, address: int, size: int) -> bytes | None:
        try:
            self.file.seek(address)
            data = self.file.read(size)
        except (OSError, ValueError, OverflowError):
            return None
        return data if len(data) == size else None

    def type_name(self, address: int) -> str | None:
        """``tp_name`` of the type object at ``address``, if it reads as one."""
        if address not in self.names:
            self.names[address] = None
            header = self.read(address, 32)
            if header is not None:
                text = self.read(struct.unpack("4Q", header)[3], 64)
                name = text.split(b"\0")[0] if text else b""
                if name and all(32 < byte < 127 for byte in name):
                    self.names[address] = name.decode()
        return self.names[address]

    def close(self) -> None:
        self.file.close()


def owner_type(words: tuple[int, ...], index: int, memory: Memory) -> str | None:
    """The type of the object that word ``index`` belongs to (None when no header precedes it on the page)."""
    for start in range(index, max(-1, index - 80), -1):
        if words[start] < 1 << 32 and start + 1 < len(words):
            name = memory.type_name(words[start + 1])
            if name is not None:
                return name
    return None


def classify(page: int, before: bytes, after: bytes, memory: Memory) -> str:
    """Which of :data:`KINDS` the page's changes are."""
    if before == after:
        return KINDS[0]
    old = struct.unpack(f"{WORDS}Q", before)
    new = struct.unpack(f"{WORDS}Q", after)
    seen: set[str] = set()
    for index in range(WORDS):
        if old[index] == new[index]:
            continue
        if (page + index * 8) % POOL < 48:
            seen.add("pool")
            continue
        seen.add(owner_type(old, index, memory) or "?")
    if "code" in seen:
        return KINDS[1]
    if "str" in seen:
        return KINDS[2]
    if seen - {"pool", "?"}:
        return KINDS[3]
    return KINDS[4] if "pool" in seen else KINDS[5]


def copied_pages(server: int, child: int) -> Iterator[int]:
    """Addresses of the child's pages that were the fork server's and are now the child's own copies."""
    mine = heap_frames(child)
    theirs = heap_frames(server)
    return (address for address, frame in mine.items() if theirs.get(address, frame) != frame)


def report(server: int, child: int) -> Counter[str]:
    kinds: Counter[str] = Counter()
    parent, own = Memory(server), Memory(child)
    try:
        for page in copied_pages(server, child):
            before, after = parent.read(page, PAGE), own.read(page, PAGE)
            if before is not None and after is not None:
                kinds[classify(page, before, after, parent)] += 1
    finally:
        parent.close()
        own.close()
    return kinds


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resources", type=int, default=3, choices=range(1, 5))
    options = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("cow_pages.py reads other processes' page frames and memory: run it as root")
    print(compile_plugvisor())
    print(f"Python {sys.version.split()[0]}; plugvisor run with {options.resources} generic resources")
    node = Node(options.resources)
    kubelet = EmulatedKubelet(node.kubelet_dir, write_view=False, grace_period=30)
    await kubelet.start()
    process = await asyncio.create_subprocess_exec(*run_argv(node), stderr=asyncio.subprocess.DEVNULL)
    try:
        await kubelet.wait_for(node.registered, timeout=60)
        await asyncio.sleep(1.0)  # steady state: the first rescan and status reports are done
        pids = descendants(process.pid)
        server = next(pid for pid in pids if comm(pid) == "pv-forkserver")
        for child in (pid for pid in pids if comm(pid).startswith("pv:")):
            kinds = report(server, child)
            copied = sum(kinds.values()) * PAGE / 2**20
            print(f"  {comm(child)}: {copied:.1f} MB of the fork server's pages copied")
            for kind in KINDS:
                print(f"    {kinds[kind] * PAGE / 2**20:5.2f} MB  {kind}")
    finally:
        await terminate(process, 10)
        await kubelet.stop()
        node.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
