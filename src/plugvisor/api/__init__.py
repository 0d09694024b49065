"""The kubelet's gRPC APIs, generated from ``proto/`` by ``tools/generate_api.py``.

Everything under ``deviceplugin/``, ``podresources/`` and ``pluginregistration/``
is generated and must not be edited: change the ``.proto`` and regenerate. The
contract's constants that live outside the ``.proto`` files are in
:mod:`plugvisor.common.constants`, where the gRPC-free agent can read them too.
"""
