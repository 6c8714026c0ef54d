"""An attention module's query, key and value projections as tensors: how they are read and split into heads.

The built-in readers (:data:`BUILT_IN_READERS`) find the projections by name, count the heads by the
attribute names of an :class:`~spectral_monitor.probes.AttentionFamilies` registry (which lists the layouts
they read), and hand back an :class:`AttentionWeights`, whose rows this module checks split into the heads.

Weights are read as stored: detached, a parametrized weight (``torch.nn.utils.parametrize``) as its
``original``, because evaluating the parametrization can change its state (``spectral_norm`` runs a power
iteration on every evaluation in training mode); a sharded parameter outside
``spectral_monitor.distributed.full_parameters`` (FSDP2's DTensor, a freed FSDP flat parameter view) is not
read at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn
from torch.nn.utils import parametrize

if TYPE_CHECKING:
    from spectral_monitor.probes.attention_families import AttentionFamilies

__all__ = [
    "BUILT_IN_READERS",
    "PACKED_PROJECTION_NAMES",
    "AttentionWeights",
    "AttentionWeightsReader",
    "check_head_split",
    "first_int",
    "fused_projection_name",
    "is_positive_int",
    "plain_weight",
    "stored_weight",
    "weights_or_none",
]

_CONV1D_CLASS_NAME = "Conv1D"  # transformers.pytorch_utils.Conv1D, by name: transformers stays optional
PACKED_PROJECTION_NAMES = ("c_attn", "qkv")
"""Children holding [W_Q; W_K; W_V] packed as rows (a ``Conv1D`` ``c_attn``: as columns), split once the
module declares its head count."""
_SEPARATE_PROJECTION_NAMES = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("q_lin", "k_lin", "v_lin"),
)
_FUSED_PROJECTION_NAMES = ("query_key_value", "Wqkv", "W_pack", "c_attn")
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

    Examples:
        >>> import torch
        >>> weights = AttentionWeights(torch.ones(8, 4), torch.ones(4, 4), None, num_heads=4,
        ...                            num_key_value_heads=2)
        >>> weights.key_value_heads, [role for role, _, _ in weights.projections()]
        (2, ['q', 'k'])
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
        """The projections with their roles and head counts.

        Yields:
            ``(role, weight, heads)`` for ``"q"``, ``"k"`` and ``"v"`` (when there is a value projection).
        """
        yield "q", self.query, self.num_heads
        yield "k", self.key, self.key_value_heads
        if self.value is not None:
            yield "v", self.value, self.key_value_heads


AttentionWeightsReader = Callable[[nn.Module], AttentionWeights | None]
"""``reader(module)`` -> the module's projections (detached views of its weights), or ``None`` when the module
is not attention after all (its submodules are then measured as plain weights)."""


def stored_weight(module: nn.Module, name: str) -> Tensor | None:
    """The weight ``name`` of ``module`` as stored (a parametrized one's ``original``), detached.

    Args:
        module: the module holding the weight.
        name: the weight's attribute name (``"weight"``, ``"in_proj_weight"``).

    Returns:
        The weight, or ``None`` where it is missing or cannot be read as a matrix: not a 2-D floating-point
        tensor, lazy, empty, on the meta device, or a shard (FSDP2's DTensor, a freed FSDP flat parameter
        view).

    Examples:
        >>> from torch import nn
        >>> stored_weight(nn.Linear(3, 2), "weight").shape
        torch.Size([2, 3])
    """
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
        or type(weight).__name__ == "DTensor"
        or weight.untyped_storage().size() == 0
    ):
        return None
    return weight.detach()


def plain_weight(module: nn.Module | None) -> Tensor | None:
    """The (out, in) weight of an ``nn.Linear`` or a Hugging Face ``Conv1D``, as stored and detached.

    Args:
        module: any module (or ``None``).

    Returns:
        The weight (a ``Conv1D``'s transposed: it stores (in, out)), or ``None`` for another kind of module
        or a weight that cannot be read (:func:`stored_weight`).

    Examples:
        >>> from torch import nn
        >>> plain_weight(nn.Linear(3, 2)).shape, plain_weight(nn.ReLU())
        (torch.Size([2, 3]), None)
    """
    if isinstance(module, nn.Linear):
        return stored_weight(module, "weight")
    if type(module).__name__ == _CONV1D_CLASS_NAME:
        weight = stored_weight(module, "weight")
        return None if weight is None else weight.t()
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

    Examples:
        >>> import torch
        >>> check_head_split(torch.ones(8, 4), torch.ones(6, 4), None, 4, 2)
        Traceback (most recent call last):
        ...
        ValueError: query and key heads must have one width d_k, got 2 and 3
    """
    if not (is_positive_int(heads) and is_positive_int(key_heads)):
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


def is_positive_int(value: object) -> bool:
    """Whether ``value`` is an int of at least 1 (a bool is not).

    Args:
        value: anything.

    Returns:
        True for 1, 2, …; False for 0, negative ints, bools and everything else.

    Examples:
        >>> is_positive_int(2), is_positive_int(True), is_positive_int(2.0)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _describe(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def fused_projection_name(module: nn.Module) -> str | None:
    """The name of ``module``'s child that looks like a fused q/k/v projection, if it has one.

    Args:
        module: an attention module that no layout split.

    Returns:
        The first child named ``qkv...`` (any case), ``query_key_value``, ``Wqkv``, ``W_pack`` or ``c_attn``
        that is an ``nn.Linear`` or ``Conv1D`` with a usable weight, or ``None``.

    Examples:
        >>> from torch import nn
        >>> attention = nn.Module()
        >>> attention.W_pack = nn.Linear(4, 12)
        >>> fused_projection_name(attention)
        'W_pack'
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


# The readers look for submodules in ``_modules`` before asking for attributes: ``nn.Module.__getattr__``
# raising for a name a module lacks is most of what reading a model's modules costs.


def _read_multihead_attention(families: AttentionFamilies, module: nn.Module) -> AttentionWeights | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if module.in_proj_weight is not None:
        packed = stored_weight(module, "in_proj_weight")
        if packed is None:
            return None
        query, key, value = packed.chunk(3)
    else:
        query, key, value = (stored_weight(module, f"{role}_proj_weight") for role in ("q", "k", "v"))
        if query is None or key is None:
            return None
    return weights_or_none(query, key, value, module.num_heads)


def _read_gpt2_attention(families: AttentionFamilies, module: nn.Module) -> AttentionWeights | None:
    packed = module._modules.get("c_attn")
    if type(packed).__name__ != _CONV1D_CLASS_NAME:
        return None
    heads = getattr(module, "num_heads", None)
    if not is_positive_int(heads):
        return None
    packed_weight = plain_weight(packed)
    if packed_weight is None:
        return None
    if getattr(module, "is_cross_attention", False):
        query = plain_weight(getattr(module, "q_attn", None))
        if query is None:
            return None
        key, value = packed_weight.chunk(2)
        return weights_or_none(query, key, value, heads, replaces=("c_attn", "q_attn"))
    query, key, value = packed_weight.chunk(3)
    return weights_or_none(query, key, value, heads, replaces=("c_attn",))


def _read_packed_linear_attention(families: AttentionFamilies, module: nn.Module) -> AttentionWeights | None:
    if not any(isinstance(module._modules.get(name), nn.Linear) for name in PACKED_PROJECTION_NAMES):
        return None
    heads = families.declared_head_count(module)
    if heads is None:
        return None
    for name in PACKED_PROJECTION_NAMES:
        projection = module._modules.get(name)
        if isinstance(projection, nn.Linear):
            weight = stored_weight(projection, "weight")
            if weight is None or weight.shape[0] % 3:
                return None
            query, key, value = weight.chunk(3)
            return weights_or_none(query, key, value, heads, replaces=(name,))
    return None


def _read_separate_projection_attention(
    families: AttentionFamilies, module: nn.Module
) -> AttentionWeights | None:
    for names in _SEPARATE_PROJECTION_NAMES:
        projections = [module._modules.get(name) for name in names]
        if all(isinstance(projection, nn.Linear) for projection in projections[:2]):
            break
    else:
        return None
    query, key = (stored_weight(projection, "weight") for projection in projections[:2])
    value = stored_weight(projections[2], "weight") if isinstance(projections[2], nn.Linear) else None
    if query is None or key is None:
        return None
    head_dim = first_int((module,), families.head_width_attributes)
    if head_dim is None:
        heads = families.declared_head_count(module)
        if heads is None or query.shape[0] % heads:
            return None
        head_dim = query.shape[0] // heads
    if query.shape[0] % head_dim or key.shape[0] % head_dim:
        return None
    replaces = tuple(
        name for name, projection in zip(names, projections, strict=True) if isinstance(projection, nn.Linear)
    )
    return weights_or_none(query, key, value, query.shape[0] // head_dim, key.shape[0] // head_dim, replaces)


BUILT_IN_READERS: tuple[Callable[[AttentionFamilies, nn.Module], AttentionWeights | None], ...] = (
    _read_multihead_attention,
    _read_gpt2_attention,
    _read_packed_linear_attention,
    _read_separate_projection_attention,
)
"""The layouts every registry reads after its fused ones, in the order tried: ``reader(families, module)``
reads with ``families``' attribute names."""


def weights_or_none(
    query: Tensor,
    key: Tensor,
    value: Tensor | None,
    heads: int,
    key_heads: int | None = None,
    replaces: tuple[str, ...] = (),
) -> AttentionWeights | None:
    """A reader's result: the projections, or ``None`` when they do not split into the module's heads.

    Such a module is not that layout after all; its submodules are measured as plain weights.

    Args:
        query: (H·d_k, d_q).
        key: (H_k·d_k, d_kv).
        value: (H_k·d_v, d_v_in), or ``None``.
        heads: H.
        key_heads: H_k (``None`` = H).
        replaces: the submodules the projections come from, relative to the attention module.

    Returns:
        The :class:`AttentionWeights`, or ``None``.

    Examples:
        >>> import torch
        >>> weights_or_none(torch.ones(6, 4), torch.ones(6, 4), None, 4) is None
        True
    """
    try:
        return AttentionWeights(query, key, value, heads, key_heads, replaces)
    except ValueError:
        return None


def first_int(owners: Sequence[object], names: Sequence[str]) -> int | None:
    """The first positive int attribute ``names`` holds on the first owner that has one.

    Args:
        owners: a module and, say, its ``config`` (``None`` entries have no attributes).
        names: attribute names, in the order they are tried.

    Returns:
        The int, or ``None`` when no owner has a positive int under any of the names.

    Examples:
        >>> from torch import nn
        >>> first_int([nn.MultiheadAttention(8, 2)], ["n_head", "num_heads"])
        2
    """
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if is_positive_int(value):
                return value
    return None
