"""The embedded demo: a tiny transformer and a synthetic recall task, small enough to train on a CPU.

These classes are ``pytorch_lightning``'s (``lightning.pytorch``'s where only that is installed);
:mod:`spectral_monitor.demo.lightning_pytorch` has the same model and data for ``lightning.pytorch``.
"""

from spectral_monitor.demo.data import SyntheticDataModule, associative_recall_batch
from spectral_monitor.demo.model import DemoTransformer, LengthScaledAttention, attention_logit_scale

__all__ = [
    "DemoTransformer",
    "LengthScaledAttention",
    "SyntheticDataModule",
    "associative_recall_batch",
    "attention_logit_scale",
]
