"""The kubelet's gRPC APIs, generated from ``proto/`` by ``tools/generate_api.py``.

Only :mod:`plugvisor.api.constants` is written by hand. Everything under
``deviceplugin/``, ``podresources/`` and ``pluginregistration/`` is generated
and must not be edited: change the ``.proto`` and regenerate.
"""
