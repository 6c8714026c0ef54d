"""What the probes know about attention-module families, in one registry that users extend.

An :class:`AttentionFamilies` value holds every fact the probes use to recognise an attention module or read
its parts by name, and answers every question asked of them:

- class names that look like attention (:attr:`~AttentionFamilies.attention_class_name_parts`,
  :meth:`~AttentionFamilies.looks_like_attention`), for the advice given when no attention call was seen;
- the attribute names of head counts and widths and of the model width, read on a module or its ``config``
  (:meth:`~AttentionFamilies.declared_head_count`, :meth:`~AttentionFamilies.declared_model_width`);
- where the query, key and value projections are and how they are packed
  (:meth:`~AttentionFamilies.read_attention_weights`):

  - ``nn.MultiheadAttention``: ``in_proj_weight`` rows [W_Q; W_K; W_V], or ``q_proj_weight``,
    ``k_proj_weight``, ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``. Its ``out_proj`` is
    an ``nn.Linear`` and is measured as one.
  - GPT-2-style attention (Hugging Face): a ``Conv1D`` ``c_attn`` with columns [W_Q | W_K | W_V] and an int
    ``num_heads``; as cross-attention (``is_cross_attention``) ``c_attn`` holds [W_K | W_V] and ``q_attn``
    W_Q. ``Conv1D`` is recognised by class name, so transformers stays optional; it stores its weight
    (in, out) and is read transposed.
  - a packed ``nn.Linear`` ``c_attn`` or ``qkv`` with rows [W_Q; W_K; W_V], heads contiguous within each,
    and a declared head count (nanoGPT, timm, the demo model).
  - a fused projection in a :class:`QKVLayout` (:attr:`~AttentionFamilies.qkv_layouts`): by default
    GPT-NeoX (``query_key_value``, per head interleaved) and Phi-3 (``qkv_proj``, concatenated with grouped
    key/value heads). A module with a fused projection (a child named ``qkv...``, ``query_key_value``,
    ``Wqkv``, ``W_pack`` or ``c_attn``) that no layout splits is named by
    :func:`~spectral_monitor.probes.attention_weights.fused_projection_name`, so the weight
    probe can warn about it once.
  - separate ``nn.Linear`` query, key and value projections (the value one optional) named ``q_proj``,
    ``k_proj``, ``v_proj`` (Hugging Face Llama, Mistral, OPT, BART, ViT, ...), ``query``, ``key``, ``value``
    (BERT, RoBERTa, ViT before transformers 5), ``q``, ``k``, ``v`` (T5) or ``q_lin``, ``k_lin``, ``v_lin``
    (DistilBERT), with a declared head width, or else a declared query-head count; the key-head count
    follows from the key projection's rows (grouped-query attention). The output projection (``o_proj``,
    ``o``, ``dense``) is an ``nn.Linear`` and measured as one;
- the keyword arguments that carry a forward's padding masks
  (:attr:`~AttentionFamilies.real_token_mask_keywords`, :attr:`~AttentionFamilies.padding_mask_keywords`;
  :mod:`spectral_monitor.probes.token_masks` reads them).

Each monitor reads with its own registry, its ``attention_families`` option
(:class:`~spectral_monitor.core.CaptureOptions`); the probes take one as ``attention_families=``.
``AttentionFamilies()`` is the process-wide default as of when it is made: the facts above plus the layouts
registered with :func:`register_qkv_layout`. To extend it: the ``with_...`` methods for one monitor,
:func:`register_qkv_layout` for every registry made afterwards, a
:class:`~spectral_monitor.probes.WeightProbe`'s ``attention_readers`` for any other weight layout, and
:func:`~spectral_monitor.probes.register_attention_extractor` for attention computed by hand, which no
kernel call reveals.
"""

from __future__ import annotations

import fnmatch
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from torch import nn
from torch.utils.hooks import RemovableHandle

from spectral_monitor.probes.attention_weights import (
    BUILT_IN_READERS,
    AttentionWeights,
    first_int,
    is_positive_int,
    plain_weight,
    weights_or_none,
)
from spectral_monitor.validation import check_names

__all__ = [
    "ATTENTION_CLASS_NAME_PARTS",
    "BUILT_IN_QKV_LAYOUTS",
    "HEAD_COUNT_ATTRIBUTES",
    "HEAD_WIDTH_ATTRIBUTES",
    "KEY_VALUE_HEAD_COUNT_ATTRIBUTES",
    "MODEL_WIDTH_ATTRIBUTES",
    "PADDING_MASK_KEYWORDS",
    "QKV_LAYOUTS",
    "REAL_TOKEN_MASK_KEYWORDS",
    "AttentionFamilies",
    "QKVLayout",
    "qkv_layout_pattern",
    "register_qkv_layout",
]

ATTENTION_CLASS_NAME_PARTS = ("attention", "attn")
"""Parts of a class name that mark a module as attention, for advice only: a module is measured as attention
by what its kernel calls and weights show, never by its name."""
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

_FUSED_LAYOUT_HEAD_WIDTH_ATTRIBUTES = ("head_size",)  # GPT-NeoX's, read for a fused layout only

QKV_LAYOUTS = ("concatenated", "interleaved")
"""How a fused projection orders its rows: [W_Q; W_K; W_V], or per head h [W_Q^h; W_K^h; W_V^h]."""


@dataclass(frozen=True)
class QKVLayout:
    """How an attention module's fused ``nn.Linear`` (or ``Conv1D``) projection holds its q, k and v.

    A count left ``None`` is read from the module or its ``config`` (the registry's head-count, key/value
    head-count and head-width attributes, and ``head_size``); what is missing there follows from the
    projection's rows.

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

    Examples:
        >>> from torch import nn
        >>> attention = nn.Module()
        >>> attention.Wqkv = nn.Linear(8, 24)
        >>> weights = QKVLayout("Wqkv", "interleaved", num_heads=2).read(attention)
        >>> weights.query.shape, weights.replaces
        (torch.Size([8, 8]), ('Wqkv',))
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
            if value is not None and not is_positive_int(value):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    def read(self, module: nn.Module, families: AttentionFamilies | None = None) -> AttentionWeights | None:
        """``module``'s q, k and v split out of its fused projection.

        Args:
            module: the attention module.
            families: the registry whose attribute names give the counts this layout leaves ``None``
                (None: ``AttentionFamilies()``).

        Returns:
            The split projections, or ``None`` when ``module`` has no such child or its rows do not split
            into the heads it declares.
        """
        fused = plain_weight(module._modules.get(self.projection))
        if fused is None:
            return None
        heads, key_heads, width = self._head_shape(module, fused.shape[0], families or AttentionFamilies())
        if heads is None:
            return None
        if self.layout == "interleaved":
            per_head = fused.view(heads, 3, width, fused.shape[1])
            query, key, value = (per_head[:, role].reshape(heads * width, -1) for role in range(3))
        else:
            query, key, value = fused.split([heads * width, key_heads * width, key_heads * width])
        return weights_or_none(query, key, value, heads, key_heads, replaces=(self.projection,))

    def _head_shape(
        self, module: nn.Module, rows: int, families: AttentionFamilies
    ) -> tuple[int | None, int, int]:
        """(H, H_k, d_k) of a projection with ``rows`` rows, or (None, 0, 0) where they do not fit."""
        owners = (module, getattr(module, "config", None))
        heads = self.num_heads or first_int(owners, families.head_count_attributes)
        width = self.head_dim or first_int(
            owners, (*families.head_width_attributes, *_FUSED_LAYOUT_HEAD_WIDTH_ATTRIBUTES)
        )
        key_heads = self.num_key_value_heads or first_int(owners, families.key_value_head_count_attributes)
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


BUILT_IN_QKV_LAYOUTS: Mapping[str, QKVLayout] = {
    "GPTNeoXAttention": QKVLayout("query_key_value", "interleaved"),
    "Phi3Attention": QKVLayout("qkv_proj", "concatenated"),
}
"""The fused layouts every default registry starts with, by class name (transformers stays optional)."""

# An OrderedDict, as torch's hook registries: RemovableHandle needs a weak reference to it.
_REGISTERED_QKV_LAYOUTS: OrderedDict[int, tuple[str, QKVLayout]] = OrderedDict()


def _default_qkv_layouts() -> dict[str, QKVLayout]:
    """The built-in layouts, then those registered now, in order (a later one wins)."""
    layouts: dict[str, QKVLayout] = dict(BUILT_IN_QKV_LAYOUTS)
    for target, layout in _REGISTERED_QKV_LAYOUTS.values():
        layouts.pop(target, None)
        layouts[target] = layout
    return layouts


@dataclass(frozen=True)
class AttentionFamilies:
    """Everything the probes know about attention-module families: how they are named, counted, masked and
    packed. A value: the ``with_...`` methods return a new registry and leave this one as it is.

    ``AttentionFamilies()`` is the process-wide default as of when it is made: the names of this module's
    constants (:data:`HEAD_COUNT_ATTRIBUTES` and the others), the layouts of :data:`BUILT_IN_QKV_LAYOUTS`,
    then the layouts registered with :func:`register_qkv_layout`. A field
    given replaces that fact (in YAML too: list the names you keep); the ``with_...`` methods add to it.
    Names are tried in order, the first positive int found wins; names added come first.

    Attributes:
        attention_class_name_parts: parts of a class name (any case) that mark a module as attention
            written by hand, named in the advice given when a forward made no attention call the capture
            could see.
        head_count_attributes: attributes holding a module's (query-)head count, on the module or its
            ``config``.
        key_value_head_count_attributes: attributes holding its key/value-head count (grouped-query
            attention).
        head_width_attributes: attributes holding its head width d_k.
        model_width_attributes: attributes holding the width the heads split (read by the preflight).
        real_token_mask_keywords: keyword arguments of a forward whose (batch, tokens) value is nonzero at
            real tokens.
        padding_mask_keywords: keyword arguments whose (batch, tokens) value is True (or ``-inf``) at
            padding.
        qkv_layouts: the :class:`QKVLayout` of each attention class with a fused projection, keyed by a str
            ``fnmatch`` pattern matched against the class name (``"FalconAttention"``), the qualified module
            name (``"blocks.*.attn"``) and the import path of the class and of each of its bases
            (``"my_model.layers.MyAttention"``); the last entry that matches wins. A module type given as a
            key is kept as its import path, so it matches its subclasses too, and the registry can be
            written to YAML and read back.

    Raises:
        ValueError: if a list of names is not a list of non-empty strs, or ``qkv_layouts`` does not map
            module types or strs to :class:`QKVLayout` values.

    Examples:
        >>> from torch import nn
        >>> class MyAttention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.n_q_heads = 2
        ...         self.Wqkv = nn.Linear(8, 24)
        >>> families = AttentionFamilies().with_attribute_names(head_count=["n_q_heads"])
        >>> families = families.with_qkv_layout(MyAttention, QKVLayout("Wqkv", "interleaved"))
        >>> families.read_attention_weights("blocks.0.attn", MyAttention()).num_heads
        2
        >>> AttentionFamilies().read_attention_weights("blocks.0.attn", MyAttention()) is None
        True
    """

    attention_class_name_parts: Sequence[str] = ATTENTION_CLASS_NAME_PARTS
    head_count_attributes: Sequence[str] = HEAD_COUNT_ATTRIBUTES
    key_value_head_count_attributes: Sequence[str] = KEY_VALUE_HEAD_COUNT_ATTRIBUTES
    head_width_attributes: Sequence[str] = HEAD_WIDTH_ATTRIBUTES
    model_width_attributes: Sequence[str] = MODEL_WIDTH_ATTRIBUTES
    real_token_mask_keywords: Sequence[str] = REAL_TOKEN_MASK_KEYWORDS
    padding_mask_keywords: Sequence[str] = PADDING_MASK_KEYWORDS
    qkv_layouts: Mapping[type[nn.Module] | str, QKVLayout] = field(default_factory=_default_qkv_layouts)

    def __post_init__(self) -> None:
        for name in _NAME_FIELDS:
            names = check_names(name, getattr(self, name), what="non-empty strs")
            object.__setattr__(self, name, tuple(names))
        if not isinstance(self.qkv_layouts, Mapping):
            raise ValueError(
                "qkv_layouts must map module types or class-name / module-name patterns (str) to QKVLayout, "
                f"got {type(self.qkv_layouts).__name__} {self.qkv_layouts!r}"
            )
        for target, layout in self.qkv_layouts.items():
            _check_qkv_layout("qkv_layouts", target, layout)
        layouts = {qkv_layout_pattern(target): layout for target, layout in self.qkv_layouts.items()}
        object.__setattr__(self, "qkv_layouts", layouts)

    # ----------------------------------------------------------------------------------------------------
    # Extending
    # ----------------------------------------------------------------------------------------------------

    def with_qkv_layout(self, target: type[nn.Module] | str, layout: QKVLayout) -> AttentionFamilies:
        """This registry, with ``layout`` for the attention modules ``target`` names, over any it had.

        Args:
            target: a module type (kept as its import path, which matches it and its subclasses), or a
                str ``fnmatch`` pattern matched against the class name, the qualified module name and the
                import paths of the class and its bases (``"FalconAttention"``, ``"blocks.*.attn"``).
            layout: the :class:`QKVLayout` of their fused projection.

        Returns:
            The extended registry.

        Raises:
            ValueError: if ``target`` or ``layout`` is of the wrong kind.

        Examples:
            >>> families = AttentionFamilies().with_qkv_layout("*.attn", QKVLayout("Wqkv", "concatenated"))
            >>> families.qkv_layouts["*.attn"].projection
            'Wqkv'
        """
        _check_qkv_layout("target", target, layout)
        pattern = qkv_layout_pattern(target)
        layouts = {key: value for key, value in self.qkv_layouts.items() if key != pattern}
        layouts[pattern] = layout
        return replace(self, qkv_layouts=layouts)

    def with_attribute_names(
        self,
        *,
        head_count: Sequence[str] = (),
        key_value_head_count: Sequence[str] = (),
        head_width: Sequence[str] = (),
        model_width: Sequence[str] = (),
    ) -> AttentionFamilies:
        """This registry, with more attribute names for the counts and widths, tried before its own.

        Args:
            head_count: names of (query-)head counts (``"n_q_heads"``).
            key_value_head_count: names of key/value-head counts.
            head_width: names of head widths d_k.
            model_width: names of the width the heads split.

        Returns:
            The extended registry.

        Raises:
            ValueError: if a list is not a list of non-empty strs.

        Examples:
            >>> AttentionFamilies().with_attribute_names(head_count=["n_q_heads"]).head_count_attributes[:2]
            ('n_q_heads', 'n_head')
        """
        return self._with_names(
            head_count_attributes=("head_count", head_count),
            key_value_head_count_attributes=("key_value_head_count", key_value_head_count),
            head_width_attributes=("head_width", head_width),
            model_width_attributes=("model_width", model_width),
        )

    def with_mask_keywords(
        self, *, real_tokens: Sequence[str] = (), padding: Sequence[str] = ()
    ) -> AttentionFamilies:
        """This registry, with more keyword arguments that carry a forward's token masks.

        Args:
            real_tokens: keywords whose (batch, tokens) value is nonzero at real tokens (``"token_mask"``).
            padding: keywords whose (batch, tokens) value is True (or ``-inf``) at padding
                (``"padding_mask"``).

        Returns:
            The extended registry, the new keywords tried first.

        Raises:
            ValueError: if a list is not a list of non-empty strs.

        Examples:
            >>> AttentionFamilies().with_mask_keywords(padding=["pad_mask"]).padding_mask_keywords[0]
            'pad_mask'
        """
        return self._with_names(
            real_token_mask_keywords=("real_tokens", real_tokens), padding_mask_keywords=("padding", padding)
        )

    def with_attention_class_names(self, *parts: str) -> AttentionFamilies:
        """This registry, with more class-name parts that mark a module as attention written by hand.

        Args:
            *parts: parts of a class name, any case (``"Mixer"``).

        Returns:
            The extended registry.

        Raises:
            ValueError: if a part is not a non-empty str.

        Examples:
            >>> from torch import nn
            >>> class TokenMixer(nn.Module):
            ...     pass
            >>> AttentionFamilies().with_attention_class_names("mixer").looks_like_attention(TokenMixer())
            True
        """
        return self._with_names(attention_class_name_parts=("parts", parts))

    def _with_names(self, **added: tuple[str, Sequence[str]]) -> AttentionFamilies:
        """A copy with, for each field, the names given under their argument's name put before its own."""
        changes = {}
        for field_name, (argument, names) in added.items():
            names = check_names(argument, names, what="non-empty strs")
            if names:
                changes[field_name] = tuple(dict.fromkeys((*names, *getattr(self, field_name))))
        return replace(self, **changes)

    # ----------------------------------------------------------------------------------------------------
    # Reading
    # ----------------------------------------------------------------------------------------------------

    def looks_like_attention(self, module: nn.Module) -> bool:
        """Whether ``module``'s class name marks it as attention written by hand.

        Args:
            module: any module.

        Returns:
            True when its class name contains one of :attr:`attention_class_name_parts` (any case) and it
            is not an ``nn.MultiheadAttention`` (whose kernel call is always seen).

        Examples:
            >>> from torch import nn
            >>> AttentionFamilies().looks_like_attention(nn.MultiheadAttention(8, 2))
            False
        """
        name = type(module).__name__.lower()
        return any(part.lower() in name for part in self.attention_class_name_parts) and not isinstance(
            module, nn.MultiheadAttention
        )

    def declared_head_count(self, owner: object) -> int | None:
        """The head count ``owner`` declares: the first positive int among :attr:`head_count_attributes`.

        Args:
            owner: a module, or its ``config``.

        Returns:
            The count, or ``None`` when it declares none.

        Examples:
            >>> from torch import nn
            >>> AttentionFamilies().declared_head_count(nn.MultiheadAttention(8, 2))
            2
        """
        return first_int((owner,), self.head_count_attributes)

    def declared_model_width(self, owner: object) -> int | None:
        """The width ``owner`` declares: the first positive int among :attr:`model_width_attributes`.

        Args:
            owner: a module, or its ``config``.

        Returns:
            The width, or ``None`` when it declares none.

        Examples:
            >>> from torch import nn
            >>> AttentionFamilies().declared_model_width(nn.MultiheadAttention(8, 2))
            8
        """
        return first_int((owner,), self.model_width_attributes)

    def qkv_layout_of(self, layer: str, module: nn.Module) -> QKVLayout | None:
        """The fused layout registered for ``module``: the last entry of :attr:`qkv_layouts` that matches.

        Args:
            layer: the module's qualified name.
            module: the module.

        Returns:
            Its layout, or ``None`` when no entry matches.

        Examples:
            >>> from torch import nn
            >>> AttentionFamilies().qkv_layout_of("blocks.0.attn", nn.Linear(2, 2)) is None
            True
        """
        names = (type(module).__name__, layer, *map(qkv_layout_pattern, type(module).__mro__))
        for pattern, layout in reversed(self.qkv_layouts.items()):
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                return layout
        return None

    def read_attention_weights(self, layer: str, module: nn.Module) -> AttentionWeights | None:
        """``module``'s query, key and value projections, if it is attention in a layout this registry knows.

        A layout of :attr:`qkv_layouts` that matches the module is used alone; else the built-in readers of
        the module docstring are tried in order.

        Args:
            layer: the module's qualified name, which str targets of :attr:`qkv_layouts` are matched against.
            module: the module to read.

        Returns:
            Detached views of its projections, or ``None`` when it is not attention in a known layout (its
            submodules are then measured as plain weights).

        Examples:
            >>> from torch import nn
            >>> weights = AttentionFamilies().read_attention_weights("attn", nn.MultiheadAttention(8, 2))
            >>> weights.query.shape, weights.num_heads
            (torch.Size([8, 8]), 2)
        """
        layout = self.qkv_layout_of(layer, module)
        if layout is not None:
            return layout.read(module, self)
        for reader in BUILT_IN_READERS:
            weights = reader(self, module)
            if weights is not None:
                return weights
        return None


_NAME_FIELDS = (
    "attention_class_name_parts",
    "head_count_attributes",
    "key_value_head_count_attributes",
    "head_width_attributes",
    "model_width_attributes",
    "real_token_mask_keywords",
    "padding_mask_keywords",
)


def register_qkv_layout(target: type[nn.Module] | str, layout: QKVLayout) -> RemovableHandle:
    """Tell every registry made afterwards (``AttentionFamilies()``, and so every monitor and
    :class:`~spectral_monitor.probes.WeightProbe` made with the default) how the attention modules ``target``
    names fuse q, k and v, so they get per-head weight metrics (``qk_spectral_norm``, per-head σ₁).

    For one monitor alone, give it ``AttentionFamilies().with_qkv_layout(target, layout)`` as its
    ``attention_families`` option instead.

    Args:
        target: a module type (kept as its import path, which matches it and its subclasses), or a str
            ``fnmatch`` pattern matched against the class name, the qualified module name
            (``"blocks.*.attn"``) and the import paths of the class and its bases. A later registration wins
            over an earlier one and over the built-in layouts; a registry's own ``with_qkv_layout`` and a
            probe's ``attention_readers`` win over all.
        layout: the :class:`QKVLayout` of their fused projection.

    Returns:
        A handle whose ``remove()`` unregisters (also a context manager). Registries made before stay as
        they are.

    Raises:
        ValueError: if ``target`` or ``layout`` is of the wrong kind.

    Examples:
        >>> with register_qkv_layout("*.mixer", QKVLayout("Wqkv", "concatenated")):
        ...     "*.mixer" in AttentionFamilies().qkv_layouts
        True
        >>> "*.mixer" in AttentionFamilies().qkv_layouts
        False
    """
    _check_qkv_layout("target", target, layout)
    handle = RemovableHandle(_REGISTERED_QKV_LAYOUTS)
    _REGISTERED_QKV_LAYOUTS[handle.id] = (qkv_layout_pattern(target), layout)
    return handle


def qkv_layout_pattern(target: type[nn.Module] | str) -> str:
    """The key :attr:`AttentionFamilies.qkv_layouts` holds for ``target``: a str as given, a type's import
    path.

    Args:
        target: a module type or a str pattern.

    Returns:
        The pattern.

    Examples:
        >>> from torch import nn
        >>> qkv_layout_pattern(nn.MultiheadAttention)
        'torch.nn.modules.activation.MultiheadAttention'
        >>> qkv_layout_pattern("blocks.*.attn")
        'blocks.*.attn'
    """
    return target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"


def _check_qkv_layout(argument: str, target: object, layout: object) -> None:
    if not (
        (isinstance(target, str) and target) or (isinstance(target, type) and issubclass(target, nn.Module))
    ):
        raise ValueError(
            f"{argument} must be an nn.Module subclass or a class-name / module-name pattern (a non-empty "
            f"str), got {target!r}"
        )
    if not isinstance(layout, QKVLayout):
        raise ValueError(
            f"{argument}: the layout for {target!r} must be a QKVLayout, got {type(layout).__name__} "
            f"{layout!r}"
        )
