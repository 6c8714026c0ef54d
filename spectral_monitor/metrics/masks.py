"""What an attention mask says: which keys each query may attend, and whether that pattern is causal.

The one reading of attention masks in the package. A mask is boolean or an additive float logit bias:

- boolean: True = the query may attend the key (``F.scaled_dot_product_attention``'s convention; PyTorch's
  ``key_padding_mask`` and ``nn.MultiheadAttention``'s bool ``attn_mask`` say the opposite, and their readers
  pass ``true_means_masked=True``);
- float: ``-inf``, or anything at or below half the dtype's lowest value (the "minus infinity" of Hugging Face
  masks), means "not attendable"; every other value is a bias that belongs to the logits (T5's relative
  position bias, ALiBi) and leaves the key attendable.

The keys a query may attend come from the mask (and the causal flag, where one is given); a pattern whose
attendable sets are lower-triangular is causal whatever the flag says.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["additive_mask", "attendable_pattern", "causal_pattern", "is_causal_pattern"]


def additive_mask(mask: Tensor, *, true_means_masked: bool = False) -> Tensor:
    """A float32 copy of ``mask`` as an additive logit bias with ``-inf`` wherever attention is not allowed.

    Float values at or below half their dtype's lowest value become ``-inf``: after the softmax that changes
    nothing, but it makes "not attendable" exact.
    """
    if mask.dtype == torch.bool:
        blocked = mask if true_means_masked else ~mask
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            blocked, -math.inf
        )
    if not mask.is_floating_point():
        raise ValueError(f"attention masks must be bool or floating point, got {mask.dtype}")
    return mask.to(torch.float32, copy=True).masked_fill_(mask <= torch.finfo(mask.dtype).min / 2, -math.inf)


def causal_pattern(num_queries: int, num_keys: int, device: torch.device | None = None) -> Tensor:
    """SDPA's ``is_causal`` pattern (n, m) bool: query i attends keys j <= i (top-left aligned)."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril()


def attendable_pattern(bias: Tensor | None, causal: bool, shape: tuple[int, ...]) -> Tensor | None:
    """Where a query may attend a key, bool broadcastable to ``shape`` (..., n, m); ``None`` = everywhere.

    ``bias``: an additive mask as :func:`additive_mask` returns it (``-inf`` = not attendable).
    """
    num_queries, num_keys = shape[-2:]
    attendable = None
    if bias is not None:
        attendable = ~torch.isneginf(bias)
    if causal:
        device = None if bias is None else bias.device
        pattern = causal_pattern(num_queries, num_keys, device)
        attendable = pattern if attendable is None else attendable & pattern
    return attendable


def is_causal_pattern(attendable: Tensor, query_mask: Tensor | None = None) -> bool:
    """Whether every real query i may attend only keys j <= i, and some query a key before itself.

    ``attendable`` (..., n, m) bool; ``query_mask`` bool broadcastable to (..., n), True = real query. A
    pattern that allows each query its own key only (one-token sequences) is both lower and upper
    triangular, and is not called causal: its eigenvalues are meaningful.
    """
    num_queries, num_keys = attendable.shape[-2:]
    if query_mask is not None:
        attendable = attendable & query_mask[..., :, None]
    later = torch.ones(num_queries, num_keys, dtype=torch.bool, device=attendable.device).triu(1)
    earlier = torch.ones(num_queries, num_keys, dtype=torch.bool, device=attendable.device).tril(-1)
    return not bool((attendable & later).any()) and bool((attendable & earlier).any())
