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

    Args:
        mask: A bool mask, or a float additive bias.
        true_means_masked: A bool mask's True means "not attendable" (PyTorch's ``key_padding_mask``), not
            "attendable" (``F.scaled_dot_product_attention``'s convention).

    Returns:
        The float32 bias, ``mask``'s shape.

    Raises:
        ValueError: ``mask`` is neither bool nor floating point.

    Examples:
        >>> import torch
        >>> additive_mask(torch.tensor([True, False]))
        tensor([0., -inf])
        >>> additive_mask(torch.tensor([0.5, torch.finfo(torch.float16).min], dtype=torch.float16))
        tensor([0.5000, -inf])
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
    """SDPA's ``is_causal`` pattern: query i attends keys j <= i (top-left aligned).

    Args:
        num_queries: n.
        num_keys: m.
        device: Where the pattern is made.

    Returns:
        The (n, m) bool pattern, True = attendable.

    Examples:
        >>> causal_pattern(2, 3)
        tensor([[ True, False, False],
                [ True,  True, False]])
    """
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril()


def attendable_pattern(bias: Tensor | None, causal: bool, shape: tuple[int, ...]) -> Tensor | None:
    """Where a query may attend a key.

    Args:
        bias: An additive mask as :func:`additive_mask` returns it (``-inf`` = not attendable), or None.
        causal: The kernel also applies :func:`causal_pattern`.
        shape: The attention's shape (..., n, m).

    Returns:
        A bool pattern broadcastable to ``shape``, True = attendable; None when every key is.

    Examples:
        >>> import torch
        >>> attendable_pattern(torch.tensor([0.0, -torch.inf]), True, (2, 2))
        tensor([[ True, False],
                [ True, False]])
        >>> attendable_pattern(None, False, (2, 2)) is None
        True
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

    A pattern that allows each query its own key only (one-token sequences) is both lower and upper
    triangular, and is not called causal: its eigenvalues are meaningful.

    Args:
        attendable: The (..., n, m) bool pattern, True = attendable.
        query_mask: Bool broadcastable to (..., n), True = real query; padded queries are not looked at.

    Returns:
        Whether the pattern is causal.

    Examples:
        >>> import torch
        >>> is_causal_pattern(causal_pattern(3, 3)), is_causal_pattern(torch.eye(3, dtype=torch.bool))
        (True, False)
    """
    num_queries, num_keys = attendable.shape[-2:]
    if query_mask is not None:
        attendable = attendable & query_mask[..., :, None]
    later = torch.ones(num_queries, num_keys, dtype=torch.bool, device=attendable.device).triu(1)
    earlier = torch.ones(num_queries, num_keys, dtype=torch.bool, device=attendable.device).tril(-1)
    return not bool((attendable & later).any()) and bool((attendable & earlier).any())
