"""Capture of attention-kernel inputs on logging steps, and the attention probabilities they imply.

The training forward is never changed: no ``need_weights=True``, no patched ``nn.Module``. While a capture is
armed, and only then, these are installed:

- a :class:`torch.overrides.TorchFunctionMode` that sees the *outermost* attention-kernel call of every
  module, ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` and everything built on it) or
  ``F.scaled_dot_product_attention`` (Hugging Face ``sdpa`` attention, nanoGPT-style code, also when the
  function was imported by name). It lets the kernel run untouched, then projects q and k for the first
  ``max_sequences`` sequences from the very arguments the kernel received (after ``batch_first``
  transposition and mask canonicalisation), so no layout or mask convention has to be re-derived from a
  module's public signature. One interception point serves both kernels, which a forward pre-hook on
  ``nn.MultiheadAttention`` could not: SDPA is a function, not a module.
- for Hugging Face ``eager`` attention, which runs through no kernel, a wrapper around the modeling file's
  attention function that reports its inputs in SDPA's terms (:mod:`spectral_monitor.probes.huggingface`);
- forward pre/post hooks on every submodule that keep a stack of qualified module names, so each kernel
  call is attributed to the innermost module that made it (``encoder.layers.0.self_attn``), and forward
  hooks that run the user's registered extractors for attention computed by hand.

Everything is removed on disarm. The kernel's arguments are read, never modified; the extra work runs under
``torch.no_grad``, consumes no random numbers and keeps detached copies of the sampled sequences only
(never views of the batch's activations). In train mode the forward is bit-identical with the capture armed.

Caveat: an active TorchFunctionMode disables the fused inference fast path of ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` (eval mode under ``no_grad``), which changes their outputs at rounding level.
Capture is meant for training-step forwards; when a forward could take that fast path the kernel capture is
not installed and the recording says why, so a user's evaluation is never altered.

When a module runs several times in one armed forward (a reused module, activation-checkpointing
recomputation) only its first call is kept. Layers are named without wrapper segments (DDP, FSDP,
torch.compile, checkpoint_wrapper: :mod:`spectral_monitor.probes.wrappers`), and no hook is placed on a
module inside a torch.compile graph (a new hook there forces a recompilation) unless
``arm(every_module=True)`` says the forward runs with compilation off. A hook or mode traced into a
compiled graph all the same (a model the monitor was given uncompiled, run through a compiled wrapper)
returns at once: Dynamo traces the check as a constant, so it adds nothing to the graph and breaks nothing.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from spectral_monitor.metrics import KrylovState, attention_metrics_from_qk, max_attention_logit
from spectral_monitor.metrics.long_context import DEFAULT_MAX_BYTES, KRYLOV_COLUMNS
from spectral_monitor.metrics.masks import (
    additive_mask,
    attendable_pattern,
    is_causal_pattern,
)
from spectral_monitor.probes.huggingface import observe_eager_attention
from spectral_monitor.probes.token_masks import ForwardTokenMasks, checked_token_mask
from spectral_monitor.probes.wrappers import eager_named_modules, unwrapped_named_modules

__all__ = [
    "BLOCKWISE_MIN_TOKENS",
    "ROOT_LAYER_NAME",
    "AttentionCapture",
    "AttentionExtractor",
    "AttentionInputs",
    "AttentionRecording",
    "AttentionSample",
    "CapturedAttention",
    "LogitSoftcap",
    "LogitTransform",
    "SkippedCapture",
    "dense_working_nbytes",
    "register_attention_extractor",
]

BLOCKWISE_MIN_TOKENS = 4096
"""From this many queries or keys on, a layer's metrics are computed blockwise from q and k even where its
probabilities would fit the budget: the dense path's extras (figures, head diversity) factorise whole
matrices, about a minute for one 4096² ``svdvals`` on a CPU core."""

PROBABILITY_BLOCK_BYTES = 2**20
"""Bytes of the rows of probabilities formed at a time (:meth:`CapturedAttention.probs`)."""
EXACT_WORKING_COPIES = 7.5
"""Memory ``attention_metrics``' exact path takes per matrix beyond its input, in units of the matrix's
float32 size: the float64 Gram matrix and its ``eigvalsh`` copy, the ``eigvals`` workspace, the exact
Dobrushin distances, the masked copy. Measured from the peak resident set (every buffer mapped on its own)
on 1 and 2 softmax matrices at n = 512, 1024 and 2048: 6.1–6.5 unmasked, 7.1–7.3 masked (9.3 for one matrix
at n = 512, where the fixed part, ``DENSE_CALL_NBYTES``, is most of it)."""
KRYLOV_WORKING_COPIES = 1.25
"""The same for the Krylov path on unmasked matrices (its one-pass temporaries are cache-sized blocks):
0.16–1.14 at n = 1024 and 2048 (the most on one near-uniform matrix at 2048), besides its Krylov
vectors (``KRYLOV_COLUMNS``)."""
KRYLOV_MASKED_WORKING_COPIES = 2.5
"""The same with key or query masks, which make the masked copy of the batch and its attendable pattern:
2.0–3.0 at n = 512 to 2048."""
DENSE_CALL_NBYTES = 4 * 2**20
"""Memory of one dense ``attention_metrics`` call that does not grow with its batch (LAPACK workspaces of
small matrices, cache-sized scratch, the probability blocks being formed): the measurements above less the
per-matrix parts came to at most 3 MiB."""

ROOT_LAYER_NAME = "model"
"""The layer name reported for attention computed by the captured model's own (root) forward."""

_MULTI_HEAD_ATTENTION_FORWARD = F.multi_head_attention_forward
_SCALED_DOT_PRODUCT_ATTENTION = F.scaled_dot_product_attention
_MULTI_HEAD_ATTENTION_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@dataclass(frozen=True)
class LogitSoftcap:
    """Logit softcapping, ``cap · tanh(logits / cap)`` (Gemma 2's ``attn_logit_softcapping``): every logit
    is squashed into (−cap, cap) before the mask is added. Applied in place; returns its input.

    Example::

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

    ``q``: (B, H, n, d); ``k``: (B, H_k, m, d) with H a multiple of H_k (grouped-query attention: query head
    h reads key head h // (H / H_k)). ``mask``: bool (True = may attend) or additive float (``-inf`` or the
    dtype's lowest value = may not attend, finite values are logit biases), broadcastable to (B, H, n, m).
    ``causal``: query i attends keys j <= i (top-left aligned, as SDPA's ``is_causal``); a mask whose
    attendable keys are lower-triangular is causal without it. ``scale``: multiplies q·k; ``None`` means
    1/sqrt(d). ``query_mask``: (B, n) bool, True = a real query (not padding); ``None`` = the real tokens
    the forward's padding masks give for n queries (:mod:`spectral_monitor.probes.token_masks`).
    ``logit_transform``: an elementwise function the model applies to the scaled logits scale · q kᵀ before
    the mask is added and the softmax taken (Gemma 2's softcapping: :class:`LogitSoftcap`); it may work in
    place and returns the transformed logits. The probabilities, and ``max_logit``, are then those of
    softmax(transform(scale · q kᵀ) + mask). Tensors may be views of the batch: the capture keeps copies of
    the sampled sequences only.
    """

    q: Tensor
    k: Tensor
    mask: Tensor | None = None
    causal: bool = False
    scale: float | None = None
    query_mask: Tensor | None = None
    logit_transform: LogitTransform | None = None


AttentionExtractor = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], AttentionInputs | None]
"""``extractor(module, args, kwargs, output)`` -> the attention inputs of that call, or ``None`` to skip it.

Runs as a forward hook of the module on armed forwards only, under ``torch.no_grad``.
"""


@dataclass
class AttentionSample:
    """The attention probabilities of one layer for the sampled sequences, ready for the metrics.

    ``probs``: (S, H, n, m) float32, rows sum to 1 over attendable keys (rows with none are 0).
    ``key_mask``: (S, m) bool, True = the key is attendable by at least one query; ``None`` = all are.
    ``query_mask``: (S, n) bool, True = a real query (not padding, has an attendable key); ``None`` = all are.
    ``attendable``: bool (S, H or 1, n, m), True where a query may attend a key; ``None`` = as
    ``causal`` says (every key, or keys j <= i). ``max_logit``: (S, H), the largest logit over real queries x
    attendable keys (:func:`~spectral_monitor.metrics.max_attention_logit`); ``None`` = not taken.
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

    ``q``: (S, H, n, d) and ``k``: (S, H, m, d) in the forward's dtype, grouped keys already repeated per
    query head. ``mask``: additive float32 logit bias broadcastable to (S, H, n, m), ``-inf`` where a key may
    not be attended; the causal pattern is not in it but in ``causal`` (query i attends keys j <= i), so a
    long-context path can apply it blockwise without materialising n x m. ``scale`` multiplies q·k.
    ``key_mask`` and ``query_mask`` as in :class:`AttentionSample`. ``logit_transform`` as in
    :class:`AttentionInputs`: applied to scale · q kᵀ before the mask.
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
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    def logits(self, out: Tensor | None = None) -> Tensor:
        """transform(scale · q kᵀ) + mask, with the causal pattern applied: (S, H, n, m) float32 (into
        ``out``)."""
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
        and a block's (``PROBABILITY_BLOCK_BYTES``) rather than three times their size."""
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
        """The probabilities with their masks and the largest logit of each head, computed now (into ``out``
        if given, as :meth:`probs`: the largest logits are read before the logits become probabilities)."""
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
        """Bytes this capture holds: q, k and the masks (no probabilities)."""
        tensors = (self.q, self.k, self.mask, self.key_mask, self.query_mask)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)

    def dense_matrix_nbytes(self, exact: bool) -> int:
        """Most memory measuring one (n, m) matrix densely takes, by :func:`dense_working_nbytes`."""
        return dense_working_nbytes(self.q.shape[2], self.k.shape[2], exact, self._masked())

    def matrices_per_chunk(self, max_bytes: int, exact: bool) -> int:
        """How many of this layer's matrices (sequences × heads) may be measured densely at once within
        ``max_bytes`` (0: not even one; the layer is then measured blockwise from q and k)."""
        room = max_bytes - DENSE_CALL_NBYTES
        return max(0, min(self.num_sequences * self.num_heads, room // self.dense_matrix_nbytes(exact)))

    def chunks(self, matrices: int) -> Iterator[CapturedAttention]:
        """This capture in consecutive parts of at most ``matrices`` matrices (whole sequences, or heads of
        one sequence), views of it in the order of its flattened (sequences × heads) batch."""
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
        """Bytes of the float32 probabilities of the first ``sequences`` x ``heads``, were they formed."""
        sequences = self.num_sequences if sequences is None else min(sequences, self.num_sequences)
        heads = self.num_heads if heads is None else min(heads, self.num_heads)
        return sequences * heads * 4 * self.q.shape[2] * self.k.shape[2]

    def measured_blockwise(
        self, max_bytes: int | None = None, sequences: int | None = None, heads: int | None = None
    ) -> bool:
        """Whether the metrics come from q and k in blocks (:meth:`blockwise_metrics`), never forming the
        probabilities: from ``BLOCKWISE_MIN_TOKENS`` queries or keys on, or where the float32 probabilities of
        ``sequences`` x ``heads`` would exceed ``max_bytes``."""
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
        values, computed within ``max_bytes`` of working memory without forming the probabilities."""
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
        unless it is measured blockwise under ``max_bytes`` (:meth:`measured_blockwise`)."""
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
        """A copy cut to the first ``sequences`` sequences and ``heads`` heads (fresh storage, not views)."""

        def cut(tensor: Tensor | None, head_dim: bool) -> Tensor | None:
            if tensor is None:
                return None
            tensor = tensor[:sequences]
            if head_dim:
                tensor = tensor[:, :heads]
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
    """A layer (or ``"*"`` for the whole forward) whose attention was not captured or was cut, and why."""

    layer: str
    reason: str


@dataclass
class AttentionRecording:
    """What one armed forward captured, in call order; filled during the forward, final on disarm."""

    captured: list[CapturedAttention] = field(default_factory=list)
    skipped: list[SkippedCapture] = field(default_factory=list)

    def samples(self) -> list[AttentionSample]:
        """The attention probabilities of every captured layer, computed now (float32)."""
        return [capture.sample() for capture in self.captured]

    def nbytes(self, max_bytes: int | None = None) -> int:
        """Bytes held by the captures plus the float32 probabilities of those measured densely under
        ``max_bytes`` (:meth:`CapturedAttention.measured_blockwise`)."""
        return sum(capture.nbytes(max_bytes=max_bytes) for capture in self.captured)


# An OrderedDict, as torch's hook registries: RemovableHandle needs a weak reference to it.
_GLOBAL_EXTRACTORS: OrderedDict[int, tuple[type[nn.Module] | str, AttentionExtractor]] = OrderedDict()


def register_attention_extractor(
    target: type[nn.Module] | str, extractor: AttentionExtractor
) -> RemovableHandle:
    """Register how to read q, k, mask and scale from modules that compute attention by hand.

    ``target`` is a module type (matched with ``isinstance``) or an ``fnmatch`` pattern over qualified module
    names. Applies to every :class:`AttentionCapture` created afterwards; a capture's own ``extractors``
    take precedence, and a later registration over an earlier one. Returns a handle whose ``remove()``
    unregisters (also usable as a context manager).
    """
    _check_extractor_target("target", target, extractor)
    handle = RemovableHandle(_GLOBAL_EXTRACTORS)
    _GLOBAL_EXTRACTORS[handle.id] = (target, extractor)
    return handle


class AttentionCapture:
    """Captures the attention of ``model`` during armed forwards only; costs nothing otherwise.

    Use ``with capture.armed() as recording: model(batch)`` around a training-step forward, or ``arm()`` /
    ``disarm()`` from callback hooks that bracket it (arm before the forward, disarm before backward).
    The first ``max_sequences`` sequences of the batch are kept, so no random numbers are drawn.
    ``max_bytes`` bounds what a recording holds (q, k, masks and the float32 probabilities they expand to):
    over budget, fewer sequences, then fewer heads, then fewer layers (the last ones) are kept, each cut
    listed in ``recording.skipped``. ``extractors`` maps module types or name patterns to
    :data:`AttentionExtractor` functions for attention written by hand. With ``strict=False`` an error while
    capturing one layer is recorded in ``skipped`` and the forward goes on; ``strict=True`` raises it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_sequences: int = 4,
        max_bytes: int | None = None,
        extractors: Mapping[type[nn.Module] | str, AttentionExtractor] | None = None,
        strict: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or max_sequences < 1:
            raise ValueError(f"max_sequences must be a positive int, got {max_sequences!r}")
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1
        ):
            raise ValueError(f"max_bytes must be a positive int (bytes) or None, got {max_bytes!r}")
        for target, extractor in (extractors or {}).items():
            _check_extractor_target("extractors", target, extractor)
        self.model = model
        self.max_sequences = max_sequences
        self.max_bytes = max_bytes
        self.extractors = dict(extractors or {})
        self.strict = strict
        self._armed: _ArmedForward | None = None

    @property
    def is_armed(self) -> bool:
        return self._armed is not None

    def arm(self, token_mask: Tensor | None = None, *, every_module: bool = False) -> AttentionRecording:
        """Install the capture for the next forward; returns the recording it fills.

        ``token_mask``: optional (B, n) bool, True = real token: the batch's real tokens, for attention calls
        with n queries where the forward's own padding masks say nothing
        (:mod:`spectral_monitor.probes.token_masks`). Padded queries are left out of every metric.
        ``every_module``: hook the modules inside torch.compile graphs too, for a forward that runs them
        eagerly (under ``torch.compiler.set_stance("force_eager")``).
        """
        if self._armed is not None:
            raise RuntimeError("AttentionCapture is already armed; disarm() it first")
        self._armed = _ArmedForward(self, checked_token_mask(token_mask), every_module)
        return self._armed.recording

    def disarm(self) -> AttentionRecording:
        """Remove everything ``arm()`` installed and apply the memory budget; returns the final recording."""
        if self._armed is None:
            raise RuntimeError("AttentionCapture is not armed")
        armed, self._armed = self._armed, None
        return armed.close()

    @contextmanager
    def armed(self, token_mask: Tensor | None = None) -> Iterator[AttentionRecording]:
        """Context manager form of :meth:`arm` / :meth:`disarm`; disarms even if the forward raises."""
        recording = self.arm(token_mask)
        try:
            yield recording
        finally:
            self.disarm()

    def _extractor_for(self, name: str, module: nn.Module) -> AttentionExtractor | None:
        for target, extractor in self.extractors.items():
            if _matches(target, name, module):
                return extractor
        for target, extractor in reversed(_GLOBAL_EXTRACTORS.values()):
            if _matches(target, name, module):
                return extractor
        return None


class _KernelCallMode(TorchFunctionMode):
    """Passes every torch function through unchanged, reporting attention-kernel calls after they ran.

    Torch pops the mode while its handler runs, so only outermost calls are seen and the capture's own
    tensor operations are not intercepted.
    """

    def __init__(self, on_kernel_call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], None]):
        super().__init__()
        self._on_kernel_call = on_kernel_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is _MULTI_HEAD_ATTENTION_FORWARD or func is _SCALED_DOT_PRODUCT_ATTENTION:
            self._on_kernel_call(func, args, kwargs)
        return result


class _ArmedForward:
    """The hooks and mode of one armed forward, and the recording they fill."""

    def __init__(self, capture: AttentionCapture, token_mask: Tensor | None, every_module: bool) -> None:
        self._capture = capture
        self._every_module = every_module
        self._token_masks = ForwardTokenMasks(token_mask)
        self.recording = AttentionRecording()
        self._names: list[str] = []
        self._seen: set[str] = set()
        self._extracted: set[str] = set()
        self._handles: list[RemovableHandle] = []
        self._mode: _KernelCallMode | None = None
        self._stop_observing_eager: Callable[[], None] | None = None
        try:
            self._install()
        except BaseException:
            self._remove()
            raise

    def _install(self) -> None:
        model = self._capture.model
        self._token_masks.install(model, every_module=self._every_module)
        walk = unwrapped_named_modules if self._every_module else eager_named_modules
        for name, module in walk(model):
            layer = name or ROOT_LAYER_NAME
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(layer)))
            self._handles.append(module.register_forward_hook(self._exit_hook(layer), always_call=True))
            extractor = self._capture._extractor_for(name, module)
            if extractor is not None:
                self._extracted.add(layer)
                hook = self._extractor_hook(layer, extractor)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        fused = _module_with_fused_inference_path(self._capture.model)
        if fused is None:
            self._mode = _KernelCallMode(self._on_kernel_call)
            self._mode.__enter__()
        else:
            self.recording.skipped.append(
                SkippedCapture(
                    "*",
                    f"attention kernels not captured: {fused!r} is in eval mode under no_grad, where "
                    "capturing would disable its fused fast path and change its outputs "
                    "(capture training forwards)",
                )
            )

        # Hugging Face eager attention runs through no kernel; its attention function reports its inputs.
        self._stop_observing_eager = observe_eager_attention(
            self._capture.model,
            lambda args, kwargs: self._on_kernel_call(_SCALED_DOT_PRODUCT_ATTENTION, args, kwargs),
            self._on_uncapturable_call,
        )

    def close(self) -> AttentionRecording:
        self._remove()
        if self._capture.max_bytes is not None:
            _fit_to_budget(self.recording, self._capture.max_bytes)
        return self.recording

    def _remove(self) -> None:
        self._token_masks.remove()
        if self._stop_observing_eager is not None:
            self._stop_observing_eager()
            self._stop_observing_eager = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._names.clear()

    def _enter_hook(self, layer: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not torch.compiler.is_compiling():
                self._names.append(layer)

        return enter

    def _exit_hook(self, layer: str) -> Callable[..., None]:
        def exit_(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            if self._names and self._names[-1] == layer:
                self._names.pop()

        return exit_

    def _extractor_hook(self, layer: str, extractor: AttentionExtractor) -> Callable[..., None]:
        def extract(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if torch.compiler.is_compiling() or layer in self._seen:
                return
            self._seen.add(layer)
            self._record(
                layer, lambda: _captured(layer, extractor(module, args, kwargs, output), *self._sampling())
            )

        return extract

    def _on_kernel_call(
        self, kernel: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if torch.compiler.is_compiling() or not self._names:
            return  # traced into a compiled graph, or not called from inside the captured model
        layer = self._names[-1]
        if layer in self._seen or layer in self._extracted:
            return
        self._seen.add(layer)
        if kernel is _MULTI_HEAD_ATTENTION_FORWARD:
            self._record(
                layer, lambda: _captured_multi_head_attention(layer, args, kwargs, *self._sampling())
            )
        else:
            self._record(
                layer,
                lambda: _captured(layer, _scaled_dot_product_inputs(*args, **kwargs), *self._sampling()),
            )

    def _on_uncapturable_call(self, reason: str, error: Exception | None) -> None:
        if torch.compiler.is_compiling():
            return
        if error is not None and self._capture.strict:
            raise error
        if not self._names or self._names[-1] in self._seen:
            return
        self._seen.add(self._names[-1])
        self.recording.skipped.append(SkippedCapture(self._names[-1], reason))

    def _sampling(self) -> tuple[int, ForwardTokenMasks]:
        return self._capture.max_sequences, self._token_masks

    def _record(self, layer: str, capture: Callable[[], CapturedAttention | None]) -> None:
        try:
            with torch.no_grad():
                captured = capture()
        except Exception as error:
            if self._capture.strict:
                raise
            self.recording.skipped.append(SkippedCapture(layer, f"capture failed: {error!r}"))
            return
        if captured is not None:
            self.recording.captured.append(captured)


def _scaled_dot_product_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    logit_softcap: float | None = None,
) -> AttentionInputs:
    """Binds the arguments of an ``F.scaled_dot_product_attention`` call (its builtin has no signature), and
    the softcap a Hugging Face eager attention call reports beside them."""
    transform = None if logit_softcap is None else LogitSoftcap(logit_softcap)
    return AttentionInputs(
        q=query, k=key, mask=attn_mask, causal=is_causal, scale=scale, logit_transform=transform
    )


def _captured_multi_head_attention(
    layer: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_sequences: int,
    token_masks: ForwardTokenMasks,
) -> CapturedAttention:
    """Projects q and k of the sampled sequences from an ``F.multi_head_attention_forward`` call's arguments.

    Mirrors the kernel: packed or separate projection weights, ``bias_k`` and ``add_zero_attn`` key columns,
    ``static_k``, bool (True = masked) or float masks, 2-D or 3-D ``attn_mask`` merged with
    ``key_padding_mask``; where the kernel runs causal SDPA and ignores ``attn_mask``, so does the capture.
    """
    call = _MULTI_HEAD_ATTENTION_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    arguments = call.arguments
    query, key = arguments["query"], arguments["key"]
    attn_mask, key_padding_mask = arguments["attn_mask"], arguments["key_padding_mask"]
    is_self_attention = query is key
    if query.dim() == 2:  # unbatched (n, E): the kernel adds a batch dimension of one
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    num_queries, batch, embed_dim = query.shape
    heads = arguments["num_heads"]
    head_dim = embed_dim // heads
    sequences = min(max_sequences, batch)

    projection_bias = arguments["in_proj_bias"]
    query_bias, key_bias = (None, None) if projection_bias is None else projection_bias.chunk(3)[:2]
    if arguments["use_separate_proj_weight"]:
        query_weight, key_weight = arguments["q_proj_weight"], arguments["k_proj_weight"]
    else:
        query_weight, key_weight, _ = arguments["in_proj_weight"].chunk(3)
    q = F.linear(query[:, :sequences], query_weight, query_bias)
    q = q.view(num_queries, sequences, heads, head_dim).permute(1, 2, 0, 3)

    extra_keys = 0
    if arguments["static_k"] is None:
        k = F.linear(key[:, :sequences], key_weight, key_bias)
        if arguments["bias_k"] is not None:
            k = torch.cat([k, arguments["bias_k"].expand(1, sequences, embed_dim)])
            extra_keys += 1
        k = k.view(k.shape[0], sequences, heads, head_dim).permute(1, 2, 0, 3)
    else:
        k = arguments["static_k"].view(batch, heads, -1, head_dim)[:sequences]
    if arguments["add_zero_attn"]:
        k = torch.cat([k, k.new_zeros(sequences, heads, 1, head_dim)], dim=2)
        extra_keys += 1

    # The kernel either runs causal SDPA and ignores attn_mask, or applies the merged masks; with a truthful
    # is_causal hint and no extra key columns both give the same attention, and ``causal`` stays informative.
    is_causal = bool(arguments["is_causal"])
    kernel_ignores_attn_mask = is_causal and key_padding_mask is None and not arguments["need_weights"]
    causal = is_causal and (kernel_ignores_attn_mask or extra_keys == 0)
    mask = None
    if attn_mask is not None and not kernel_ignores_attn_mask:
        mask = additive_mask(attn_mask, true_means_masked=True)
        if mask.dim() == 2:
            mask = mask.view(1, 1, *mask.shape)
        else:
            mask = mask.view(batch, heads, *mask.shape[-2:])[:sequences]
    padded_queries = None
    if key_padding_mask is not None:
        padding = additive_mask(key_padding_mask[:sequences], true_means_masked=True)
        if is_self_attention:
            padded_queries = torch.isneginf(padding)
        padding = padding.view(sequences, 1, 1, -1)
        mask = padding if mask is None else mask + padding
    if mask is not None and extra_keys:
        mask = F.pad(mask, (0, extra_keys))
    inputs = AttentionInputs(q=q, k=k, mask=mask, causal=causal, scale=1.0 / math.sqrt(head_dim))
    return _captured(layer, inputs, sequences, token_masks, padded_queries)


def _captured(
    layer: str,
    inputs: AttentionInputs | None,
    max_sequences: int,
    token_masks: ForwardTokenMasks,
    padded_queries: Tensor | None = None,
) -> CapturedAttention | None:
    """Detached copies of the first ``max_sequences`` sequences of ``inputs``, with key and query masks.

    Real queries are those the inputs, the kernel call (``padded_queries``) and the forward's padding masks
    (``token_masks``) leave, among those with an attendable key; attendable keys are those of real queries.
    """
    if inputs is None:
        return None
    if not isinstance(inputs, AttentionInputs):
        raise TypeError(
            f"an attention extractor must return AttentionInputs or None, got {type(inputs).__name__}"
        )
    q, k = _batch_heads_layout(inputs.q), _batch_heads_layout(inputs.k)
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
    query_masks = [inputs.query_mask, token_masks.real_tokens(num_queries)]
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


def _fit_to_budget(recording: AttentionRecording, max_bytes: int) -> None:
    """Cuts sequences, then heads, then trailing layers until the recording fits ``max_bytes``."""
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
    ``DENSE_CALL_NBYTES`` comes once per call on top."""
    matrix = 4 * queries * keys
    held = matrix * (1.25 if masked else 1.0)
    if exact:
        return int(held + EXACT_WORKING_COPIES * matrix)
    copies = KRYLOV_MASKED_WORKING_COPIES if masked else KRYLOV_WORKING_COPIES
    return int(held + copies * matrix + 8 * KRYLOV_COLUMNS * max(queries, keys))


def _module_with_fused_inference_path(model: nn.Module) -> str | None:
    """The name of a module whose fused inference fast path an active TorchFunctionMode would disable."""
    if not torch.backends.mha.get_fastpath_enabled():
        return None
    grad_enabled = torch.is_grad_enabled()
    for name, module in unwrapped_named_modules(model):
        if not isinstance(module, (nn.MultiheadAttention, nn.TransformerEncoderLayer)) or module.training:
            continue
        trainable = any(parameter.requires_grad for parameter in module.parameters())
        if not (grad_enabled and trainable):  # torch's own condition for leaving the fast path
            return name or ROOT_LAYER_NAME
    return None


def _check_extractor_target(argument: str, target: object, extractor: object) -> None:
    is_module_type = isinstance(target, type) and issubclass(target, nn.Module)
    if not (is_module_type or isinstance(target, str)):
        raise ValueError(
            f"{argument}: a target must be an nn.Module subclass or a module-name pattern (str), "
            f"got {target!r}"
        )
    if not callable(extractor):
        raise ValueError(f"{argument}: the extractor for {target!r} must be callable, got {extractor!r}")


def _matches(target: type[nn.Module] | str, name: str, module: nn.Module) -> bool:
    if isinstance(target, str):
        return fnmatch.fnmatchcase(name or ROOT_LAYER_NAME, target)
    return isinstance(module, target)
