"""SIGHUP picks up a reinstalled kind: its children restart on the new code, the others are left alone.

The kind here is an outside package found through its entry point, installed into a
directory on the agent's PYTHONPATH as pip would (the package and its .dist-info);
"reinstalling" it rewrites the package's module.
"""

import signal
import textwrap

import pytest

from .conftest import FUSE, registered_all

RELOADING = "example.com/reloading"

MODULE = textwrap.dedent(
    """
    from plugvisor.plugins.generic import GenericOptions, GenericSource
    from plugvisor.plugins.kinds import PluginKind

    COUNT = {count}


    class Options(GenericOptions):
    {fields}

    def build(options, paths, *, resource):
        return GenericSource(options.model_copy(update={{"count": COUNT}}), paths, resource=resource)


    KIND = PluginKind("reloading", Options, build)
    """
)


def install(site, *, count: int, fields: str = "pass") -> None:
    """Write (or rewrite, as a reinstall does) the kind's package and its metadata into ``site``."""
    package = site / "pvreloading"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(MODULE.format(count=count, fields=textwrap.indent(fields, "    ")))
    info = site / "pvreloading-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pvreloading\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[plugvisor.plugins]\nreloading = pvreloading:KIND\n")


@pytest.mark.parametrize("spawner", ["forkserver", "exec"])
async def test_sighup_restarts_the_children_of_a_reinstalled_kind_on_its_new_code(
    node, kubelet, agents, short_dir, spawner
):
    """Reinstalled with other behaviour; then with a new option the file must use: rejected until it does."""
    site = short_dir / "site"
    install(site, count=1)
    resources = [
        {"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"]},
        {"name": RELOADING, "kind": "reloading", "paths": ["/dev/sda"]},
    ]
    node.write_config(resources, supervisor={"spawner": spawner})
    agent = await agents({"PYTHONPATH": str(site)})
    await kubelet.wait_for(registered_all({FUSE: 1, RELOADING: 1}), timeout=30)
    first = agent.children()

    install(site, count=3)  # the same options, new code
    agent.send(signal.SIGHUP)
    await kubelet.wait_for(registered_all({FUSE: 1, RELOADING: 3}), timeout=30)
    restarted = first[RELOADING]["pid"]
    await agent.wait_state(lambda c: c[RELOADING]["pid"] != restarted and c[RELOADING]["registered"])
    assert agent.children()[FUSE]["pid"] == first[FUSE]["pid"], "a built-in kind's child is not restarted"
    assert "event='kinds_changed'" in agent.log()

    install(site, count=2, fields="label: str")  # a new option the file lacks: the reload is rejected
    agent.send(signal.SIGHUP)
    await agent.wait_log("reload_rejected")
    resources[1]["label"] = "second"  # the file catches up: now it is accepted, with the new code
    node.write_config(resources, supervisor={"spawner": spawner})
    agent.send(signal.SIGHUP)
    await kubelet.wait_for(registered_all({FUSE: 1, RELOADING: 2}), timeout=30)
    assert agent.children()[FUSE]["pid"] == first[FUSE]["pid"]
    assert await agent.stop() == 0
