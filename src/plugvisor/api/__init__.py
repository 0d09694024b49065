"""The kubelet's gRPC APIs, generated from ``proto/`` by ``tools/generate_api.py``.

Everything under ``deviceplugin/``, ``podresources/``, ``pluginregistration/``,
``dra/`` (the DRA kubelet plugin API, v1 and v1beta1) and ``drahealth/`` (its
device health API, v1 and v1alpha1; upstream's ``dra-health``) is generated and
must not be edited: change the ``.proto`` and regenerate. The contract's
constants that live outside the ``.proto`` files are in
:mod:`plugvisor.common.constants`, where the gRPC-free agent can read them too.
"""
