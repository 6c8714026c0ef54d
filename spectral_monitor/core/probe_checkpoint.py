"""The second-order probes' checkpoint entries: the probe batch's types that a resume can rebuild, and the
curvature warm vectors with the layout of the parameters they were made over."""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from spectral_monitor.checkpoint_entries import checked_tensor
from spectral_monitor.probes.curvature import CurvatureWarmStart, ParameterSpace

__all__ = ["Layout", "check_resumable", "checked_curvature_warm", "checked_list", "layout_of", "vectors_of"]

Layout = list[tuple[str, tuple[int, ...]]]
"""The ``(qualified parameter name, shape)`` of each part of a parameter space, in its coordinate order."""


def checked_list(value: Any) -> list[Any]:
    """``value`` itself if it is a list: the probe batches entry of a checkpoint.

    Args:
        value: what the checkpoint holds.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: if ``value`` is not a list.

    Examples:
        >>> checked_list([1, 2])
        [1, 2]
        >>> checked_list((1, 2))
        Traceback (most recent call last):
        TypeError: a tuple, not a list
    """
    if not isinstance(value, list):
        raise TypeError(f"a {type(value).__name__}, not a list")
    return value


def checked_curvature_warm(entry: Any) -> dict[str, Any]:
    """A layer's curvature warm start from a checkpoint: the layout of its parameters and finite vectors.

    Args:
        entry: a mapping with ``"layout"``, a list of ``(parameter name, shape)``, and any of the
            :class:`~spectral_monitor.probes.curvature.CurvatureWarmStart` fields (``"top"``, ``"bottom"``,
            ``"preconditioned"``); a field absent or None is left out.

    Returns:
        ``{"layout": [(name, shape tuple), ...], field: detached copy of its tensor, ...}``.

    Raises:
        TypeError: if ``entry`` is not a mapping, its layout not a list of (str, ints), or a vector not a
            floating-point tensor.
        ValueError: if a vector is empty or holds non-finite values.

    Examples:
        >>> import torch
        >>> entry = {"layout": [("weight", [2, 3])], "top": torch.ones(6, 1), "bottom": None}
        >>> checked = checked_curvature_warm(entry)
        >>> checked["layout"], sorted(checked)
        ([('weight', (2, 3))], ['layout', 'top'])
    """
    if not isinstance(entry, Mapping):
        raise TypeError(f"a {type(entry).__name__}, not a mapping")
    layout = [(name, tuple(shape)) for name, shape in entry["layout"]]
    sizes = [size for _, shape in layout for size in shape]
    if not all(isinstance(name, str) for name, _ in layout) or not all(isinstance(n, int) for n in sizes):
        raise TypeError("its layout is not a list of (parameter name, shape)")
    vectors = {
        f.name: checked_tensor(entry[f.name])
        for f in fields(CurvatureWarmStart)
        if entry.get(f.name) is not None
    }
    return {"layout": layout, **vectors}


def check_resumable(batches: list[Any]) -> None:
    """Check that ``torch.load(weights_only=True)``, how Lightning reads a checkpoint to resume, can rebuild
    ``batches``: a container type it does not allow (a namedtuple, a dataclass) in the checkpoint would make
    the whole resume fail. Checked on their structure, every tensor replaced by an empty one.

    Args:
        batches: the probe batches to be kept in the checkpoint.

    Raises:
        ValueError: if the batches hold a type that ``weights_only`` loading refuses (the message names it
            and the ``torch.serialization.add_safe_globals`` call that lets it in), or an object that cannot
            be pickled at all (a function, a generator).

    Examples:
        >>> import torch
        >>> check_resumable([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}, (torch.ones(2), [1, 2])])
        >>> from fractions import Fraction
        >>> check_resumable([{"x": torch.ones(2), "weight": Fraction(1, 2)}])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: the probe batch holds fractions.Fraction, which torch.load(weights_only=True) refuses, ...
    """
    structure = apply_to_collection(batches, Tensor, lambda tensor: torch.empty(0))
    buffer = io.BytesIO()
    try:
        torch.save(structure, buffer)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ValueError(
            f"the probe batch cannot be saved in a checkpoint ({error}): it is left out, and a resumed run "
            "takes a new probe batch at its first event"
        ) from error
    buffer.seek(0)
    refused = torch.serialization.get_unsafe_globals_in_checkpoint(buffer)
    if refused:
        raise ValueError(
            f"the probe batch holds {', '.join(refused)}, which torch.load(weights_only=True) refuses, so "
            "Lightning could not resume from a checkpoint holding it: it is left out, and a resumed run "
            "takes a new probe batch at its first event. "
            f"torch.serialization.add_safe_globals([{refused[0]}]) lets it in"
        )


def vectors_of(warm: CurvatureWarmStart) -> dict[str, Tensor]:
    """The vectors a warm start holds, by field name, for its checkpoint entry.

    Args:
        warm: a layer's curvature warm start.

    Returns:
        Field name → tensor, for each field that is not None.

    Examples:
        >>> import torch
        >>> sorted(vectors_of(CurvatureWarmStart(top=torch.ones(4, 1))))
        ['top']
    """
    vectors = {f.name: getattr(warm, f.name) for f in fields(warm)}
    return {name: tensor for name, tensor in vectors.items() if tensor is not None}


def layout_of(space: ParameterSpace) -> Layout:
    """The parameter names and shapes a space's coordinates come from: what must match for warm vectors made
    in another process (restored from a checkpoint) to belong to this space.

    Args:
        space: the parameter space a Hessian acts on.

    Returns:
        Each coordinate block's name (a packed part as ``name[start:stop]``) and shape, in order.

    Examples:
        >>> from torch import nn
        >>> layout_of(ParameterSpace.of(nn.Linear(3, 2)))
        [('weight', (2, 3)), ('bias', (2,))]
    """
    return [(name, tuple(c.shape)) for name, c in zip(space.names(), space.coordinates, strict=True)]
