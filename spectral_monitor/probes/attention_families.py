"""What the probes know about attention-module families, in one place, and how users add to it.

Everything that recognises an attention module or reads its parts by name lives here:

- class names that look like attention (:data:`ATTENTION_CLASS_NAME_PARTS`, :func:`looks_like_attention`),
  for the advice given when no attention call was seen;
- the attribute names of head counts and widths (:data:`HEAD_COUNT_ATTRIBUTES`,
  :data:`HEAD_WIDTH_ATTRIBUTES`, :data:`KEY_VALUE_HEAD_COUNT_ATTRIBUTES`) and of the model width
  (:data:`MODEL_WIDTH_ATTRIBUTES`), read on a module or its ``config``;
- where the query, key and value projections are and how they are packed (:func:`read_attention_weights`):

  - ``nn.MultiheadAttention``: ``in_proj_weight`` rows [W_Q; W_K; W_V], or ``q_proj_weight``,
    ``k_proj_weight``, ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``. Its ``out_proj`` is
    an ``nn.Linear`` and is measured as one.
  - GPT-2-style attention (Hugging Face): a ``Conv1D`` ``c_attn`` with columns [W_Q | W_K | W_V] and an int
    ``num_heads``; as cross-attention (``is_cross_attention``) ``c_attn`` holds [W_K | W_V] and ``q_attn``
    W_Q. ``Conv1D`` is recognised by class name, so transformers stays optional; it stores its weight
    (in, out) and is read transposed.
  - a packed ``nn.Linear`` ``c_attn`` or ``qkv`` with rows [W_Q; W_K; W_V], heads contiguous within each,
    and a head count among :data:`HEAD_COUNT_ATTRIBUTES` (nanoGPT, timm, the demo model).
  - a fused projection in a :class:`QKVLayout`: built in for GPT-NeoX (``query_key_value``, per head
    interleaved) and Phi-3 (``qkv_proj``, concatenated with grouped key/value heads), registered for any
    other family with :func:`register_qkv_layout`. A module with a fused projection (a child named
    ``qkv...``, ``query_key_value``, ``Wqkv`` or ``W_pack``) that no layout splits is named by
    :func:`fused_projection_name`, so the weight probe can warn about it once.
  - separate ``nn.Linear`` query, key and value projections (the value one optional) named ``q_proj``,
    ``k_proj``, ``v_proj`` (Hugging Face Llama, Mistral, OPT, BART, ViT, ...), ``query``, ``key``, ``value``
    (BERT, RoBERTa, ViT before transformers 5), ``q``, ``k``, ``v`` (T5) or ``q_lin``, ``k_lin``, ``v_lin``
    (DistilBERT), with a head width among :data:`HEAD_WIDTH_ATTRIBUTES`, or else a query-head count among
    :data:`HEAD_COUNT_ATTRIBUTES`; the key-head count follows from the key projection's rows (grouped-query
    attention). The output projection (``o_proj``, ``o``, ``dense``) is an ``nn.Linear`` and measured as one;
- the keyword arguments that carry a forward's padding masks (:data:`REAL_TOKEN_MASK_KEYWORDS`,
  :data:`PADDING_MASK_KEYWORDS`; :mod:`spectral_monitor.probes.token_masks` reads them).

To extend it: :func:`register_qkv_layout` for a fused projection in a layout above, a
:class:`~spectral_monitor.probes.WeightProbe`'s ``attention_readers`` for any other weight layout, and
:func:`~spectral_monitor.probes.register_attention_extractor` for attention computed by hand, which no
kernel call reveals.

Weights are read as stored: detached, a parametrized weight (``torch.nn.utils.parametrize``) as its
``original``, because evaluating the parametrization can change its state (``spectral_norm`` runs a power
iteration on every evaluation in training mode); a sharded parameter outside
``spectral_monitor.distributed.full_parameters`` (FSDP2's DTensor, a freed FSDP flat parameter view) is not
read at all.
"""

from __future__ import annotations

import fnmatch
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

__all__ = [
    "ATTENTION_CLASS_NAME_PARTS",
    "HEAD_COUNT_ATTRIBUTES",
    "HEAD_WIDTH_ATTRIBUTES",
    "KEY_VALUE_HEAD_COUNT_ATTRIBUTES",
    "MODEL_WIDTH_ATTRIBUTES",
    "PADDING_MASK_KEYWORDS",
    "QKV_LAYOUTS",
    "REAL_TOKEN_MASK_KEYWORDS",
    "AttentionWeights",
    "AttentionWeightsReader",
    "QKVLayout",
    "check_head_split",
    "declared_head_count",
    "declared_model_width",
    "fused_projection_name",
    "looks_like_attention",
    "plain_weight",
    "read_attention_weights",
    "register_qkv_layout",
]

ATTENTION_CLASS_NAME_PARTS = ("attention", "attn")
"""Lower-case parts of a class name that mark a module as attention, for advice only: a module is measured
as attention by what its kernel calls and weights show, never by its name."""
HEAD_COUNT_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
"""Attributes that hold a module's (query-)head count, in the order they are tried."""
HEAD_WIDTH_ATTRIBUTES = ("head_dim", "attention_head_size", "key_value_proj_dim")
"""Attributes that hold a module's head width d_k, in the order they are tried."""
KEY_VALUE_HEAD_COUNT_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
"""Attributes that hold a module's key/value-head count (grouped-query attention)."""
MODEL_WIDTH_ATTRIBUTES = ("embed_dim", "d_model", "n_embd", "hidden_size")
"""Attributes that hold the width the heads split."""
REAL_TOKEN_MASK_KEYWORDS = ("attention_mask",)
"""Keyword arguments whose (batch, tokens) value is nonzero at real tokens (Hugging Face)."""
PADDING_MASK_KEYWORDS = ("src_key_padding_mask", "tgt_key_padding_mask")
"""Keyword arguments whose (batch, tokens) value is True (or ``-inf``) at padding (``nn.Transformer`` and
its parts)."""

_CONV1D_CLASS_NAME = "Conv1D"  # transformers.pytorch_utils.Conv1D, by name: transformers stays optional
_PACKED_PROJECTION_NAMES = ("c_attn", "qkv")
_SEPARATE_PROJECTION_NAMES = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("q_lin", "k_lin", "v_lin"),
)
_FUSED_PROJECTION_NAMES = ("query_key_value", "Wqkv", "W_pack")
"""Names of fused q/k/v projections besides those containing "qkv"."""


@dataclass(frozen=True, eq=False)
class AttentionWeights:
    """The query, key and value projections of one attention module, each (out, in) as ``nn.Linear`` has it.

    Head h owns rows h·d_k … (h+1)·d_k of each projection.

    Attributes:
        query: (H·d_k, d_q).
        key: (H_k·d_k, d_kv).
        value: (H_k·d_v, d_v_in), or ``None``.
        num_heads: H, the query heads.
        num_key_value_heads: H_k (``None`` = H), which must divide H (grouped-query attention: query head h
            reads key head h // (H / H_k)).
        replaces: names, relative to the attention module, of the submodules whose weights these are (e.g.
            ``("c_attn",)``), so they are not also measured whole.

    Raises:
        ValueError: if a projection is not a 2-D tensor or its rows do not split into the heads.
    """

    query: Tensor
    key: Tensor
    value: Tensor | None
    num_heads: int
    num_key_value_heads: int | None = None
    replaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, weight in (("query", self.query), ("key", self.key), ("value", self.value)):
            if weight is not None and (not isinstance(weight, Tensor) or weight.ndim != 2):
                raise ValueError(f"{name} must be a 2-D (out, in) tensor, got {_describe(weight)}")
        check_head_split(self.query, self.key, self.value, self.num_heads, self.key_value_heads)

    @property
    def key_value_heads(self) -> int:
        """H_k: ``num_key_value_heads``, or H where that is ``None``."""
        return self.num_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def projections(self) -> Iterator[tuple[str, Tensor, int]]:
        """``(role, weight, heads)`` for ``"q"``, ``"k"`` and ``"v"`` (when there is a value projection)."""
        yield "q", self.query, self.num_heads
        yield "k", self.key, self.key_value_heads
        if self.value is not None:
            yield "v", self.value, self.key_value_heads


AttentionWeightsReader = Callable[[nn.Module], AttentionWeights | None]
"""``reader(module)`` -> the module's projections (detached views of its weights), or ``None`` when the module
is not attention after all (its submodules are then measured as plain weights)."""

QKV_LAYOUTS = ("concatenated", "interleaved")
"""How a fused projection orders its rows: [W_Q; W_K; W_V], or per head h [W_Q^h; W_K^h; W_V^h]."""


@dataclass(frozen=True)
class QKVLayout:
    """How an attention module's fused ``nn.Linear`` (or ``Conv1D``) projection holds its q, k and v.

    A count left ``None`` is read from the module or its ``config`` (:data:`HEAD_COUNT_ATTRIBUTES`,
    :data:`KEY_VALUE_HEAD_COUNT_ATTRIBUTES`, :data:`HEAD_WIDTH_ATTRIBUTES` or ``head_size``); what is
    missing there follows from the projection's rows.

    Attributes:
        projection: the fused child's name (``"qkv_proj"``).
        layout: ``"concatenated"``, rows [W_Q; W_K; W_V] with heads contiguous within each and possibly
            fewer key/value heads (Phi-3's ``qkv_proj``), or ``"interleaved"``, per head h the rows
            [W_Q^h; W_K^h; W_V^h] (GPT-NeoX's ``query_key_value``, which its forward views as
            (heads, 3 · d_k)).
        num_heads: the query heads H, or ``None``.
        num_key_value_heads: the key/value heads H_k, or ``None``.
        head_dim: the head width d_k, or ``None``.

    Raises:
        ValueError: if ``projection`` is not a non-empty str, ``layout`` not one of ``QKV_LAYOUTS``, or a
            count not a positive int or None.
    """

    projection: str
    layout: str
    num_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.projection, str) or not self.projection:
            raise ValueError(
                f"projection must be a child module's name (a non-empty str), got {self.projection!r}"
            )
        if self.layout not in QKV_LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, QKV_LAYOUTS))}, got {self.layout!r}"
            )
        for name in ("num_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    def read(self, module: nn.Module) -> AttentionWeights | None:
        """``module``'s q, k and v split out of its fused projection; ``None`` when it has no such child
        or its rows do not split into the heads the module declares."""
        fused = plain_weight(module._modules.get(self.projection))
        if fused is None:
            return None
        heads, key_heads, width = self._head_shape(module, fused.shape[0])
        if heads is None:
            return None
        if self.layout == "interleaved":
            per_head = fused.view(heads, 3, width, fused.shape[1])
            query, key, value = (per_head[:, role].reshape(heads * width, -1) for role in range(3))
        else:
            query, key, value = fused.split([heads * width, key_heads * width, key_heads * width])
        return _layout_or_none(query, key, value, heads, key_heads, replaces=(self.projection,))

    def _head_shape(self, module: nn.Module, rows: int) -> tuple[int | None, int, int]:
        """(H, H_k, d_k) of a projection with ``rows`` rows, or (None, 0, 0) where they do not fit."""
        owners = (module, getattr(module, "config", None))
        heads = self.num_heads or _first_int(owners, HEAD_COUNT_ATTRIBUTES)
        width = self.head_dim or _first_int(owners, (*HEAD_WIDTH_ATTRIBUTES, "head_size"))
        key_heads = self.num_key_value_heads or _first_int(owners, KEY_VALUE_HEAD_COUNT_ATTRIBUTES)
        if heads is None:
            return None, 0, 0
        if self.layout == "interleaved":
            key_heads = key_heads or heads
            width = width or rows // (3 * heads)
            fits = key_heads == heads and rows == 3 * heads * width
        else:
            if key_heads is None:
                key_heads = (rows // width - heads) // 2 if width else heads
            width = width or rows // (heads + 2 * key_heads)
            fits = key_heads > 0 and rows == (heads + 2 * key_heads) * width
        return (heads, key_heads, width) if fits else (None, 0, 0)


_BUILT_IN_QKV_LAYOUTS = {
    "GPTNeoXAttention": QKVLayout("query_key_value", "interleaved"),
    "Phi3Attention": QKVLayout("qkv_proj", "concatenated"),
}
"""Fused layouts known by the attention module's class name (transformers stays optional)."""

# An OrderedDict, as torch's hook registries: RemovableHandle needs a weak reference to it.
_REGISTERED_QKV_LAYOUTS: OrderedDict[int, tuple[type[nn.Module] | str, QKVLayout]] = OrderedDict()


def register_qkv_layout(target: type[nn.Module] | str, layout: QKVLayout) -> RemovableHandle:
    """Tell every :class:`~spectral_monitor.probes.WeightProbe` how the attention modules ``target`` fuse
    q, k and v, so they get per-head weight metrics (``qk_spectral_norm``, per-head σ₁)::

        register_qkv_layout(MyAttention, QKVLayout("Wqkv", "interleaved"))

    Args:
        target: a module type (matched with ``isinstance``) or an ``fnmatch`` pattern over qualified module
            names (``"blocks.*.attn"``). A later registration wins over an earlier one and over the built-in
            layouts; a probe's own ``attention_readers`` win over all.
        layout: the :class:`QKVLayout` of their fused projection.

    Returns:
        A handle whose ``remove()`` unregisters.

    Raises:
        ValueError: if ``target`` or ``layout`` is of the wrong kind.
    """
    if not (isinstance(target, str) or (isinstance(target, type) and issubclass(target, nn.Module))):
        raise ValueError(
            f"target must be an nn.Module subclass or a module-name pattern (str), got {target!r}"
        )
    if not isinstance(layout, QKVLayout):
        raise ValueError(f"layout must be a QKVLayout, got {type(layout).__name__}")
    handle = RemovableHandle(_REGISTERED_QKV_LAYOUTS)
    _REGISTERED_QKV_LAYOUTS[handle.id] = (target, layout)
    return handle


def _stored_weight(module: nn.Module, name: str) -> Tensor | None:
    """The detached weight ``name`` as stored (a parametrized one's ``original``), or ``None`` if unusable."""
    if parametrize.is_parametrized(module, name):
        weight = getattr(getattr(module.parametrizations, name), "original", None)
    else:
        weight = getattr(module, name, None)
    if (
        not isinstance(weight, Tensor)
        or nn.parameter.is_lazy(weight)
        or weight.ndim != 2
        or weight.numel() == 0
        or weight.is_meta
        or not weight.is_floating_point()
        or _is_shard(weight)
    ):
        return None
    return weight.detach()


def _is_shard(weight: Tensor) -> bool:
    """A sharded parameter outside ``full_parameters``: FSDP2's DTensor, or FSDP's view of a freed flat
    parameter (no storage)."""
    return type(weight).__name__ == "DTensor" or weight.untyped_storage().size() == 0


def plain_weight(module: nn.Module) -> Tensor | None:
    """The (out, in) weight of an ``nn.Linear`` or a Hugging Face ``Conv1D``, as stored and detached.

    Args:
        module: any module (or ``None``).

    Returns:
        The weight, or ``None`` for another kind of module or a weight that cannot be read (lazy, on the
        meta device, not floating point, empty, or a shard).
    """
    if isinstance(module, nn.Linear):
        return _stored_weight(module, "weight")
    if type(module).__name__ == _CONV1D_CLASS_NAME:
        weight = _stored_weight(module, "weight")
        return None if weight is None else weight.t()
    return None


def _read_multihead_attention(module: nn.Module) -> AttentionWeights | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if module.in_proj_weight is not None:
        packed = _stored_weight(module, "in_proj_weight")
        if packed is None:
            return None
        query, key, value = packed.chunk(3)
    else:
        query, key, value = (_stored_weight(module, f"{role}_proj_weight") for role in ("q", "k", "v"))
        if query is None or key is None:
            return None
    return _layout_or_none(query, key, value, module.num_heads)


# The readers look for submodules in ``_modules`` before asking for attributes: ``nn.Module.__getattr__``
# raising for a name a module lacks is most of what reading a model's modules costs.


def _read_gpt2_attention(module: nn.Module) -> AttentionWeights | None:
    packed = module._modules.get("c_attn")
    if type(packed).__name__ != _CONV1D_CLASS_NAME:
        return None
    heads = getattr(module, "num_heads", None)
    if not _is_positive_int(heads):
        return None
    packed_weight = plain_weight(packed)
    if packed_weight is None:
        return None
    if getattr(module, "is_cross_attention", False):
        query = plain_weight(getattr(module, "q_attn", None))
        if query is None:
            return None
        key, value = packed_weight.chunk(2)
        return _layout_or_none(query, key, value, heads, replaces=("c_attn", "q_attn"))
    query, key, value = packed_weight.chunk(3)
    return _layout_or_none(query, key, value, heads, replaces=("c_attn",))


def _read_packed_linear_attention(module: nn.Module) -> AttentionWeights | None:
    if not any(isinstance(module._modules.get(name), nn.Linear) for name in _PACKED_PROJECTION_NAMES):
        return None
    heads = declared_head_count(module)
    if heads is None:
        return None
    for name in _PACKED_PROJECTION_NAMES:
        projection = module._modules.get(name)
        if isinstance(projection, nn.Linear):
            weight = _stored_weight(projection, "weight")
            if weight is None or weight.shape[0] % 3:
                return None
            query, key, value = weight.chunk(3)
            return _layout_or_none(query, key, value, heads, replaces=(name,))
    return None


def _read_separate_projection_attention(module: nn.Module) -> AttentionWeights | None:
    for names in _SEPARATE_PROJECTION_NAMES:
        projections = [module._modules.get(name) for name in names]
        if all(isinstance(projection, nn.Linear) for projection in projections[:2]):
            break
    else:
        return None
    query, key = (_stored_weight(projection, "weight") for projection in projections[:2])
    value = _stored_weight(projections[2], "weight") if isinstance(projections[2], nn.Linear) else None
    if query is None or key is None:
        return None
    head_dim = _first_int((module,), HEAD_WIDTH_ATTRIBUTES)
    if head_dim is None:
        heads = declared_head_count(module)
        if heads is None or query.shape[0] % heads:
            return None
        head_dim = query.shape[0] // heads
    if query.shape[0] % head_dim or key.shape[0] % head_dim:
        return None
    replaces = tuple(
        name for name, projection in zip(names, projections, strict=True) if isinstance(projection, nn.Linear)
    )
    return _layout_or_none(query, key, value, query.shape[0] // head_dim, key.shape[0] // head_dim, replaces)


def _layout_or_none(*args: Any, **kwargs: Any) -> AttentionWeights | None:
    """The built-in readers' result, or ``None`` when the weights do not split into the module's heads.

    Such a module is not that layout after all; its submodules are measured as plain weights.
    """
    try:
        return AttentionWeights(*args, **kwargs)
    except ValueError:
        return None


_BUILT_IN_READERS: tuple[AttentionWeightsReader, ...] = (
    _read_multihead_attention,
    _read_gpt2_attention,
    _read_packed_linear_attention,
    _read_separate_projection_attention,
)


def read_attention_weights(layer: str, module: nn.Module) -> AttentionWeights | None:
    """``module``'s query, key and value projections, if it is attention in a layout this registry knows.

    Tried in order: the layouts registered with :func:`register_qkv_layout` (the latest first), the built-in
    fused layouts (by class name), then the built-in readers of the module docstring.

    Args:
        layer: the module's qualified name, which registered name patterns are matched against.
        module: the module to read.

    Returns:
        Detached views of its projections, or ``None`` when it is not attention in a known layout (its
        submodules are then measured as plain weights).
    """
    for target, layout in reversed(_REGISTERED_QKV_LAYOUTS.values()):
        if fnmatch.fnmatchcase(layer, target) if isinstance(target, str) else isinstance(module, target):
            return layout.read(module)
    built_in = _BUILT_IN_QKV_LAYOUTS.get(type(module).__name__)
    if built_in is not None:
        return built_in.read(module)
    for reader in _BUILT_IN_READERS:
        weights = reader(module)
        if weights is not None:
            return weights
    return None


def fused_projection_name(module: nn.Module) -> str | None:
    """The name of ``module``'s child that looks like a fused q/k/v projection, if it has one.

    Args:
        module: an attention module that no layout split.

    Returns:
        The first child named ``qkv...`` (any case), ``query_key_value``, ``Wqkv`` or ``W_pack`` that is an
        ``nn.Linear`` or ``Conv1D`` with a usable weight, or ``None``.
    """
    return next(
        (
            child
            for child, submodule in module._modules.items()
            if ("qkv" in child.lower() or child in _FUSED_PROJECTION_NAMES)
            and plain_weight(submodule) is not None
        ),
        None,
    )


def looks_like_attention(module: nn.Module) -> bool:
    """Whether ``module``'s class name marks it as attention written by hand.

    Args:
        module: any module.

    Returns:
        True when its class name contains a part of :data:`ATTENTION_CLASS_NAME_PARTS` and it is not an
        ``nn.MultiheadAttention`` (whose kernel call is always seen).
    """
    name = type(module).__name__.lower()
    return any(part in name for part in ATTENTION_CLASS_NAME_PARTS) and not isinstance(
        module, nn.MultiheadAttention
    )


def declared_head_count(module: object) -> int | None:
    """The head count ``module`` declares: the first positive int among :data:`HEAD_COUNT_ATTRIBUTES`.

    Args:
        module: a module, or its ``config``.

    Returns:
        The count, or ``None`` when it declares none.
    """
    return _first_int((module,), HEAD_COUNT_ATTRIBUTES)


def declared_model_width(module: object) -> int | None:
    """The width ``module`` declares: the first positive int among :data:`MODEL_WIDTH_ATTRIBUTES`.

    Args:
        module: a module, or its ``config``.

    Returns:
        The width, or ``None`` when it declares none.
    """
    return _first_int((module,), MODEL_WIDTH_ATTRIBUTES)


def _first_int(owners: Sequence[object], names: Sequence[str]) -> int | None:
    """The first positive int attribute ``names`` holds on the first owner that has one."""
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if _is_positive_int(value):
                return value
    return None


def check_head_split(query: Tensor, key: Tensor, value: Tensor | None, heads: int, key_heads: int) -> None:
    """Checks that the projections' rows split into ``heads`` query and ``key_heads`` key/value heads.

    Args:
        query: (H·d_k, d_q).
        key: (H_k·d_k, d_kv).
        value: (H_k·d_v, d_v_in), or ``None``.
        heads: H.
        key_heads: H_k.

    Raises:
        ValueError: if a count is not a positive int, H_k does not divide H, a projection's rows are not a
            multiple of its heads, or query and key heads differ in width.
    """
    if not (_is_positive_int(heads) and _is_positive_int(key_heads)):
        raise ValueError(
            f"num_heads and num_key_value_heads must be positive ints, got {heads!r}, {key_heads!r}"
        )
    if heads % key_heads:
        raise ValueError(f"num_key_value_heads={key_heads} must divide num_heads={heads}")
    for name, weight, count in (
        ("query", query, heads),
        ("key", key, key_heads),
        ("value", value, key_heads),
    ):
        if weight is not None and weight.shape[0] % count:
            raise ValueError(f"{name} has {weight.shape[0]} rows, not a multiple of its {count} heads")
    if query.shape[0] // heads != key.shape[0] // key_heads:
        raise ValueError(
            f"query and key heads must have one width d_k, got {query.shape[0] // heads} "
            f"and {key.shape[0] // key_heads}"
        )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _describe(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
