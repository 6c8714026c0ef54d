"""Probes: what looks at a model while it trains (attention-kernel inputs, the residual stream, the weights).

Probes know ``nn.Module`` but not Lightning; they are armed on logging steps only and hand back detached
copies of what they saw, or measurements of it.

Examples:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    >>> sorted({record.layer for record in WeightProbe(model, per_head=False).measure(step=0)})
    ['0', '0.k', '0.out_proj', '0.q', '0.v', '1']
"""

from spectral_monitor.probes.attention import (
    AttentionCapture,
    AttentionExtractor,
    register_attention_extractor,
)
from spectral_monitor.probes.attention_families import AttentionFamilies, QKVLayout, register_qkv_layout
from spectral_monitor.probes.attention_records import (
    ROOT_LAYER_NAME,
    AttentionInputs,
    AttentionRecording,
    AttentionSample,
    CapturedAttention,
    LogitSoftcap,
    SkippedCapture,
)
from spectral_monitor.probes.attention_weights import AttentionWeights, AttentionWeightsReader
from spectral_monitor.probes.residual import (
    ResidualCapture,
    ResidualRecording,
    ResidualSample,
    find_transformer_blocks,
)
from spectral_monitor.probes.weights import WEIGHT_FAMILY, WeightProbe, query_key_spectral_norms
from spectral_monitor.probes.wrappers import unwrapped_named_modules

__all__ = [
    "ROOT_LAYER_NAME",
    "WEIGHT_FAMILY",
    "AttentionCapture",
    "AttentionExtractor",
    "AttentionInputs",
    "AttentionRecording",
    "AttentionFamilies",
    "AttentionSample",
    "AttentionWeights",
    "AttentionWeightsReader",
    "CapturedAttention",
    "LogitSoftcap",
    "QKVLayout",
    "ResidualCapture",
    "ResidualRecording",
    "ResidualSample",
    "SkippedCapture",
    "WeightProbe",
    "find_transformer_blocks",
    "query_key_spectral_norms",
    "register_attention_extractor",
    "register_qkv_layout",
    "unwrapped_named_modules",
]
