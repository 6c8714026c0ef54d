"""Module-level tools around the monitor: rank-collapse sweeps over context length, length-aware attention,
an architecture preflight, weight-spectrum analysis and low-rank compression.

The numbers come from :mod:`spectral_monitor.metrics` (one definition of each); these tools know
``nn.Module`` and run forwards, but not Lightning.
"""

from spectral_monitor.toolbox.length_scaling import (
    LengthScaledAttention,
    LogitScaling,
    QKNorm,
    attention_logit_scale,
)

__all__ = ["LengthScaledAttention", "LogitScaling", "QKNorm", "attention_logit_scale"]
