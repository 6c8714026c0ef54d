"""The monitor in training frameworks other than Lightning, each an adapter of the framework's events to
the framework-free :class:`~spectral_monitor.core.MonitorSession`:
:mod:`spectral_monitor.integrations.huggingface` (``transformers.Trainer``). Each module imports its
framework, so none is imported here.
"""
