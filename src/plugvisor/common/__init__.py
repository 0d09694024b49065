"""The shared layer: small, gRPC-free primitives that the agent, the framework and the kinds all use.

Everything here exists once for the whole project: the kubelet contract's
constants (:mod:`.constants`) and name rules (:mod:`.names`), how plugin sockets
are named (:mod:`.sockets`), exit statuses (:mod:`.exitcodes`), the sd_notify
datagram format and sender (:mod:`.notify`), the kubelet-directory watch
(:mod:`.kubeletdir`), where the host is read from (:mod:`.hostpaths`), logging
(:mod:`.logs`) and validation messages (:mod:`.validation`).

It imports no gRPC and nothing else of plugvisor (import-linter contracts in
pyproject.toml), so the agent, which must never load gRPC, can share it with
the plugins it runs instead of restating it.
"""
