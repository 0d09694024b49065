"""Built-in device kinds, and the registry through which third parties add their own.

A kind is a :class:`~plugvisor.plugins.kinds.PluginKind`: a name, a pydantic model
of its configuration keys, and a factory for its device source. Kinds are found
through the ``plugvisor.plugins`` entry-point group, so an installed package adds
one without touching plugvisor. Kinds never import each other.
"""
