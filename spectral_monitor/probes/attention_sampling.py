"""How one attention kernel call's inputs become a record: the sampled sequences' q and k, copied, with the
keys each real query may attend and the queries that are real.

:class:`~spectral_monitor.probes.attention_records.AttentionInputs` comes from the kernel interception or an
extractor; :func:`captured_attention` makes the
:class:`~spectral_monitor.probes.attention_records.CapturedAttention` the measurement reads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spectral_monitor.metrics.masks import additive_mask, attendable_pattern, is_causal_pattern
from spectral_monitor.probes.attention_records import AttentionInputs, CapturedAttention
from spectral_monitor.probes.token_masks import ForwardTokenMasks, checked_token_mask

__all__ = ["captured_attention"]


def captured_attention(
    layer: str,
    inputs: AttentionInputs | None,
    max_sequences: int,
    token_masks: ForwardTokenMasks,
    padded_queries: Tensor | None = None,
    batch: int | None = None,
) -> CapturedAttention | None:
    """Detached copies of the first ``max_sequences`` sequences of ``inputs``, with key and query masks.

    Real queries are those the inputs, the kernel call (``padded_queries``) and the forward's padding masks
    (``token_masks``) leave, among those with an attendable key; attendable keys are those of real queries.

    Args:
        layer: the name the record carries.
        inputs: what the kernel call or an extractor read; ``None`` = nothing to capture.
        max_sequences: how many of the batch's first sequences to keep.
        token_masks: the real tokens the forward's modules were given.
        padded_queries: (B, n) bool, True = a padded query, as the kernel call's own padding mask says.
        batch: the forward's sequences, where ``inputs`` hold only the sampled ones; None: ``inputs``'.

    Returns:
        The record, or ``None`` when ``inputs`` is ``None``.

    Raises:
        TypeError: if ``inputs`` is neither :class:`AttentionInputs` nor ``None`` (an extractor's result).
        ValueError: if the query heads cannot share the key heads evenly, or a query mask is malformed.

    Examples:
        Grouped-query attention: two key heads are repeated for four query heads, and the padded query
        leaves the record's real queries:

        >>> import torch
        >>> from spectral_monitor.probes.token_masks import ForwardTokenMasks
        >>> inputs = AttentionInputs(torch.randn(3, 4, 5, 8), torch.randn(3, 2, 5, 8),
        ...                          query_mask=torch.tensor([[True] * 4 + [False]] * 3))
        >>> captured = captured_attention("attn", inputs, 2, ForwardTokenMasks())
        >>> captured.k.shape, captured.query_mask[0].tolist()
        (torch.Size([2, 4, 5, 8]), [True, True, True, True, False])
    """
    if inputs is None:
        return None
    if not isinstance(inputs, AttentionInputs):
        raise TypeError(
            f"an attention extractor must return AttentionInputs or None, got {type(inputs).__name__}"
        )
    q, k = _batch_heads_layout(inputs.q), _batch_heads_layout(inputs.k)
    batch = q.shape[0] if batch is None else batch
    sequences = min(max_sequences, q.shape[0])
    num_queries, num_keys = q.shape[2], k.shape[2]
    q = _copy(q[:sequences])
    k = k[:sequences] if k.shape[0] > 1 else k.expand(sequences, *k.shape[1:])
    heads, key_heads = q.shape[1], k.shape[1]
    if heads % key_heads:
        raise ValueError(f"{heads} query heads cannot share {key_heads} key heads")
    k = k.repeat_interleave(heads // key_heads, dim=1) if key_heads < heads else _copy(k)

    mask = None
    if inputs.mask is not None:
        mask = _batch_heads_mask(inputs.mask, inputs.q.shape, sequences)
        mask = additive_mask(mask, true_means_masked=False)
        torch.broadcast_shapes(mask.shape, (sequences, heads, num_queries, num_keys))
    scale = inputs.scale if inputs.scale is not None else 1.0 / math.sqrt(q.shape[-1])

    real_queries = None
    query_masks = [inputs.query_mask, token_masks.real_tokens(num_queries, batch)]
    if padded_queries is not None:
        query_masks.append(~padded_queries)
    for given in query_masks:
        if given is not None:
            given = checked_token_mask(given, "query_mask")[:sequences].to(q.device)
            real_queries = _conjunction(real_queries, given)
    causal = bool(inputs.causal)
    if mask is not None and mask.shape[-2] > 1:
        attendable = attendable_pattern(mask, causal, (num_queries, num_keys))
        assert attendable is not None
        attendable = attendable.expand(sequences, -1, num_queries, num_keys)
        query_mask = attendable.any(dim=(1, 3))
        if real_queries is not None:
            query_mask &= real_queries
        key_mask = (attendable & query_mask[:, None, :, None]).any(dim=(1, 2))
        causal = causal or is_causal_pattern(attendable, query_mask[:, None, :])
    else:
        key_mask, query_mask = _attendable_keys_and_queries(
            mask, causal, real_queries, sequences, num_queries, num_keys, q.device
        )
    return CapturedAttention(
        layer=layer,
        q=q,
        k=k,
        mask=mask,
        causal=causal,
        scale=float(scale),
        key_mask=None if key_mask is None or bool(key_mask.all()) else key_mask,
        query_mask=None if query_mask is None or bool(query_mask.all()) else query_mask,
        logit_transform=inputs.logit_transform,
    )


def _batch_heads_layout(tensor: Tensor) -> Tensor:
    """(..., L, E) as SDPA accepts it -> (B, H, L, E): absent dims become 1, extra dims join heads."""
    if tensor.dim() == 2:
        return tensor.view(1, 1, *tensor.shape)
    if tensor.dim() == 3:
        return tensor.unsqueeze(1)
    return tensor.reshape(tensor.shape[0], -1, *tensor.shape[-2:])


def _batch_heads_mask(mask: Tensor, query_shape: torch.Size, sequences: int) -> Tensor:
    """A mask broadcastable to SDPA's (..., L, S) as (B or 1, H or 1, L, S), cut to the sampled sequences."""
    mask = mask[(None,) * (len(query_shape) - mask.dim())]
    if len(query_shape) > 4:  # extra dims join the heads, as for q; broadcast dims must be materialised
        mask = mask.expand(*query_shape[:-2], *mask.shape[-2:])
    mask = mask[:sequences] if mask.dim() > 2 and mask.shape[0] > 1 else mask
    return _batch_heads_layout(mask)


def _attendable_keys_and_queries(
    mask: Tensor | None,
    causal: bool,
    real_queries: Tensor | None,
    sequences: int,
    num_queries: int,
    num_keys: int,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """(S, m) keys some real query may attend and (S, n) real queries with some attendable key; ``None`` =
    all, for no mask or one logit row for all queries (key padding).

    From O(n + m) per head: at long context an n × m pattern would be a large part of the memory the
    blockwise measurement avoids.
    """
    if mask is None:
        open_keys = torch.ones((sequences, 1, num_keys), dtype=torch.bool, device=device)
    else:
        open_keys = ~torch.isneginf(mask[:, :, 0]).expand(sequences, -1, num_keys)
    queries = torch.ones((sequences, num_queries), dtype=torch.bool, device=device)
    if real_queries is not None:
        queries = queries & real_queries
    if not causal:
        has_key = open_keys.any(dim=2).any(dim=1, keepdim=True)
        return open_keys.any(dim=1) & queries.any(dim=1, keepdim=True), queries & has_key
    # Query i attends open keys j <= i: query i is measured if i >= the first open key, and key j if open
    # and j <= the last measured query.
    first_open = torch.where(open_keys.any(dim=2), open_keys.to(torch.int8).argmax(dim=2), num_queries)
    queries = queries & (torch.arange(num_queries, device=device) >= first_open[:, :, None]).any(dim=1)
    positions = torch.arange(num_queries, device=device)
    last_query = torch.where(queries, positions, -1).amax(dim=1, keepdim=True)
    keys = open_keys.any(dim=1) & (torch.arange(num_keys, device=device) <= last_query)
    return keys, queries


def _conjunction(mask: Tensor | None, other: Tensor) -> Tensor:
    return other.clone() if mask is None else mask & other


def _copy(tensor: Tensor) -> Tensor:
    """A detached copy with its own storage, so nothing of the batch's activations stays alive."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)
