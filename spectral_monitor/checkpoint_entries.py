"""The monitor's state read back from a checkpoint, entry by entry, each checked before it is used.

A checkpoint comes from outside the run: written by another version, edited by hand, or damaged. Each entry
of the monitor's state is checked for the type, shape and dtype its part expects, and for finite values; an
entry that fails is dropped, so that its part starts cold as in a new run, and named in ``dropped`` for the
one warning the session gives. Nothing here raises on a bad entry: the model's own checkpoint may be intact,
and a resume must not fail for the monitor. Nothing non-finite reaches a warm start either: a NaN vector
would give NaN estimates of healthy weights, and those raise the ``non_finite`` alert.

Every part with checkpoint state (the session, the weight probe, the second-order probes, the alert engine)
reads its entries through :class:`StateEntries`, so every integration that restores a session (the Lightning
callback, the plain loop, the Hugging Face callback) gets the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "StateEntries",
    "checked_generator_state",
    "checked_integer",
    "checked_number",
    "checked_tensor",
    "checked_unit_columns",
]

T = TypeVar("T")
_ABSENT: Any = object()
_UNIT_TOLERANCE = 1e-3  # far above float32 rounding of a normalised vector, far below any useful damage


class StateEntries:
    """The entries of one mapping of checkpoint state; a read that finds an unusable entry drops it.

    Args:
        state: the mapping read (None reads as empty: a part the checkpoint did not save).
        where: how the mapping is named in messages (``"weight_probe"``), "" for the top level.
        dropped: where each dropped entry is named, with why (shared by the nested mappings of one load).
    """

    def __init__(self, state: object, where: str = "", dropped: list[str] | None = None) -> None:
        self.where = where
        self.dropped = [] if dropped is None else dropped
        self._state: Mapping[Any, Any] = state if isinstance(state, Mapping) else {}
        if state is not None and not isinstance(state, Mapping):
            self.dropped.append(f"{where or 'the state'} ({_described(state)}, not a mapping)")

    def __contains__(self, key: str) -> bool:
        return key in self._state

    def holds(self, key: str) -> bool:
        """Whether the entry ``key`` is present and not None (None: a part that saved nothing)."""
        return self._state.get(key) is not None

    def name(self, key: str) -> str:
        """``key`` as messages name it: qualified by the mappings it is nested in."""
        return f"{self.where}.{key}" if self.where else key

    def drop(self, key: str, why: str) -> None:
        """Name ``key`` as dropped, with ``why``."""
        self.dropped.append(f"{self.name(key)} ({why})")

    def read(self, key: str, default: T, check: Callable[[Any], T]) -> T:
        """``check(value)`` of the entry ``key``; ``default`` when it is absent, or when ``check`` raises
        ``TypeError``, ``ValueError``, ``KeyError`` or ``AttributeError`` (the entry is then dropped, named
        with the error's message)."""
        if key not in self._state:
            return default
        try:
            return check(self._state[key])
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            self.drop(key, str(error) or type(error).__name__)
            return default

    def integer(self, key: str, default: T, *, smallest: int, optional: bool = False) -> int | T:
        """The entry ``key`` if it is an int (not a bool) >= ``smallest`` (or None, when ``optional``)."""
        return self.read(key, default, lambda value: checked_integer(value, smallest, optional))

    def number(self, key: str, default: T, *, optional: bool = False) -> float | T:
        """The entry ``key`` as a float if it is a finite int or float (or None, when ``optional``)."""
        return self.read(key, default, lambda value: checked_number(value, optional))

    def nested(self, key: str) -> StateEntries:
        """The mapping at ``key``, read the same way (empty when absent; dropped when not a mapping)."""
        value = self._state.get(key)
        if value is not None and not isinstance(value, Mapping):
            self.drop(key, f"{_described(value)}, not a mapping")
            value = None
        return StateEntries(value, self.name(key), self.dropped)

    def by_name(self, key: str, check: Callable[[Any], T]) -> dict[str, T]:
        """The mapping at ``key`` of names to entries, each ``check``ed and dropped alone if it fails."""
        entries = self.nested(key)
        kept: dict[str, T] = {}
        for name in list(entries._state):
            if not isinstance(name, str):
                entries.drop(repr(name), "the key is not a str")
                continue
            value = entries.read(name, _ABSENT, check)
            if value is not _ABSENT:
                kept[name] = value
        return kept

    def unit_vectors(self, key: str, *, ndim: int) -> dict[str, Tensor]:
        """The mapping at ``key`` of names to warm-start vectors: finite ``ndim``-D tensors whose columns
        (along dimension -2) have unit norm, as the iterative solvers leave them. A zero or scaled vector
        is dropped too: a solver started from it reports a wrong value for as long as it iterates."""
        return self.by_name(key, lambda value: checked_unit_columns(value, ndim))

    def numbers(self, key: str) -> dict[str, float]:
        """The mapping at ``key`` of names to finite numbers, as floats."""
        return self.by_name(key, checked_number)

    def generator_state(self, key: str) -> Tensor | None:
        """The entry ``key`` if a CPU ``torch.Generator`` takes it as its state (the monitor's private
        generators are CPU ones)."""
        return self.read(key, None, checked_generator_state)


def checked_integer(value: Any, smallest: int, optional: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) >= ``smallest``, or None when ``optional``; else TypeError or
    ValueError."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{_described(value)}, not an int")
    if value < smallest:
        raise ValueError(f"{value}, below {smallest}")
    return value


def checked_number(value: Any, optional: bool = False) -> float | None:
    """``value`` as a float if it is a finite int or float (not a bool), or None when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{_described(value)}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{value}, not finite")
    return float(value)


def checked_tensor(value: Any, ndim: int | None = None) -> Tensor:
    """A detached copy of ``value`` if it is a floating-point tensor of finite values (with ``ndim``
    dimensions when given); else TypeError or ValueError."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"{_described(value)}, not a floating-point tensor")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"shape {tuple(value.shape)}, not {ndim}-D")
    if value.numel() == 0:
        raise ValueError("empty")
    if not bool(value.isfinite().all()):
        raise ValueError("non-finite values")
    return value.detach().clone()


def checked_unit_columns(value: Any, ndim: int) -> Tensor:
    """:func:`checked_tensor` of ``value``, whose columns (along dimension -2) must have unit norm."""
    tensor = checked_tensor(value, ndim)
    norms = torch.linalg.vector_norm(tensor.double(), dim=-2)
    if not bool(((norms - 1).abs() < _UNIT_TOLERANCE).all()):
        raise ValueError("columns not of unit norm")
    return tensor


def checked_generator_state(value: Any) -> Tensor:
    """``value`` if a CPU ``torch.Generator`` takes it as its state; else TypeError or ValueError."""
    if not isinstance(value, Tensor) or value.dtype != torch.uint8:
        raise TypeError(f"{_described(value)}, not a uint8 tensor")
    expected = torch.Generator().get_state()
    if value.shape != expected.shape:
        raise ValueError(f"{value.numel()} bytes, not the {expected.numel()} of a generator's state")
    try:
        torch.Generator().set_state(value)
    except RuntimeError as error:
        raise ValueError(f"not a generator's state: {error}") from None
    return value.clone()


def _described(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
