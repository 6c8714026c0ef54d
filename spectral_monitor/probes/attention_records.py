"""What an attention capture records, and how a kernel call's inputs become that record.

:class:`AttentionInputs` is one attention computation in ``F.scaled_dot_product_attention``'s terms (what the
kernel interception and the user's extractors produce);
:func:`~spectral_monitor.probes.attention_sampling.captured_attention` turns it into a
:class:`CapturedAttention`, detached copies of the sampled sequences' q and k with their masks, from which
:class:`AttentionSample` probabilities or blockwise metrics are computed on demand. An
:class:`AttentionRecording` holds one armed forward's captures and what was skipped, and
:func:`fit_to_budget` cuts it to a memory budget. Nothing here hooks a model:
:mod:`spectral_monitor.probes.attention` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from spectral_monitor.metrics import KrylovState, attention_metrics_from_qk, max_attention_logit
from spectral_monitor.metrics.long_context import DEFAULT_MAX_BYTES, KRYLOV_COLUMNS
from spectral_monitor.metrics.masks import attendable_pattern

__all__ = [
    "BLOCKWISE_MIN_TOKENS",
    "DENSE_CALL_NBYTES",
    "ROOT_LAYER_NAME",
    "AttentionInputs",
    "AttentionRecording",
    "AttentionSample",
    "CapturedAttention",
    "LogitSoftcap",
    "LogitTransform",
    "SkippedCapture",
    "dense_working_nbytes",
    "fit_to_budget",
]

BLOCKWISE_MIN_TOKENS = 4096
"""From this many queries or keys on, a layer's metrics are computed blockwise from q and k even where its
probabilities would fit the budget: the dense path's extras (figures, head diversity) factorise whole
matrices, whose O(n³) cost dominates a logging step from this size on."""

PROBABILITY_BLOCK_BYTES = 2**20
"""Bytes of the rows of probabilities formed at a time (:meth:`CapturedAttention.probs`)."""
EXACT_WORKING_COPIES = 7.5
"""Memory ``attention_metrics``' exact path takes per matrix beyond its input, in units of the matrix's
float32 size: the float64 Gram matrix and its ``eigvalsh`` copy, the ``eigvals`` workspace, the exact
Dobrushin distances, the masked copy. An upper bound of the peak resident set measured on softmax matrices,
masked and unmasked (benchmarks/README.md, "Memory of the dense attention measurement")."""
KRYLOV_WORKING_COPIES = 1.25
"""The same for the Krylov path on unmasked matrices (its one-pass temporaries are cache-sized blocks),
besides its Krylov vectors (``KRYLOV_COLUMNS``)."""
KRYLOV_MASKED_WORKING_COPIES = 2.5
"""The same with key or query masks, which make the masked copy of the batch and its attendable pattern."""
DENSE_CALL_NBYTES = 4 * 2**20
"""Memory of one dense ``attention_metrics`` call that does not grow with its batch (LAPACK workspaces of
small matrices, cache-sized scratch, the probability blocks being formed): an upper bound of the measured
peaks less their per-matrix parts."""

ROOT_LAYER_NAME = "model"
"""The layer name reported for attention computed by the captured model's own (root) forward."""


@dataclass(frozen=True)
class LogitSoftcap:
    """Logit softcapping, ``cap · tanh(logits / cap)`` (Gemma 2's ``attn_logit_softcapping``): every logit
    is squashed into (−cap, cap) before the mask is added. Applied in place; returns its input.

    Attributes:
        cap: the bound of the squashed logits.

    Raises:
        ValueError: if ``cap`` is not a positive finite number.

    Examples:
        >>> import torch
        >>> from spectral_monitor.probes import LogitSoftcap
        >>> LogitSoftcap(50.0)(torch.tensor([0.0, 50.0, 1e4]))
        tensor([ 0.0000, 38.0797, 50.0000])
    """

    cap: float

    def __post_init__(self) -> None:
        cap = self.cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"cap must be a positive finite number, got {self.cap!r}")

    def __call__(self, logits: Tensor) -> Tensor:
        return logits.div_(self.cap).tanh_().mul_(self.cap)


LogitTransform = Callable[[Tensor], Tensor]
"""An elementwise function of the scaled attention logits, applied before the mask and the softmax."""


@dataclass
class AttentionInputs:
    """What an attention computation consumes, in ``F.scaled_dot_product_attention``'s conventions.

    The probabilities, and the largest logit, are those of softmax(transform(scale · q kᵀ) + mask). Tensors
    may be views of the batch: the capture keeps copies of the sampled sequences only.

    Attributes:
        q: (B, H, n, d) queries.
        k: (B, H_k, m, d) keys, H a multiple of H_k (grouped-query attention: query head h reads key head
            h // (H / H_k)).
        mask: bool (True = may attend) or additive float (``-inf`` or the dtype's lowest value = may not
            attend, finite values are logit biases), broadcastable to (B, H, n, m); ``None`` = none.
        causal: query i attends keys j <= i (top-left aligned, as SDPA's ``is_causal``); a mask whose
            attendable keys are lower-triangular is causal without it.
        scale: multiplies q·k; ``None`` means 1/sqrt(d).
        query_mask: (B, n) bool, True = a real query (not padding); ``None`` = the real tokens the forward's
            padding masks give for n queries (:mod:`spectral_monitor.probes.token_masks`).
        logit_transform: an elementwise function the model applies to the scaled logits scale · q kᵀ before
            the mask is added and the softmax taken (Gemma 2's softcapping: :class:`LogitSoftcap`); it may
            work in place and returns the transformed logits.

    Examples:
        An extractor returns them; :func:`~spectral_monitor.probes.attention_sampling.captured_attention`
        keeps the sampled sequences:

        >>> import torch
        >>> from spectral_monitor.probes.attention_sampling import captured_attention
        >>> from spectral_monitor.probes.token_masks import ForwardTokenMasks
        >>> inputs = AttentionInputs(torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8), causal=True)
        >>> captured_attention("attn", inputs, 2, ForwardTokenMasks()).q.shape
        torch.Size([2, 2, 5, 8])
    """

    q: Tensor
    k: Tensor
    mask: Tensor | None = None
    causal: bool = False
    scale: float | None = None
    query_mask: Tensor | None = None
    logit_transform: LogitTransform | None = None


@dataclass
class AttentionSample:
    """The attention probabilities of one layer for the sampled sequences, ready for the metrics.

    Attributes:
        layer: the attention module's qualified name (``ROOT_LAYER_NAME`` for the model's own forward).
        probs: (S, H, n, m) float32, rows sum to 1 over attendable keys (rows with none are 0).
        key_mask: (S, m) bool, True = the key is attendable by at least one query; ``None`` = all are.
        query_mask: (S, n) bool, True = a real query (not padding, has an attendable key); ``None`` = all
            are.
        causal: query i attends keys j <= i.
        scale: what multiplied q·k.
        attendable: bool (S, H or 1, n, m), True where a query may attend a key; ``None`` = as ``causal``
            says (every key, or keys j <= i).
        max_logit: (S, H), the largest logit over real queries x attendable keys
            (:func:`~spectral_monitor.metrics.max_attention_logit`); ``None`` = not taken.

    Examples:
        >>> import torch
        >>> q = k = torch.randn(2, 3, 4, 8)  # (sequences, heads, tokens, head width)
        >>> captured = CapturedAttention("attn", q, k, None, causal=True, scale=8**-0.5, key_mask=None,
        ...                              query_mask=None)
        >>> sample = captured.sample()
        >>> sample.probs.shape, bool(torch.allclose(sample.probs.sum(-1), torch.ones(2, 3, 4)))
        (torch.Size([2, 3, 4, 4]), True)
    """

    layer: str
    probs: Tensor
    key_mask: Tensor | None
    query_mask: Tensor | None
    causal: bool
    scale: float
    attendable: Tensor | None = None
    max_logit: Tensor | None = None


@dataclass
class CapturedAttention:
    """The attention-kernel inputs of one layer for the sampled sequences (detached copies).

    Attributes:
        layer: the attention module's qualified name, as in :class:`AttentionSample`.
        q: (S, H, n, d) in the forward's dtype.
        k: (S, H, m, d) in the forward's dtype, grouped keys already repeated per query head.
        mask: additive float32 logit bias broadcastable to (S, H, n, m), ``-inf`` where a key may not be
            attended; ``None`` = none. The causal pattern is not in it but in ``causal``, so a long-context
            path can apply it blockwise without materialising n x m.
        causal: query i attends keys j <= i.
        scale: multiplies q·k.
        key_mask: as in :class:`AttentionSample`.
        query_mask: as in :class:`AttentionSample`.
        logit_transform: as in :class:`AttentionInputs`: applied to scale · q kᵀ before the mask.

    Examples:
        >>> import torch
        >>> q = k = torch.randn(2, 3, 4, 8)  # (sequences, heads, tokens, head width)
        >>> captured = CapturedAttention("attn", q, k, None, causal=True, scale=8**-0.5, key_mask=None,
        ...                              query_mask=None)
        >>> captured.num_sequences, captured.num_heads, captured.probs()[0, 0, 0].tolist()
        (2, 3, [1.0, 0.0, 0.0, 0.0])
        >>> [part.num_heads for part in captured.chunks(2)]
        [2, 1, 2, 1]
    """

    layer: str
    q: Tensor
    k: Tensor
    mask: Tensor | None
    causal: bool
    scale: float
    key_mask: Tensor | None
    query_mask: Tensor | None
    logit_transform: LogitTransform | None = None

    @property
    def num_sequences(self) -> int:
        """S, the sequences captured."""
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        """H, the query heads."""
        return self.q.shape[1]

    def logits(self, out: Tensor | None = None) -> Tensor:
        """The logits the softmax reads: transform(scale · q kᵀ) + mask, with the causal pattern applied.

        Args:
            out: A float32 (S, H, n, m) tensor to write them into.

        Returns:
            The logits, (S, H, n, m) float32 (``out`` where given).
        """
        logits = torch.matmul(self.q.float(), self.k.float().transpose(-1, -2), out=out).mul_(self.scale)
        if self.logit_transform is not None:
            transformed = self.logit_transform(logits)
            logits = transformed if transformed is logits else logits.copy_(transformed)
        if self.mask is not None:
            logits.add_(self.mask)
        if self.causal:
            for start, stop in self._row_blocks(logits):
                rows = torch.arange(start, stop, device=logits.device)[:, None]
                later_keys = torch.arange(logits.shape[-1], device=logits.device) > rows
                logits[..., start:stop, :].masked_fill_(later_keys, -math.inf)
        return logits

    def probs(self, out: Tensor | None = None) -> Tensor:
        """The attention probabilities softmax(logits) before dropout: (S, H, n, m) float32, into ``out`` (a
        float32 tensor of that shape) if given.

        Formed in place over the logits a block of rows at a time, so forming them takes their own size
        and a block's (``PROBABILITY_BLOCK_BYTES``) rather than three times their size.

        Args:
            out: A float32 (S, H, n, m) tensor to write them into.

        Returns:
            The probabilities; a row without an attendable key is 0.
        """
        return self._softmax_in_place(self.logits(out))

    def _softmax_in_place(self, logits: Tensor) -> Tensor:
        for start, stop in self._row_blocks(logits):
            rows = logits[..., start:stop, :]
            no_attendable_key = torch.isneginf(rows.amax(dim=-1, keepdim=True))
            rows.copy_(torch.softmax(rows, dim=-1).masked_fill_(no_attendable_key, 0.0))
        return logits

    @staticmethod
    def _row_blocks(matrices: Tensor) -> Iterator[tuple[int, int]]:
        rows, row_bytes = matrices.shape[-2], matrices[..., :1, :].numel() * matrices.element_size()
        per_block = max(1, PROBABILITY_BLOCK_BYTES // max(row_bytes, 1))
        return ((start, min(start + per_block, rows)) for start in range(0, rows, per_block))

    def sample(self, out: Tensor | None = None) -> AttentionSample:
        """The probabilities with their masks and the largest logit of each head, computed now.

        Args:
            out: As :meth:`probs`'s (the largest logits are read before the logits become probabilities).

        Returns:
            The sample the metrics read.
        """
        logits = self.logits(out)
        max_logit = max_attention_logit(
            logits,
            key_mask=None if self.key_mask is None else self.key_mask[:, None, :],
            query_mask=None if self.query_mask is None else self.query_mask[:, None, :],
        )
        probs = self._softmax_in_place(logits)
        attendable = None
        if self.mask is not None:
            attendable = attendable_pattern(self.mask, self.causal, probs.shape)
            attendable = attendable.expand(probs.shape[0], *attendable.shape[1:])
        return AttentionSample(
            self.layer, probs, self.key_mask, self.query_mask, self.causal, self.scale, attendable, max_logit
        )

    def held_nbytes(self) -> int:
        """The memory this capture holds.

        Returns:
            Bytes of q, k and the masks (no probabilities).
        """
        tensors = (self.q, self.k, self.mask, self.key_mask, self.query_mask)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)

    def dense_matrix_nbytes(self, exact: bool) -> int:
        """Most memory measuring one (n, m) matrix densely takes, by :func:`dense_working_nbytes`.

        Args:
            exact: On the exact path (else the Krylov path).

        Returns:
            Bytes.
        """
        return dense_working_nbytes(self.q.shape[2], self.k.shape[2], exact, self._masked())

    def matrices_per_chunk(self, max_bytes: int, exact: bool) -> int:
        """How many of this layer's matrices (sequences × heads) may be measured densely at once.

        Args:
            max_bytes: The memory budget.
            exact: On the exact path (else the Krylov path).

        Returns:
            The count; 0 when not even one fits, and the layer is then measured blockwise from q and k.
        """
        room = max_bytes - DENSE_CALL_NBYTES
        return max(0, min(self.num_sequences * self.num_heads, room // self.dense_matrix_nbytes(exact)))

    def chunks(self, matrices: int) -> Iterator[CapturedAttention]:
        """This capture in consecutive parts.

        Args:
            matrices: The most matrices of a part.

        Yields:
            Parts of whole sequences, or of heads of one sequence: views of this capture in the order of its
            flattened (sequences × heads) batch.
        """
        heads = self.num_heads
        if matrices >= heads:
            step = matrices // heads
            for first in range(0, self.num_sequences, step):
                yield self._part(slice(first, first + step), slice(None))
            return
        for sequence in range(self.num_sequences):
            for first in range(0, heads, matrices):
                yield self._part(slice(sequence, sequence + 1), slice(first, first + matrices))

    def _part(self, sequences: slice, heads: slice) -> CapturedAttention:
        def cut(tensor: Tensor | None, head_dim: bool) -> Tensor | None:
            if tensor is None:
                return None
            if tensor.shape[0] > 1:
                tensor = tensor[sequences]
            if head_dim and tensor.shape[1] > 1:
                tensor = tensor[:, heads]
            return tensor

        return replace(
            self,
            q=cut(self.q, True),
            k=cut(self.k, True),
            mask=cut(self.mask, True),
            key_mask=cut(self.key_mask, False),
            query_mask=cut(self.query_mask, False),
        )

    def _masked(self) -> bool:
        return self.mask is not None or self.key_mask is not None or self.query_mask is not None

    def probs_nbytes(self, sequences: int | None = None, heads: int | None = None) -> int:
        """Bytes of the float32 probabilities of the first sequences and heads, were they formed.

        Args:
            sequences: How many sequences; None: all.
            heads: How many heads; None: all.

        Returns:
            Bytes.
        """
        sequences = self.num_sequences if sequences is None else min(sequences, self.num_sequences)
        heads = self.num_heads if heads is None else min(heads, self.num_heads)
        return sequences * heads * 4 * self.q.shape[2] * self.k.shape[2]

    def measured_blockwise(
        self, max_bytes: int | None = None, sequences: int | None = None, heads: int | None = None
    ) -> bool:
        """Whether the metrics come from q and k in blocks (:meth:`blockwise_metrics`), never forming the
        probabilities: from ``BLOCKWISE_MIN_TOKENS`` queries or keys on, or where the float32 probabilities of
        ``sequences`` x ``heads`` would exceed ``max_bytes``.

        Args:
            max_bytes: The memory budget; None: no budget.
            sequences: How many sequences; None: all.
            heads: How many heads; None: all.

        Returns:
            Whether the layer is measured blockwise.
        """
        long = max(self.q.shape[2], self.k.shape[2]) >= BLOCKWISE_MIN_TOKENS
        return long or (max_bytes is not None and self.probs_nbytes(sequences, heads) > max_bytes)

    def blockwise_metrics(
        self,
        *,
        method: str = "auto",
        max_bytes: int = DEFAULT_MAX_BYTES,
        include_rank_sums: bool = True,
        state: KrylovState | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """:func:`~spectral_monitor.metrics.attention_metrics_from_qk` of every sequence and head: (S, H)
        values, computed without forming the probabilities.

        Args:
            method: As :func:`~spectral_monitor.metrics.attention_metrics_from_qk` takes it.
            max_bytes: Its working memory.
            include_rank_sums: Also the effective and threshold ranks.
            state: Krylov warm starts, carried from one call to the next.
            generator: The source of random start vectors.

        Returns:
            Each metric's name → its (S, H) values.
        """
        return attention_metrics_from_qk(
            self.q,
            self.k,
            scale=self.scale,
            bias=self.mask,
            key_mask=None if self.key_mask is None else self.key_mask[:, None, :],
            query_mask=None if self.query_mask is None else self.query_mask[:, None, :],
            causal=self.causal,
            logit_transform=self.logit_transform,
            method=method,
            include_rank_sums=include_rank_sums,
            max_bytes=max_bytes,
            state=state,
            generator=generator,
        )

    def nbytes(
        self, sequences: int | None = None, heads: int | None = None, max_bytes: int | None = None
    ) -> int:
        """Bytes held by this capture cut to ``sequences`` x ``heads``, plus the float32 probs it implies
        unless it is measured blockwise under ``max_bytes`` (:meth:`measured_blockwise`).

        Args:
            sequences: How many sequences; None: all.
            heads: How many heads; None: all.
            max_bytes: The memory budget that decides the blockwise path; None: none.

        Returns:
            Bytes.
        """
        sequences = self.num_sequences if sequences is None else min(sequences, self.num_sequences)
        heads = self.num_heads if heads is None else min(heads, self.num_heads)
        n, m = self.q.shape[2], self.k.shape[2]
        per_sequence_head = (
            self.q[0, 0].numel() * self.q.element_size() + self.k[0, 0].numel() * self.k.element_size()
        )
        total = sequences * heads * per_sequence_head
        if not self.measured_blockwise(max_bytes, sequences, heads):
            total += self.probs_nbytes(sequences, heads)
        if self.mask is not None:
            total += (
                min(self.mask.shape[0], sequences)
                * min(self.mask.shape[1], heads)
                * self.mask.shape[2]
                * self.mask.shape[3]
                * self.mask.element_size()
            )
        total += sequences * (n + m)  # the bool key and query masks, at most
        return total

    def first(self, sequences: int, heads: int) -> CapturedAttention:
        """A copy cut to the first sequences and heads.

        Args:
            sequences: How many sequences to keep.
            heads: How many heads to keep.

        Returns:
            The copy, in fresh storage (not views).
        """
        return self.selected(sequences, range(min(heads, self.num_heads)))

    def selected(self, sequences: int, heads: Sequence[int]) -> CapturedAttention:
        """A copy cut to the first sequences and the chosen heads.

        Args:
            sequences: How many sequences to keep.
            heads: The numbers of the heads kept, in the order kept.

        Returns:
            The copy, in fresh storage (not views).
        """
        index = torch.as_tensor(list(heads), dtype=torch.long, device=self.q.device)

        def cut(tensor: Tensor | None, head_dim: bool) -> Tensor | None:
            if tensor is None:
                return None
            tensor = tensor[:sequences]
            if head_dim and tensor.shape[1] > 1:  # a mask may be shared by the heads (size 1)
                return tensor.index_select(1, index.to(tensor.device))
            return tensor.clone()

        return replace(
            self,
            q=cut(self.q, True),
            k=cut(self.k, True),
            mask=cut(self.mask, True),
            key_mask=cut(self.key_mask, False),
            query_mask=cut(self.query_mask, False),
        )


@dataclass(frozen=True)
class SkippedCapture:
    """A layer (or ``"*"`` for the whole forward) whose attention was not captured or was cut, and why.

    Attributes:
        layer: the attention module's qualified name, or ``"*"``.
        reason: why, in words a user can act on.

    Examples:
        >>> SkippedCapture("blocks.3.attn", "block no longer in the model; its series stop").layer
        'blocks.3.attn'
    """

    layer: str
    reason: str


@dataclass
class AttentionRecording:
    """What one armed forward captured, in call order; filled during the forward, final on disarm.

    Attributes:
        captured: the layers captured, in call order.
        skipped: the layers not captured, or cut to the memory budget, each with why.

    Examples:
        >>> import torch
        >>> q = k = torch.randn(2, 3, 4, 8)  # (sequences, heads, tokens, head width)
        >>> captured = CapturedAttention("attn", q, k, None, causal=True, scale=8**-0.5, key_mask=None,
        ...                              query_mask=None)
        >>> recording = AttentionRecording([captured])
        >>> recording.nbytes() == captured.held_nbytes() + captured.probs_nbytes() + 2 * (4 + 4)
        True
    """

    captured: list[CapturedAttention] = field(default_factory=list)
    skipped: list[SkippedCapture] = field(default_factory=list)

    def samples(self) -> list[AttentionSample]:
        """The attention probabilities of every captured layer, computed now.

        Returns:
            One float32 :class:`AttentionSample` per capture.
        """
        return [capture.sample() for capture in self.captured]

    def nbytes(self, max_bytes: int | None = None) -> int:
        """Bytes held by the captures plus the float32 probabilities of those measured densely under
        ``max_bytes`` (:meth:`CapturedAttention.measured_blockwise`).

        Args:
            max_bytes: The memory budget that decides the blockwise path; None: none.

        Returns:
            Bytes.
        """
        return sum(capture.nbytes(max_bytes=max_bytes) for capture in self.captured)


def fit_to_budget(recording: AttentionRecording, max_bytes: int) -> None:
    """Cuts sequences, then heads, then trailing layers until the recording fits ``max_bytes``.

    Args:
        recording: cut in place; each cut is listed in its ``skipped``.
        max_bytes: the budget, as :meth:`AttentionRecording.nbytes` counts.

    Examples:
        >>> import torch
        >>> q = k = torch.randn(2, 3, 4, 8)  # (sequences, heads, tokens, head width)
        >>> captured = CapturedAttention("attn", q, k, None, causal=True, scale=8**-0.5, key_mask=None,
        ...                              query_mask=None)
        >>> recording = AttentionRecording([captured])
        >>> fit_to_budget(recording, max_bytes=1000)
        >>> recording.captured[0].num_sequences, recording.skipped[0].reason
        (1, 'memory budget of 1000 bytes: kept 1 of 2 sequences and 3 of 3 heads')
    """
    captured = recording.captured
    if not captured or recording.nbytes(max_bytes) <= max_bytes:
        return

    def total(layers: list[CapturedAttention], sequences: int, heads: int) -> int:
        return sum(layer.nbytes(sequences, heads, max_bytes) for layer in layers)

    most_sequences = max(layer.num_sequences for layer in captured)
    most_heads = max(layer.num_heads for layer in captured)
    kept_layers = len(captured)
    sequences, heads = 1, 1
    fitting_sequences = [
        s for s in range(most_sequences, 0, -1) if total(captured, s, most_heads) <= max_bytes
    ]
    if fitting_sequences:
        sequences, heads = fitting_sequences[0], most_heads
    else:
        fitting_heads = [h for h in range(most_heads, 0, -1) if total(captured, 1, h) <= max_bytes]
        if fitting_heads:
            heads = fitting_heads[0]
        else:
            while kept_layers and total(captured[:kept_layers], 1, 1) > max_bytes:
                kept_layers -= 1

    budget = f"memory budget of {max_bytes} bytes"
    kept = []
    for layer in captured[:kept_layers]:
        cut = layer.first(sequences, heads)
        if cut.num_sequences < layer.num_sequences or cut.num_heads < layer.num_heads:
            recording.skipped.append(
                SkippedCapture(
                    layer.layer,
                    f"{budget}: kept {cut.num_sequences} of {layer.num_sequences} sequences and "
                    f"{cut.num_heads} of {layer.num_heads} heads",
                )
            )
        kept.append(cut)
    for layer in captured[kept_layers:]:
        recording.skipped.append(
            SkippedCapture(
                layer.layer,
                f"{budget}: not kept (one sequence and head need {layer.nbytes(1, 1, max_bytes)})",
            )
        )
    recording.captured[:] = kept


def dense_working_nbytes(queries: int, keys: int, exact: bool, masked: bool) -> int:
    """Most memory the dense measurement of one (``queries``, ``keys``) attention matrix takes: its float32
    probabilities with their attendable pattern, and ``attention_metrics``' working memory on the exact or the
    Krylov path (``EXACT_WORKING_COPIES``, ``KRYLOV_WORKING_COPIES``, ``KRYLOV_MASKED_WORKING_COPIES``);
    ``DENSE_CALL_NBYTES`` comes once per call on top.

    Args:
        queries: the matrix's rows n.
        keys: the matrix's columns m.
        exact: measured on the exact path (else the Krylov path).
        masked: with key or query masks or an attendable pattern.

    Returns:
        Bytes.

    Examples:
        >>> dense_working_nbytes(64, 64, exact=True, masked=False) // (4 * 64 * 64)  # 1 + 7.5 copies
        8
    """
    matrix = 4 * queries * keys
    held = matrix * (1.25 if masked else 1.0)
    if exact:
        return int(held + EXACT_WORKING_COPIES * matrix)
    copies = KRYLOV_MASKED_WORKING_COPIES if masked else KRYLOV_WORKING_COPIES
    return int(held + copies * matrix + 8 * KRYLOV_COLUMNS * max(queries, keys))
