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

    A ``state`` that is neither a mapping nor None reads as empty and is itself named in ``dropped``.

    Args:
        state: The mapping read (None reads as empty: a part the checkpoint did not save).
        where: How the mapping is named in messages (``"weight_probe"``), "" for the top level.
        dropped: Where each dropped entry is named, with why (shared by the nested mappings of one load); a
            new list when None.

    Attributes:
        where: As given.
        dropped: The list of dropped entries, appended to by every read that fails.

    Examples:
        >>> import torch
        >>> state = {"step": 7, "scale": float("nan"), "probe": {"u": {"fc": torch.ones(3, 1)}}}
        >>> entries = StateEntries(state)
        >>> entries.integer("step", 0, smallest=0)
        7
        >>> entries.number("scale", 1.0)
        1.0
        >>> entries.nested("probe").unit_vectors("u", ndim=2)
        {}
        >>> entries.dropped
        ['scale (nan, not finite)', 'probe.u.fc (columns not of unit norm)']
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
        """Whether the entry ``key`` is present and not None (None: a part that saved nothing).

        Args:
            key: The entry's key.

        Returns:
            True if the mapping holds ``key`` with a value other than None.
        """
        return self._state.get(key) is not None

    def name(self, key: str) -> str:
        """``key`` as messages name it: qualified by the mappings it is nested in.

        Args:
            key: The entry's key.

        Returns:
            ``"<where>.<key>"``, or ``key`` at the top level.
        """
        return f"{self.where}.{key}" if self.where else key

    def drop(self, key: str, why: str) -> None:
        """Name ``key`` as dropped, with ``why``: appends ``"<name> (<why>)"`` to ``dropped``.

        Args:
            key: The entry's key.
            why: What was wrong with it, as the warning says it.
        """
        self.dropped.append(f"{self.name(key)} ({why})")

    def read(self, key: str, default: T, check: Callable[[Any], T]) -> T:
        """``check(value)`` of the entry ``key``; ``default`` when it is absent or ``check`` refuses it.

        A refusal is ``TypeError``, ``ValueError``, ``KeyError`` or ``AttributeError`` from ``check``: the
        entry is then dropped, named with the error's message. Any other exception propagates.

        Args:
            key: The entry's key.
            default: What an absent or refused entry reads as.
            check: Takes the stored value and returns the value to use, or raises one of the errors above.

        Returns:
            ``check`` of the stored value, or ``default``.
        """
        if key not in self._state:
            return default
        try:
            return check(self._state[key])
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            self.drop(key, str(error) or type(error).__name__)
            return default

    def integer(self, key: str, default: T, *, smallest: int, optional: bool = False) -> int | T:
        """The entry ``key`` if it is an int (not a bool) ≥ ``smallest`` (or None, when ``optional``).

        Args:
            key: The entry's key.
            default: What an absent or refused entry reads as.
            smallest: The least allowed value.
            optional: Whether a stored None is kept (as None) rather than dropped.

        Returns:
            The stored int (or None), or ``default``.
        """
        return self.read(key, default, lambda value: checked_integer(value, smallest, optional))

    def number(self, key: str, default: T, *, optional: bool = False) -> float | T:
        """The entry ``key`` as a float if it is a finite int or float (or None, when ``optional``).

        Args:
            key: The entry's key.
            default: What an absent or refused entry reads as.
            optional: Whether a stored None is kept (as None) rather than dropped.

        Returns:
            The stored number as a float (or None), or ``default``.
        """
        return self.read(key, default, lambda value: checked_number(value, optional))

    def nested(self, key: str) -> StateEntries:
        """The mapping at ``key``, read the same way (empty when absent; dropped when not a mapping).

        Args:
            key: The entry's key.

        Returns:
            A :class:`StateEntries` named ``name(key)`` that shares this one's ``dropped``.
        """
        value = self._state.get(key)
        if value is not None and not isinstance(value, Mapping):
            self.drop(key, f"{_described(value)}, not a mapping")
            value = None
        return StateEntries(value, self.name(key), self.dropped)

    def by_name(self, key: str, check: Callable[[Any], T]) -> dict[str, T]:
        """The mapping at ``key`` of names to entries, each ``check``ed and dropped alone if it fails.

        Args:
            key: The entry's key; its value is read as :meth:`nested` reads it.
            check: Applied to each value, as :meth:`read` applies it. A key that is not a str is dropped.

        Returns:
            A new dict of the names whose values ``check`` accepted, to what it returned.
        """
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
        """The mapping at ``key`` of names to warm-start vectors, as the iterative solvers leave them.

        Each must be a finite ``ndim``-D floating-point tensor whose columns (along dimension -2) have unit
        norm. A zero or scaled vector is dropped too: a solver started from it reports a wrong value for as
        long as it iterates.

        Args:
            key: The entry's key.
            ndim: The number of dimensions each tensor must have.

        Returns:
            A new dict of names to detached copies of the accepted tensors.
        """
        return self.by_name(key, lambda value: checked_unit_columns(value, ndim))

    def numbers(self, key: str) -> dict[str, float]:
        """The mapping at ``key`` of names to finite numbers, as floats.

        Args:
            key: The entry's key.

        Returns:
            A new dict of names to the accepted numbers, as floats.
        """
        return self.by_name(key, checked_number)

    def generator_state(self, key: str) -> Tensor | None:
        """The entry ``key`` if a CPU ``torch.Generator`` takes it as its state.

        The monitor's private generators are CPU ones.

        Args:
            key: The entry's key.

        Returns:
            A copy of the uint8 state tensor, or None when absent or refused.
        """
        return self.read(key, None, checked_generator_state)


def checked_integer(value: Any, smallest: int, optional: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) ≥ ``smallest``, or None when ``optional``.

    Args:
        value: The stored value.
        smallest: The least allowed value.
        optional: Whether None is accepted.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``value`` is not an int, is a bool, or is None where not ``optional``.
        ValueError: ``value`` is below ``smallest``.

    Examples:
        >>> checked_integer(3, 0), checked_integer(None, 0, optional=True)
        (3, None)
        >>> checked_integer(True, 0)
        Traceback (most recent call last):
        ...
        TypeError: bool True, not an int
    """
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{_described(value)}, not an int")
    if value < smallest:
        raise ValueError(f"{value}, below {smallest}")
    return value


def checked_number(value: Any, optional: bool = False) -> float | None:
    """``value`` as a float if it is a finite int or float (not a bool), or None when ``optional``.

    Args:
        value: The stored value.
        optional: Whether None is accepted.

    Returns:
        ``float(value)``, or None.

    Raises:
        TypeError: ``value`` is not an int or float, is a bool, or is None where not ``optional``.
        ValueError: ``value`` is NaN or infinite.

    Examples:
        >>> checked_number(2)
        2.0
        >>> checked_number(float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: inf, not finite
    """
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{_described(value)}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{value}, not finite")
    return float(value)


def checked_tensor(value: Any, ndim: int | None = None) -> Tensor:
    """A detached copy of ``value`` if it is a non-empty floating-point tensor of finite values.

    Args:
        value: The stored value.
        ndim: The number of dimensions required; None for any.

    Returns:
        ``value.detach().clone()``: same dtype, shape and device.

    Raises:
        TypeError: ``value`` is not a floating-point tensor.
        ValueError: ``value`` has other than ``ndim`` dimensions, no elements, or a NaN or infinite entry.

    Examples:
        >>> import torch
        >>> checked_tensor(torch.zeros(2, 3), ndim=2).shape
        torch.Size([2, 3])
        >>> checked_tensor(torch.tensor([1.0, float("nan")]))
        Traceback (most recent call last):
        ...
        ValueError: non-finite values
    """
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
    """:func:`checked_tensor` of ``value``, whose columns (along dimension -2) must have unit norm.

    Each column's Euclidean norm, computed in float64, must be within 10⁻³ of 1.

    Args:
        value: The stored value.
        ndim: The number of dimensions required.

    Returns:
        A detached copy of ``value``.

    Raises:
        ValueError: A column's norm is off 1, or as :func:`checked_tensor` raises it.

    Examples:
        >>> import torch
        >>> checked_unit_columns(torch.eye(3)[:, :2], ndim=2).shape
        torch.Size([3, 2])
        >>> checked_unit_columns(2 * torch.eye(3), ndim=2)
        Traceback (most recent call last):
        ...
        ValueError: columns not of unit norm
    """
    tensor = checked_tensor(value, ndim)
    norms = torch.linalg.vector_norm(tensor.double(), dim=-2)
    if not bool(((norms - 1).abs() < _UNIT_TOLERANCE).all()):
        raise ValueError("columns not of unit norm")
    return tensor


def checked_generator_state(value: Any) -> Tensor:
    """``value`` if a CPU ``torch.Generator`` takes it as its state.

    Args:
        value: The stored value.

    Returns:
        A copy of ``value``.

    Raises:
        TypeError: ``value`` is not a uint8 tensor.
        ValueError: ``value`` has another shape than a CPU generator's state, or the generator refuses it.

    Examples:
        >>> import torch
        >>> state = torch.Generator().manual_seed(0).get_state()
        >>> bool(checked_generator_state(state).equal(state))
        True
        >>> checked_generator_state(torch.zeros(3, dtype=torch.uint8))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: 3 bytes, not the ... of a generator's state
    """
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
