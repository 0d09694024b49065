"""Built-in device kinds, and the registry through which third parties add their own.

A kind is a :class:`PluginKind`: a name, a pydantic model of its configuration
keys, and a factory for its device source. Kinds are found through the
``plugvisor.plugins`` entry-point group, so an installed package adds one without
touching plugvisor (docs/writing-a-kind.md). Kinds never import each other.
"""

from plugvisor.plugins.kinds import PluginKind

__all__ = ["PluginKind"]
