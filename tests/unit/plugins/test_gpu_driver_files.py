"""NVIDIA's user-space driver in GPU containers: the toolkit's CDI devices, or the driver's files mounted.

The driver roots here are written by the tests (the layout of the real H200 node: ``/usr/local/nvidia`` with
``lib64/`` and ``bin/``; and a Debian host's ``/usr/lib/x86_64-linux-gnu``); the host root is a temporary
directory, the runtime's view of it ``/`` (a plugin container with the host at ``/host``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.dra import cdi as dra_cdi
from plugvisor.emulators import lab
from plugvisor.plugins.gpu import KIND, GpuOptions, driverfiles
from plugvisor.plugins.gpu.driverfiles import DriverLocator, Hook, Mount

VERSION = "580.159.04"
ARCH = "x86_64-linux-gnu"
LIBS = f"/usr/lib/{ARCH}"


def write_driver(root: Path, driver_root: str = "/usr/local/nvidia", lib: str = "lib64") -> Path:
    """libcuda and libnvidia-ml as the installer lays them out: the full version, a relative .so.1 link."""
    directory = root / driver_root.strip("/") / lib
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda", "libnvidia-ml"):
        (directory / f"{name}.so.{VERSION}").write_text(f"{name}\n")
        os.symlink(f"{name}.so.{VERSION}", directory / f"{name}.so.1")
        os.symlink(f"{name}.so.1", directory / f"{name}.so")  # the development link: not mounted
    bin_dir = root / driver_root.strip("/") / ("bin" if driver_root != "/" else "usr/bin")
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    return directory


def locator(root: Path, driver_root: str = "/usr/local/nvidia") -> DriverLocator:
    return DriverLocator(HostPaths(root=root, spec_root=Path("/")), driver_root, machine="x86_64")


def mounted(files: driverfiles.DriverFiles) -> dict[str, str]:
    return {m.container_path: m.host_path for m in files.mounts}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "host").mkdir()
    return tmp_path / "host"


class TestTheDriversFiles:
    def test_each_library_is_mounted_read_only_at_its_own_name_and_its_soname_in_the_multiarch_dir(
        self, root
    ):
        """libcuda.so.1 is a link; the container gets the file it names at that name, where a Debian or
        Ubuntu loader looks without an ldcache (its system search path), and the full-version name too."""
        write_driver(root)
        files = locator(root).find()
        where = "/usr/local/nvidia/lib64"
        assert mounted(files) == {
            f"{LIBS}/libcuda.so.1": f"{where}/libcuda.so.{VERSION}",
            f"{LIBS}/libcuda.so.{VERSION}": f"{where}/libcuda.so.{VERSION}",
            f"{LIBS}/libnvidia-ml.so.1": f"{where}/libnvidia-ml.so.{VERSION}",
            f"{LIBS}/libnvidia-ml.so.{VERSION}": f"{where}/libnvidia-ml.so.{VERSION}",
            "/usr/bin/nvidia-smi": "/usr/local/nvidia/bin/nvidia-smi",
        }
        assert files.library_dir == LIBS
        assert all(Mount(m.host_path, m.container_path).render()["options"][0] == "ro" for m in files.mounts)

    def test_host_paths_are_the_hosts_not_the_agents_view(self, root):
        write_driver(root)
        seen_by_agent = DriverLocator(HostPaths(root=root), "/usr/local/nvidia", machine="x86_64").find()
        assert all(m.host_path.startswith(str(root)) for m in seen_by_agent.mounts)
        assert all(m.host_path.startswith("/usr/local/nvidia/") for m in locator(root).find().mounts)

    def test_a_merged_usr_host_is_read_once_and_the_first_directory_with_a_library_wins(self, root):
        """Debian: /lib -> usr/lib, so lib/<triplet> and usr/lib/<triplet> are one directory; a 32-bit copy
        in usr/lib (RHEL's place for them) is not taken when lib64 has the library."""
        write_driver(root, "/", f"usr/lib/{ARCH}")
        os.symlink("usr/lib", root / "lib")
        (root / "usr/lib" / f"libcuda.so.{VERSION}").write_text("32-bit\n")
        files = locator(root, "/").find()
        assert mounted(files)[f"{LIBS}/libcuda.so.1"] == f"/usr/lib/{ARCH}/libcuda.so.{VERSION}"
        assert len(files.mounts) == len(mounted(files)) == 5

    def test_aarch64_nodes_use_their_own_triplet(self, root):
        write_driver(root, "/", "usr/lib/aarch64-linux-gnu")
        files = DriverLocator(HostPaths(root=root, spec_root=Path("/")), "/", machine="arm64").find()
        assert "/usr/lib/aarch64-linux-gnu/libcuda.so.1" in mounted(files)

    def test_without_a_driver_there_is_nothing_to_mount(self, root):
        files = locator(root).find()
        assert (files.mounts, files.hooks, files.toolkit_devices) == ((), (), frozenset())

    def test_a_new_library_is_seen_once_its_directory_changes(self, root):
        directory = write_driver(root)
        found = locator(root)
        assert f"{LIBS}/libnvidia-ptxjitcompiler.so.1" not in mounted(found.find())
        (directory / f"libnvidia-ptxjitcompiler.so.{VERSION}").write_text("x\n")
        os.symlink(f"libnvidia-ptxjitcompiler.so.{VERSION}", directory / "libnvidia-ptxjitcompiler.so.1")
        assert f"{LIBS}/libnvidia-ptxjitcompiler.so.1" in mounted(found.find())


class TestHostileDriverRoots:
    def skipped(
        self, root: Path, driver_root: str = "/usr/local/nvidia", lib: str = "lib64"
    ) -> tuple[driverfiles.DriverFiles, list[dict[str, object]]]:
        """What one find gives, and what two finds log (the second after the directory changed)."""
        found = locator(root, driver_root)
        with structlog.testing.capture_logs() as logs:
            files = found.find()
            os.utime(root / driver_root.strip("/") / lib, ns=(1, 1))  # the next find reads again
            found.find()
        return files, [e for e in logs if e["event"] == "driver_file_skipped"]

    def test_a_dangling_link_is_skipped_with_one_line(self, root):
        directory = write_driver(root)
        os.symlink("libnvidia-cfg.so.999", directory / "libnvidia-cfg.so.1")
        files, logs = self.skipped(root)
        assert f"{LIBS}/libnvidia-cfg.so.1" not in mounted(files)
        assert f"{LIBS}/libcuda.so.1" in mounted(files)
        assert len(logs) == 1 and "dangling" in str(logs[0]["problem"])

    @pytest.mark.parametrize("where", ["loop", "etc/cdi"])
    def test_a_looping_driver_root_or_cdi_dir_finds_no_files_with_one_line_and_raises_nothing(
        self, root, where
    ):
        """A symlink loop where the driver root or a CDI directory should be: nothing of it is found, the
        allocation goes on without driver files, and it is said once, not at every find."""
        (root / where).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(Path(where).name, root / where)
        found = locator(root, "/loop")
        with structlog.testing.capture_logs() as logs:
            first = found.find()
            second = found.find()
        assert first.mounts == () and second.mounts == ()
        lines = [e for e in logs if e["event"] == "driver_file_skipped"]
        assert len(lines) == 1 and "symbolic links" in str(lines[0]["problem"])
        assert lines[0]["path"] == f"/{where}"

    def test_a_library_that_is_a_directory_is_skipped_with_one_line(self, root):
        directory = write_driver(root)
        (directory / f"libnvidia-encode.so.{VERSION}").mkdir()
        files, logs = self.skipped(root)
        assert not any("encode" in path for path in mounted(files))
        assert len(logs) == 1 and "a directory" in str(logs[0]["problem"])

    @pytest.mark.parametrize(
        "target", ["/etc/shadow", "../../../../../../../../etc/shadow", "../../../../etc/libcuda.so.1"]
    )
    def test_links_leaving_the_driver_root_are_never_followed_out_of_it(self, root, target):
        """Absolute or climbing, a link is resolved as the host would after chroot(hostRoot), so it never
        leaves the host root; one leading out of the driver root is not a driver file either."""
        directory = write_driver(root)
        (root / "etc").mkdir()
        (root / "etc/shadow").write_text("secret\n")
        (root / "etc/libcuda.so.1").write_text("not the driver's\n")
        (directory / "libcuda.so.1").unlink()
        os.symlink(target, directory / "libcuda.so.1")
        files, logs = self.skipped(root)
        assert f"{LIBS}/libcuda.so.1" not in mounted(files)
        assert not any(path.startswith("/etc") for path in mounted(files).values())
        assert len(logs) == 1 and "outside the driver root" in str(logs[0]["problem"])

    def test_a_link_to_another_file_of_the_driver_root_is_not_taken_for_the_library(self, root):
        """With the host's / as driver root everything is inside it: the name must still be the library's."""
        directory = write_driver(root, "/", f"usr/lib/{ARCH}")
        (root / "etc").mkdir()
        (root / "etc/passwd").write_text("root:x:0:0\n")
        (directory / "libcuda.so.1").unlink()
        os.symlink("/etc/passwd", directory / "libcuda.so.1")
        files = locator(root, "/").find()
        assert f"{LIBS}/libcuda.so.1" not in mounted(files)
        assert "/etc/passwd" not in mounted(files).values()

    def test_a_ten_thousand_file_library_directory_is_read_and_the_driver_found(self, root):
        directory = write_driver(root, "/", f"usr/lib/{ARCH}")
        for n in range(10_000):
            (directory / f"libother{n}.so.1").touch()
        files, logs = self.skipped(root, "/", f"usr/lib/{ARCH}")
        assert f"{LIBS}/libcuda.so.1" in mounted(files) and logs == []

    def test_a_directory_past_the_entry_limit_is_read_only_that_far_with_one_line(self, root, monkeypatch):
        directory = write_driver(root)
        for n in range(40):
            (directory / f"libother{n}.so.1").touch()
        monkeypatch.setattr(driverfiles, "MAX_ENTRIES", 20)
        _files, logs = self.skipped(root)
        assert len(logs) == 1 and "more than 20 entries" in str(logs[0]["problem"])


class TestHooks:
    def test_no_hook_without_the_toolkits_hook_program(self, root):
        write_driver(root)
        assert locator(root).find().hooks == ()

    def test_nvidia_cdi_hook_refreshes_the_loader_cache_for_the_multiarch_dir(self, root):
        write_driver(root)
        hook = root / "usr/bin/nvidia-cdi-hook"
        hook.parent.mkdir(parents=True)
        hook.write_text("#!/bin/sh\n")
        hook.chmod(0o755)
        (root / "usr/bin/nvidia-ctk").write_text("#!/bin/sh\n")
        (root / "usr/bin/nvidia-ctk").chmod(0o755)
        assert locator(root).find().hooks == (
            Hook("/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "update-ldcache", "--folder", LIBS)),
        )

    def test_an_older_toolkits_nvidia_ctk_runs_it_as_a_subcommand(self, root):
        write_driver(root)
        ctk = root / "usr/local/bin/nvidia-ctk"
        ctk.parent.mkdir(parents=True)
        ctk.write_text("#!/bin/sh\n")
        ctk.chmod(0o755)
        (hook,) = locator(root).find().hooks
        assert hook.args == ("nvidia-ctk", "hook", "update-ldcache", "--folder", LIBS)
        assert hook.render()["hookName"] == "createContainer"

    def test_a_hook_program_that_is_not_executable_is_not_used(self, root):
        write_driver(root)
        hook = root / "usr/bin/nvidia-cdi-hook"
        hook.parent.mkdir(parents=True)
        hook.write_text("not a program\n")
        assert locator(root).find().hooks == ()


TOOLKIT_SPEC = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
  - name: "0"
    containerEdits: {deviceNodes: [{path: /dev/nvidia3}]}
  - name: GPU-aaaa
    containerEdits: {deviceNodes: [{path: /dev/nvidia3}]}
  - name: "0:1"
    containerEdits: {deviceNodes: [{path: /dev/nvidia3}, {path: /dev/nvidia-caps/nvidia-cap12}]}
  - name: all
    containerEdits: {deviceNodes: [{path: /dev/nvidia3}]}
containerEdits:
  mounts: [{hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04, containerPath: /x}]
"""


class TestTheToolkitsOwnDevices:
    def test_the_toolkits_devices_are_read_from_its_spec(self, root):
        (root / "var/run/cdi").mkdir(parents=True)
        (root / "var/run/cdi/nvidia.yaml").write_text(TOOLKIT_SPEC)
        (root / "var/run/cdi/k8s.gpu.plugvisor.io-claim_x.json").write_text('{"kind": "nvidia.com/gpu"}')
        (root / "var/run/cdi/other.json").write_text('{"kind": "vendor.example/thing", "devices": []}')
        (root / "var/run/cdi/broken.yaml").write_text("kind: nvidia.com/gpu\n  - [")
        files = locator(root).find()
        assert files.toolkit_devices == {"0", "0:1", "GPU-aaaa", "all"}
        # the toolkit's index names are NVML's: "0" is the GPU of minor 3 here; a MIG device ("0:1") and
        # "all" are no one GPU
        assert files.toolkit_minors == ((3, "0"),)

    def test_a_gpu_the_toolkit_names_gets_its_device_and_no_mounts_of_ours(self, root):
        write_driver(root)
        (root / "etc/cdi").mkdir(parents=True)
        (root / "etc/cdi/nvidia.yaml").write_text(TOOLKIT_SPEC)
        files = locator(root).find()
        both = [("GPU-aaaa", 0)]
        got = dra_cdi_edits(files, both, in_spec=False)
        assert got.cdi_devices == ["vendor.example/gpu=x", "nvidia.com/gpu=GPU-aaaa"]
        assert got.mounts == ()
        by_minor = dra_cdi_edits(files, [(None, 3)], in_spec=False)  # a GPU whose UUID the spec lacks
        assert by_minor.cdi_devices[-1] == "nvidia.com/gpu=0"
        assert dra_cdi_edits(files, [(None, 0)], in_spec=False).cdi_devices == ["vendor.example/gpu=x"]

    def test_a_gpu_the_toolkit_does_not_name_gets_the_drivers_files(self, root):
        write_driver(root)
        (root / "etc/cdi").mkdir(parents=True)
        (root / "etc/cdi/nvidia.yaml").write_text(TOOLKIT_SPEC)
        got = dra_cdi_edits(locator(root).find(), [("GPU-aaaa", 0), ("GPU-bbbb", 1)], in_spec=False)
        assert got.cdi_devices == ["vendor.example/gpu=x"]
        assert {m.container_path for m in got.mounts} >= {f"{LIBS}/libcuda.so.1", "/usr/bin/nvidia-smi"}
        assert all(m.read_only for m in got.mounts)


def dra_cdi_edits(files, gpus, *, in_spec):
    from plugvisor.plugins.gpu import cdi

    start = ContainerAllocation(cdi_devices=["vendor.example/gpu=x"])
    return cdi.with_driver(start, files, gpus, in_spec=in_spec)


@pytest.fixture(scope="module")
def pristine():
    base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvd-" if Path("/dev/shm").is_dir() else "/tmp/pvd-"))
    lab.Lab.create(str(base / "root"), "dgx-like")
    yield base / "root"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def lab_root(pristine):
    copy = Path(tempfile.mkdtemp(dir=pristine.parent)) / "root"
    shutil.copytree(pristine, copy, symlinks=True)
    yield copy
    shutil.rmtree(copy.parent, ignore_errors=True)


def allocate(lab_root: Path, options: dict[str, object], ids: int = 2) -> ContainerAllocation:
    source = KIND.build(GpuOptions.model_validate(options), HostPaths(root=lab_root), resource="x.io/gpu")
    snapshot = source.scan()
    chosen = snapshot.only(list(snapshot.devices)[:ids])
    from plugvisor.deviceplugin.allocation import build_allocation

    return source.post_allocate(build_allocation(chosen.devices), chosen)


class TestTheGpuKind:
    def test_without_cdi_allocate_mounts_the_driver_and_a_dra_claims_spec_carries_it(self, lab_root):
        write_driver(lab_root)
        allocation = allocate(lab_root, {"driverRoot": "/usr/local/nvidia"})
        paths = {m.container_path: m.host_path for m in allocation.mounts}
        assert paths[f"{LIBS}/libcuda.so.1"] == str(lab_root / f"usr/local/nvidia/lib64/libcuda.so.{VERSION}")
        edits = dra_cdi.container_edits(allocation)  # what a DRA claim of these GPUs gets
        mount = next(m for m in edits["mounts"] if m["containerPath"] == f"{LIBS}/libcuda.so.1")
        assert "ro" in mount["options"]

    def test_with_cdi_the_resources_spec_carries_the_mounts_and_hook_for_every_gpu(self, lab_root):
        write_driver(lab_root)
        hook = lab_root / "usr/bin/nvidia-cdi-hook"
        hook.parent.mkdir(parents=True, exist_ok=True)
        hook.write_text("#!/bin/sh\n")
        hook.chmod(0o755)
        options = {"driverRoot": "/usr/local/nvidia", "cdi": True}
        allocation = allocate(lab_root, options)
        assert allocation.mounts == ()  # the spec has them
        spec = json.loads((lab_root / "var/run/cdi/x.io-gpu.json").read_text())
        edits = spec["containerEdits"]
        assert {m["containerPath"] for m in edits["mounts"]} >= {
            f"{LIBS}/libcuda.so.1",
            "/usr/bin/nvidia-smi",
        }
        assert edits["hooks"] == [
            {
                "hookName": "createContainer",
                "path": str(hook),  # on the host, as the runtime runs it
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBS],
            }
        ]

    def test_with_the_toolkits_spec_the_container_gets_its_devices_by_uuid(self, lab_root):
        write_driver(lab_root)
        source = KIND.build(GpuOptions(), HostPaths(root=lab_root), resource="x.io/gpu")
        uuids = sorted(g.uuid for g in source.scan().data.gpus.values() if g.uuid)
        (lab_root / "etc/cdi").mkdir(parents=True, exist_ok=True)
        devices = [{"name": u, "containerEdits": {}} for u in uuids]
        (lab_root / "etc/cdi/nvidia.json").write_text(
            json.dumps({"kind": "nvidia.com/gpu", "devices": devices})
        )
        allocation = allocate(lab_root, {"driverRoot": "/usr/local/nvidia", "cdi": True}, ids=1)
        assert [i for i in allocation.cdi_devices if i.startswith("nvidia.com/gpu=")] == [
            f"nvidia.com/gpu={allocation.envs['NVIDIA_VISIBLE_DEVICES']}"
        ]
        spec = json.loads((lab_root / "var/run/cdi/x.io-gpu.json").read_text())
        assert "mounts" not in spec.get("containerEdits", {})

    def test_gpus_of_other_vendors_get_nothing_of_nvidias(self, lab_root):
        write_driver(lab_root)
        allocation = allocate(lab_root, {"driverRoot": "/usr/local/nvidia", "match": {"vendors": ["0x1002"]}})
        assert allocation.mounts == ()
