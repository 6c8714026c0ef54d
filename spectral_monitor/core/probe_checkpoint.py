"""The second-order probes' checkpoint entries: the probe batch's types that a resume can rebuild, and the
curvature warm vectors with the layout of the parameters they were made over."""

from __future__ import annotations

import io
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


def checked_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"a {type(value).__name__}, not a list")
    return value


def checked_curvature_warm(entry: Any) -> dict[str, Any]:
    """A layer's curvature warm start from a checkpoint: the layout of its parameters and finite vectors."""
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
    """A ValueError unless ``torch.load(weights_only=True)``, how Lightning reads a checkpoint to resume, can
    rebuild ``batches``: a container type it does not allow (a namedtuple, a dataclass) in the checkpoint
    would make the whole resume fail. Checked on their structure, every tensor replaced by an empty one."""
    structure = apply_to_collection(batches, Tensor, lambda tensor: torch.empty(0))
    buffer = io.BytesIO()
    torch.save(structure, buffer)
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
    vectors = {f.name: getattr(warm, f.name) for f in fields(warm)}
    return {name: tensor for name, tensor in vectors.items() if tensor is not None}


def layout_of(space: ParameterSpace) -> Layout:
    """The parameter names and shapes a space's coordinates come from: what must match for warm vectors made
    in another process (restored from a checkpoint) to belong to this space."""
    return [(name, tuple(c.shape)) for name, c in zip(space.names(), space.coordinates, strict=True)]
