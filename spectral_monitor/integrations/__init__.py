"""The monitor in training loops other than Lightning's, each an adapter of the loop's events to the
framework-free :class:`~spectral_monitor.core.MonitorSession`: :mod:`spectral_monitor.integrations.loop`
(:class:`~spectral_monitor.Monitor`, a plain PyTorch loop) and
:mod:`spectral_monitor.integrations.huggingface` (``transformers.Trainer``, which that module imports:
nothing is imported here).
"""
