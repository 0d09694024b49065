"""docs/writing-a-kind.md is true to the code: its blocks are the example package's files, whole or excerpted.

A block headed ``# examples/plugvisor-npu/<file>`` is part of that file, and all such
blocks of a file, in order, are the whole file (blank lines aside): a reader who types
them in has the package plugvisor's tox tests. A block headed ``# from <file>`` is an
excerpt that must appear in the file as it is.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "writing-a-kind.md"
BLOCK = re.compile(r"^```[a-z]*\n# (from )?(examples/\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def blocks() -> list[tuple[bool, str, str]]:
    return [(bool(m.group(1)), m.group(2), m.group(3)) for m in BLOCK.finditer(GUIDE.read_text())]


def test_the_guides_whole_file_blocks_are_the_example_files():
    whole: dict[str, list[str]] = {}
    for excerpt, path, body in blocks():
        if not excerpt:
            whole.setdefault(path, []).extend(lines(body))
    assert set(whole) >= {
        "examples/plugvisor-npu/pyproject.toml",
        "examples/plugvisor-npu/src/plugvisor_npu/__init__.py",
        "examples/plugvisor-npu/src/plugvisor_npu/kind.py",
        "examples/plugvisor-npu/src/plugvisor_npu/lab.py",
        "examples/plugvisor-npu/src/plugvisor_npu/profiles/acme-npu-node.yaml",
    }
    for path, shown in whole.items():
        assert shown == lines((REPO / path).read_text()), f"docs/writing-a-kind.md no longer shows {path}"


def test_the_guides_excerpts_are_in_the_example_files():
    excerpts = [(path, body) for excerpt, path, body in blocks() if excerpt]
    assert excerpts
    for path, body in excerpts:
        assert "\n".join(lines(body)) in "\n".join(lines((REPO / path).read_text())), f"excerpt of {path}"
