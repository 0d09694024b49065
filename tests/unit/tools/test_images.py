"""tools/kubernetes/images.py's pure parts: image names, arguments, and what decides a rebuild."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_tool", REPO / "tools" / "kubernetes" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


images = _load()


@pytest.mark.parametrize(
    ("ref", "name"),
    [
        ("plugvisor:e2e", "docker.io/library/plugvisor:e2e"),
        ("plugvisor", "docker.io/library/plugvisor:latest"),
        ("someone/plugvisor:1.0", "docker.io/someone/plugvisor:1.0"),
        ("localhost/plugvisor/python-standin:3.11-slim", "localhost/plugvisor/python-standin:3.11-slim"),
        ("registry.example:5000/team/pod", "registry.example:5000/team/pod:latest"),
        ("ghcr.io/plugvisor/plugvisor:0.1.0", "ghcr.io/plugvisor/plugvisor:0.1.0"),
    ],
)
def test_a_reference_gets_the_full_name_containerd_and_the_kubelet_give_it(ref: str, name: str) -> None:
    assert images.normalize_ref(ref) == name


@pytest.mark.parametrize(
    "ref", ["", "Plugvisor:e2e", "plugvisor:", "plugvisor@sha256:" + "0" * 64, " plugvisor", "a//b", "x:t*g"]
)
def test_a_bad_reference_is_refused_with_its_text_and_the_expected_form(ref: str) -> None:
    with pytest.raises(images.UsageError, match=r"expected \[registry/\]name\[:tag\]") as error:
        images.normalize_ref(ref)
    assert repr(ref) in str(error.value)


def test_an_image_spec_names_a_tag_and_optionally_the_stage_to_stop_at() -> None:
    assert images.parse_image_spec("plugvisor:e2e") == images.ImageSpec("plugvisor:e2e", None)
    lab = images.parse_image_spec("plugvisor-lab:e2e=lab")
    assert (lab.ref, lab.target, lab.name) == (
        "plugvisor-lab:e2e",
        "lab",
        "docker.io/library/plugvisor-lab:e2e",
    )
    with pytest.raises(images.UsageError, match="expected REF or REF=TARGET"):
        images.parse_image_spec("plugvisor:e2e=")


def test_a_build_arg_is_key_equals_value_and_the_value_may_hold_equals_signs() -> None:
    assert images.parse_build_arg("VERSION=0.2.0") == ("VERSION", "0.2.0")
    assert images.parse_build_arg("EXTRA=a=b") == ("EXTRA", "a=b")
    assert images.parse_build_arg("EMPTY=") == ("EMPTY", "")
    for bad in ("VERSION", "=x", "1A=b"):
        with pytest.raises(images.UsageError, match=f"--build-arg '{bad}': expected KEY=VALUE"):
            images.parse_build_arg(bad)


def test_the_repository_dockerfile_reads_exactly_the_release_inputs_from_the_context() -> None:
    sources = images.dockerfile_sources((REPO / "Dockerfile").read_text())
    assert sorted(sources) == ["LICENSE", "README.md", "constraints.txt", "pyproject.toml", "src"]


def test_copies_from_stages_and_urls_read_nothing_of_the_context() -> None:
    dockerfile = """\
# syntax=docker/dockerfile:1
FROM base AS build
COPY --chown=0:0 a.txt \\
    # a comment inside a continuation
    b.txt /dst/
COPY ["with space.txt", "/dst/"]
COPY --from=build /wheels /wheels
ADD https://example.invalid/x.tar.gz /x/
add lower.txt /y
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels echo COPY not-a-source /z
"""
    assert images.dockerfile_sources(dockerfile) == ["a.txt", "b.txt", "with space.txt", "lower.txt"]
    assert images.dockerfile_sources("FROM x\nCOPY last.txt /dst/ \\") == ["last.txt"]  # dangling at the end


def _context(root: Path) -> Path:
    """A build context like the repository's: the Dockerfile and the files it copies."""
    root.mkdir()
    shutil.copy(REPO / "Dockerfile", root / "Dockerfile")
    for name in ("pyproject.toml", "README.md", "LICENSE", "constraints.txt"):
        (root / name).write_text(f"{name}\n")
    (root / "src" / "plugvisor").mkdir(parents=True)
    (root / "src" / "plugvisor" / "__init__.py").write_text('"""plugvisor."""\n')
    return root


def _digest(root: Path, **extra: str) -> str:
    return images.input_digest(root, root / "Dockerfile", extra)


def test_the_input_hash_is_stable_and_follows_every_copied_file(tmp_path: Path) -> None:
    context = _context(tmp_path / "ctx")
    first = _digest(context)
    assert _digest(context) == first
    (context / "src" / "plugvisor" / "__init__.py").write_text('"""plugvisor, changed."""\n')
    changed_source = _digest(context)
    assert changed_source != first
    (context / "constraints.txt").write_text("grpcio==1.0\n")
    changed_pins = _digest(context)
    assert changed_pins != changed_source
    (context / "src" / "plugvisor" / "new.py").write_text("")
    assert _digest(context) != changed_pins


def test_the_input_hash_follows_the_dockerfile_arguments_and_the_executable_bit(tmp_path: Path) -> None:
    context = _context(tmp_path / "ctx")
    first = _digest(context)
    assert _digest(context, target="lab") != first
    assert _digest(context, **{"arg:VERSION": "0.2.0"}) != first
    (context / "src" / "plugvisor" / "__init__.py").chmod(0o755)
    executable = _digest(context)
    assert executable != first
    (context / "Dockerfile").write_text((context / "Dockerfile").read_text() + "LABEL x=y\n")
    assert _digest(context) != executable


def test_bytecode_caches_and_files_the_dockerfile_does_not_copy_cause_no_rebuild(tmp_path: Path) -> None:
    context = _context(tmp_path / "ctx")
    first = _digest(context)
    cache = context / "src" / "plugvisor" / "__pycache__"
    cache.mkdir()
    (cache / "__init__.cpython-311.pyc").write_bytes(b"\0")
    (context / "src" / "plugvisor" / "stray.pyc").write_bytes(b"\0")
    (context / "tests").mkdir()
    (context / "tests" / "test_x.py").write_text("")
    (context / ".tox").mkdir()
    assert _digest(context) == first


def test_a_copied_path_that_is_missing_or_a_variable_is_refused_by_name(tmp_path: Path) -> None:
    context = _context(tmp_path / "ctx")
    (context / "LICENSE").unlink()
    with pytest.raises(images.UsageError, match=r"COPY/ADD source 'LICENSE' is not in"):
        _digest(context)
    (context / "LICENSE").write_text("")
    (context / "Dockerfile").write_text("FROM x\nCOPY $SRC /src\n")
    with pytest.raises(images.UsageError, match=r"COPY/ADD source '\$SRC' names a variable"):
        _digest(context)


def test_glob_sources_hash_every_match(tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM x\nCOPY *.txt /dst/\n")
    (context / "a.txt").write_text("a")
    first = _digest(context)
    (context / "b.txt").write_text("b")
    assert _digest(context) != first


def test_each_image_has_its_own_archive_file_named_after_it() -> None:
    assert images.archive_filename("docker.io/library/plugvisor:e2e") == "docker.io_library_plugvisor_e2e.tar"
    assert images.archive_filename("docker.io/library/plugvisor-lab:e2e") != images.archive_filename(
        "docker.io/library/plugvisor:e2e"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--build-arg", "VERSION"], "--build-arg 'VERSION': expected KEY=VALUE"),
        (["--image", "Plugvisor"], "image reference 'Plugvisor': expected"),
        (["--pod-image", "pod@sha256:0"], "image reference 'pod@sha256:0': expected"),
        (["--image", "a:1", "--image", "docker.io/library/a:1"], "expected a distinct tag for each image"),
        (
            ["--image", "plugvisor:e2e", "--pod-image", "plugvisor:e2e"],
            "expected a distinct tag for each image",
        ),
        (
            ["--dockerfile", "/nonexistent/Dockerfile"],
            "--dockerfile /nonexistent/Dockerfile: expected a Dockerfile",
        ),
        (["--ca-bundle", "/nonexistent.pem"], "--ca-bundle /nonexistent.pem: expected a PEM file"),
        (
            ["--image", "a:b=no-such-stage"],
            "--image 'a:b=no-such-stage': the Dockerfile has no stage 'no-such-stage' (its stages: build, "
            "release, emulators)",
        ),
    ],
)
def test_bad_input_gets_one_line_naming_it_and_exit_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert images.main([*argv, "--cache", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("images.py: ")
    assert message in err
    assert not (tmp_path / "cache").exists()


def test_the_default_plan_is_the_e2e_image_from_the_last_stage_and_the_pod_image() -> None:
    plan = images.plan(images.parser().parse_args([]))
    assert plan.specs == [images.ImageSpec("plugvisor:e2e", None)]
    assert plan.pod_ref == "plugvisor-e2e-pod:latest"
    assert plan.dockerfile == REPO / "Dockerfile"
    assert plan.build_args == {}


def test_several_images_and_build_args_go_into_one_plan_and_the_pod_image_can_be_left_out() -> None:
    argv = ["--image", "plugvisor:e2e", "--image", "plugvisor-lab:e2e=emulators", "--build-arg", "VERSION=9"]
    plan = images.plan(images.parser().parse_args([*argv, "--no-pod-image", "--ca-bundle", ""]))
    expected = [("plugvisor:e2e", None), ("plugvisor-lab:e2e", "emulators")]
    assert [(s.ref, s.target) for s in plan.specs] == expected
    assert plan.build_args == {"VERSION": "9"}
    assert plan.pod_ref is None
    assert plan.ca_bundle is None


def test_the_cache_defaults_to_the_users_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLUGVISOR_IMAGES_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert images.default_cache() == Path("/x/cache/plugvisor/images")
    monkeypatch.setenv("PLUGVISOR_IMAGES_CACHE", "/y/images")
    assert images.default_cache() == Path("/y/images")


class _Store:
    """buildah's image store, as far as Images.cached asks it: which names it holds."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def image_info(self, name: str) -> tuple[str, dict[str, str]] | None:
        return ("0" * 64, {}) if name in self.names else None


def _archived(tmp_path: Path, name: str, key: str) -> Any:
    """An Images whose cache holds an archive of name made from key, with its record."""
    cache = tmp_path / "cache"
    made = images.Images(cache, _Store(name), images.Runner(cache))
    archive = made.archives / images.archive_filename(name)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"x" * 10)
    built = images.Built("ref", name, archive, "0" * 64, 10, 8, rebuilt=True)
    archive.with_suffix(".json").write_text(images.json.dumps({**built.summary(), "ref": "ref", "key": key}))
    return made


def test_an_archive_made_from_the_same_inputs_is_reused(tmp_path: Path) -> None:
    made = _archived(tmp_path, "docker.io/library/a:1", "k1")
    reused = made.cached("a:1", "docker.io/library/a:1", "k1")
    assert reused is not None
    assert (reused.rebuilt, reused.archive_bytes, reused.unpacked_bytes) == (False, 10, 8)


def test_changed_inputs_a_truncated_archive_a_wiped_store_or_force_mean_a_rebuild(tmp_path: Path) -> None:
    name = "docker.io/library/a:1"
    made = _archived(tmp_path, name, "k1")
    assert made.cached("a:1", name, "k2") is None
    made.force = True
    assert made.cached("a:1", name, "k1") is None
    made.force = False
    made.buildah = _Store()
    assert made.cached("a:1", name, "k1") is None
    made.buildah = _Store(name)
    archive = made.archives / images.archive_filename(name)
    archive.write_bytes(b"x" * 5)
    assert made.cached("a:1", name, "k1") is None


def test_missing_tools_are_named_by_their_debian_packages_and_busybox_must_be_the_static_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    present = {"buildah", "dpkg-query"}
    monkeypatch.setattr(images.shutil, "which", lambda tool: f"/usr/bin/{tool}" if tool in present else None)
    monkeypatch.setattr(images, "package_installed", lambda package: False)
    assert images.missing_packages() == ["runc", "debootstrap", "busybox-static"]
    present |= {"runc", "debootstrap"}
    monkeypatch.setattr(images, "package_installed", lambda package: package == "busybox-static")
    assert images.missing_packages() == []


def test_without_permission_to_install_the_missing_packages_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(images, "missing_packages", lambda: ["buildah", "runc"])
    with pytest.raises(images.BuildError, match=r"missing Debian packages: buildah runc \(install them"):
        images.install_packages(images.Runner(tmp_path), allowed=False)


def test_the_stages_are_read_from_the_dockerfile_with_their_names_as_written() -> None:
    dockerfile = """
FROM --platform=$BUILDPLATFORM python:3.11 AS Build
from build as release
FROM release
FROM scratch AS \\
  last
"""
    assert images.dockerfile_stages(dockerfile) == ["build", "release", "last"]


def test_the_build_runs_the_distributions_runc_not_the_first_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoy = tmp_path / "runc"
    decoy.write_text("#!/bin/sh\n")
    decoy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/sbin:/usr/bin:/sbin:/bin")
    chosen = Path(images.runtime())
    assert chosen.is_absolute()
    assert chosen != decoy
