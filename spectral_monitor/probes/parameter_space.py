"""The coordinates a Hessian or Jacobian acts on: chosen parameters of a module, or packed parts of them.

:class:`ParameterSpace` flattens a selection of parameters into one coordinate vector (and back), so the
curvature and NTK probes see an operator over ℝⁿ; :data:`BLOCK_PRESETS` names the usual blocks of a
transformer's parameters (query, key, value, attention output, MLP, embeddings, norms).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["BLOCK_PRESETS", "ParameterSpace"]

_PACKED_PART = re.compile(r"^(?P<pattern>.*)\[(?P<part>[qkv])\]$")
_PACKED_INDEX = {"q": 0, "k": 1, "v": 2}

BLOCK_PRESETS: dict[str, tuple[str, ...]] = {
    "query": (
        "*in_proj_weight[q]",
        "*in_proj_bias[q]",
        "*qkv.weight[q]",
        "*qkv.bias[q]",
        "*q_proj.*",
        "*attention.self.query.*",
    ),
    "key": (
        "*in_proj_weight[k]",
        "*in_proj_bias[k]",
        "*qkv.weight[k]",
        "*qkv.bias[k]",
        "*k_proj.*",
        "*attention.self.key.*",
    ),
    "value": (
        "*in_proj_weight[v]",
        "*in_proj_bias[v]",
        "*qkv.weight[v]",
        "*qkv.bias[v]",
        "*v_proj.*",
        "*attention.self.value.*",
    ),
    "attention_output": (
        "*self_attn.out_proj.*",
        "*attention.output.weight",
        "*attention.output.bias",
        "*o_proj.*",
        "*attn.c_proj.*",
        "*attention.output.dense.*",
    ),
    "mlp": ("*linear1.*", "*linear2.*", "*mlp.*", "*mlp.c_fc.*", "*intermediate.dense.*", "*output.dense.*"),
    "embeddings": ("*embedding*", "*embed*", "*wte.*", "*wpe.*"),
    "norms": ("*norm*", "*ln_*", "*LayerNorm*"),
}
"""Parameter-name patterns of the blocks a Hessian can be restricted to (``fnmatch``; ``[q]``, ``[k]``,
``[v]`` select the first, second or third of the rows of a packed projection such as
``nn.MultiheadAttention.in_proj_weight``): PyTorch's own transformer layers, the demo model, and Hugging Face
BERT/GPT-2/Llama naming. A preset that matches nothing in a model is an error when asked for."""


@dataclass(frozen=True)
class _Coordinates:
    name: str
    parameter: nn.Parameter
    rows: slice | None  # a packed part (a third of the rows), or the whole parameter

    @property
    def shape(self) -> torch.Size:
        return self.parameter[self.rows].shape if self.rows is not None else self.parameter.shape


class ParameterSpace:
    """The flat coordinate vector of chosen parameters (or packed parts of them) a Hessian acts on.

    Made by :meth:`of`. Coordinates follow the order of the selection, each parameter (or part) flattened in
    row-major order; a parameter chosen twice (tied, or by two patterns) counts once.

    Args:
        coordinates: The chosen parameters or packed parts of them, as :meth:`of` selects them.

    Attributes:
        coordinates: The chosen parts, in order.
        parameters: The distinct parameters they belong to, in order of first use.
        sizes: The number of coordinates of each part.
        size: n, the dimension of the space.
        dtype: The first parameter's dtype.
        device: The first parameter's device.

    Raises:
        ValueError: If ``coordinates`` is empty.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> attention = nn.MultiheadAttention(4, 1)
        >>> space = ParameterSpace.of(attention, ["in_proj_weight[k]", "out_proj.bias"])
        >>> space.names(), space.size
        (['in_proj_weight[4:8]', 'out_proj.bias'], 20)
        >>> flat = torch.arange(20.0)[None]
        >>> [tuple(tensor.shape) for tensor in space.unflatten(flat)]
        [(1, 12, 4), (1, 4)]
        >>> torch.equal(space.flatten(space.unflatten(flat)), flat)
        True
    """

    def __init__(self, coordinates: Sequence[_Coordinates]) -> None:
        if not coordinates:
            raise ValueError("a ParameterSpace needs at least one parameter")
        self.coordinates = tuple(coordinates)
        self.parameters = list({id(c.parameter): c.parameter for c in coordinates}.values())
        self.sizes = [c.shape.numel() for c in self.coordinates]
        self.size = sum(self.sizes)
        first = self.parameters[0]
        self.dtype, self.device = first.dtype, first.device

    @classmethod
    def of(cls, module: nn.Module, patterns: Sequence[str] | None = None) -> ParameterSpace:
        """The space of ``module``'s parameters that require grad, or of those ``patterns`` select.

        Args:
            module: The module whose parameters are chosen (by their qualified names).
            patterns: ``fnmatch`` patterns over parameter names; one ending in ``[q]``, ``[k]`` or ``[v]``
                takes that third of the rows of a packed query/key/value projection (a parameter chosen
                whole as well is taken whole). None: every parameter that requires grad.

        Returns:
            The space, in the order of the patterns (of ``named_parameters`` within one).

        Raises:
            ValueError: If a ``[q]``/``[k]``/``[v]`` pattern matches a parameter whose rows do not split in
                three, or the patterns match no parameter that requires grad.
        """
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if patterns is None:
            return cls([_Coordinates(name, p, None) for name, p in named])
        chosen: dict[tuple[str, int | None], _Coordinates] = {}
        for pattern in patterns:
            packed = _PACKED_PART.match(pattern)
            glob = packed["pattern"] if packed else pattern
            for name, parameter in named:
                if not fnmatch.fnmatchcase(name, glob):
                    continue
                if packed is None:
                    chosen.setdefault((name, None), _Coordinates(name, parameter, None))
                    continue
                third, remainder = divmod(parameter.shape[0], 3)
                if remainder:
                    raise ValueError(
                        f"pattern {pattern!r}: {name} has {parameter.shape[0]} rows, not 3 parts"
                    )
                index = _PACKED_INDEX[packed["part"]]
                chosen.setdefault(
                    (name, index), _Coordinates(name, parameter, slice(index * third, (index + 1) * third))
                )
        whole = {name for name, index in chosen if index is None}
        kept = [c for (name, index), c in chosen.items() if index is None or name not in whole]
        if not kept:
            raise ValueError(f"patterns {list(patterns)} match no parameter that requires grad")
        return cls(kept)

    def names(self) -> list[str]:
        """The parameter names of the coordinates, in order; a packed part as ``name[start:stop]`` (its rows).

        Returns:
            One name per part.
        """
        return [
            c.name if c.rows is None else f"{c.name}[{c.rows.start}:{c.rows.stop}]" for c in self.coordinates
        ]

    def flatten(self, per_parameter: Sequence[Tensor]) -> Tensor:
        """The coordinates of a batch of k parameter-shaped tensors.

        Args:
            per_parameter: One tensor (k, *parameter.shape) per entry of :attr:`parameters`, in order.

        Returns:
            (k, size): the chosen parts of each, concatenated; a new tensor.
        """
        by_id = {id(p): t for p, t in zip(self.parameters, per_parameter, strict=True)}
        parts = []
        for c in self.coordinates:
            tensor = by_id[id(c.parameter)]
            if c.rows is not None:
                tensor = tensor[:, c.rows]
            parts.append(tensor.reshape(tensor.shape[0], -1))
        return torch.cat(parts, dim=1)

    def unflatten(self, flat: Tensor) -> list[Tensor]:
        """Parameter-shaped tensors from a batch of k coordinate vectors: the inverse of :meth:`flatten`.

        Args:
            flat: (k, size).

        Returns:
            One tensor (k, *parameter.shape) per entry of :attr:`parameters`, in the parameter's dtype, zero
            outside the chosen rows of a packed parameter.
        """
        k = flat.shape[0]
        full = {id(p): None for p in self.parameters}
        pieces = flat.split(self.sizes, dim=1)
        for c, piece in zip(self.coordinates, pieces, strict=True):
            piece = piece.reshape(k, *c.shape).to(c.parameter.dtype)
            if c.rows is None:
                full[id(c.parameter)] = piece
                continue
            if full[id(c.parameter)] is None:
                full[id(c.parameter)] = piece.new_zeros((k, *c.parameter.shape))
            full[id(c.parameter)][:, c.rows] = piece
        return [full[id(p)] for p in self.parameters]

    def values(self) -> Tensor:
        """The current parameter values at the chosen coordinates.

        Returns:
            (size,), detached (a copy).
        """
        return self.flatten([p.detach()[None] for p in self.parameters])[0]
