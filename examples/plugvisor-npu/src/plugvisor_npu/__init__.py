"""Acme N1 NPUs for plugvisor: the ``npu`` plugin kind (:mod:`.kind`), ``acme-npu`` lab kind (:mod:`.lab`).

Two modules so that each loads alone: the agent loads the plugin kind to validate a
configuration, the lab loads the lab kind, and neither needs the other.
"""
