"""Checks of every argument the monitor takes, at construction: type and range, with a message that starts
with the argument's name and says what is allowed.

``SpectralMonitor``, its option classes (``CurvatureOptions``, ``JacobianOptions``, ``NTKOptions``,
``ProbeDataOptions``) and the alert configuration (``AlertConfig``, ``Rule``, ``Condition``) all check
through these functions. Booleans are ``bool`` (``"no"`` and ``1`` are refused), lists of names are lists
(a single string is refused, not read letter by letter), and an alert's metric pattern must match a metric
the monitor writes (:mod:`spectral_monitor.catalog`), with the nearest names offered when it does not.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from spectral_monitor.catalog import close_metric_names, is_known_metric, metric_names

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_instance",
    "check_int",
    "check_mapping",
    "check_metric_pattern",
    "check_names",
    "check_number",
    "check_patterns",
]


def check_int(name: str, value: object, *, smallest: int, largest: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in [smallest, largest].

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.
        smallest: The least allowed value.
        largest: The greatest allowed value; None for no upper bound.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not an int, is a bool, or lies outside [smallest, largest].

    Examples:
        >>> check_int("max_layers", 4, smallest=1)
        4
        >>> check_int("max_layers", 0, smallest=1, largest=8)
        Traceback (most recent call last):
        ...
        ValueError: max_layers must be an int in [1, 8], got 0
    """
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < smallest
        or (largest is not None and value > largest)
    ):
        allowed = f"an int >= {smallest}" if largest is None else f"an int in [{smallest}, {largest}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given; ``1``, ``"yes"`` and other truthy values are refused.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not a bool.

    Examples:
        >>> check_bool("enabled", False)
        False
        >>> check_bool("enabled", 1)
        Traceback (most recent call last):
        ...
        ValueError: enabled must be a bool (True or False), got 1
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_number(
    name: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    unit: str = "number",
) -> float:
    """``value`` as a float if it is a finite int or float (not a bool) within the bounds given.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.
        above: A strict lower bound (``value > above``); None for none.
        at_least: An inclusive lower bound (``value ≥ at_least``); None for none.
        below: A strict upper bound (``value < below``); None for none.
        unit: What the number is, as the message names it (``"number"``, ``"fraction"``, …).

    Returns:
        ``float(value)``.

    Raises:
        ValueError: ``value`` is not an int or float, is a bool, is NaN or infinite, or breaks a bound.

    Examples:
        >>> check_number("tolerance", 1, above=0)
        1.0
        >>> check_number("fraction", 1.5, at_least=0, below=1, unit="fraction")
        Traceback (most recent call last):
        ...
        ValueError: fraction must be a finite fraction >= 0 and < 1, got 1.5
    """
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    within = is_number and math.isfinite(value)
    within = within and (above is None or value > above) and (at_least is None or value >= at_least)
    within = within and (below is None or value < below)
    if not within:
        bounds = [
            f"> {above:g}" if above is not None else "",
            f">= {at_least:g}" if at_least is not None else "",
            f"< {below:g}" if below is not None else "",
        ]
        allowed = " and ".join(bound for bound in bounds if bound)
        raise ValueError(f"{name} must be a finite {unit}{' ' + allowed if allowed else ''}, got {value!r}")
    return float(value)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """``value`` if it is one of ``allowed``.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.
        allowed: The strings accepted.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not a string in ``allowed``.

    Examples:
        >>> check_choice("severity", "warning", ("info", "warning", "critical"))
        'warning'
        >>> check_choice("severity", "fatal", ("info", "warning"))
        Traceback (most recent call last):
        ...
        ValueError: severity must be one of ('info', 'warning'), got 'fatal'
    """
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_callable(name: str, value: object, what: str = "a callable") -> Any:
    """``value`` if it is None or callable.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.
        what: What a callable ``value`` stands for, as the message names it.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is neither None nor callable.

    Examples:
        >>> check_callable("loss_fn", None) is None
        True
        >>> check_callable("loss_fn", 3, "a loss function")
        Traceback (most recent call last):
        ...
        ValueError: loss_fn must be None or a loss function, got 3
    """
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be None or {what}, got {value!r}")
    return value


def check_instance(name: str, value: object, kind: type) -> Any:
    """``value`` if it is a ``kind``; None gives ``kind()``, its defaults.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given: an instance of ``kind`` or None.
        kind: The class required, constructible without arguments.

    Returns:
        ``value``, or a new ``kind()`` when ``value`` is None.

    Raises:
        ValueError: ``value`` is neither None nor an instance of ``kind``.

    Examples:
        >>> from fractions import Fraction
        >>> check_instance("ratio", None, Fraction)
        Fraction(0, 1)
        >>> check_instance("ratio", 0.5, Fraction)
        Traceback (most recent call last):
        ...
        ValueError: ratio must be a Fraction or None, got float 0.5
    """
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__} {value!r}")
    return value


def check_names(
    name: str,
    value: object,
    *,
    allowed: Collection[str] | None = None,
    non_empty: bool = False,
    what: str = "names",
) -> list[str]:
    """``value`` as a list if it is a list (or tuple) of non-empty strings, drawn from ``allowed`` if given.

    A string alone is refused: ``"token_collapse"`` is one name, and a list of its letters is not meant.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.
        allowed: The names accepted; None accepts any non-empty string.
        non_empty: Whether an empty list is refused.
        what: What the names are, as the message names them.

    Returns:
        A new list of the names, in the order given.

    Raises:
        ValueError: ``value`` is a string or not a sequence, holds an empty or non-string entry, is empty
            where ``non_empty``, or names something outside ``allowed``.

    Examples:
        >>> check_names("families", ("attention", "weights"), allowed=["attention", "weights", "ntk"])
        ['attention', 'weights']
        >>> check_names("families", "attention")
        Traceback (most recent call last):
        ...
        ValueError: families must be a list of names, got 'attention'
    """
    is_list = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    if not is_list or (non_empty and not value) or not all(isinstance(v, str) and v for v in value):
        allowed_text = f" drawn from {list(allowed)}" if allowed is not None else ""
        emptiness = "a non-empty" if non_empty else "a"
        raise ValueError(f"{name} must be {emptiness} list of {what}{allowed_text}, got {value!r}")
    if allowed is not None:
        unknown = [v for v in value if v not in allowed]
        if unknown:
            raise ValueError(f"{name} must be drawn from {list(allowed)}; {unknown} are not")
    return list(value)


def check_patterns(name: str, value: object) -> list[str] | None:
    """``value`` as a list if it is None or a non-empty list of non-empty ``fnmatch`` patterns.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given: None, or a list (or tuple) of patterns over module names.

    Returns:
        None for None, otherwise a new list of the patterns.

    Raises:
        ValueError: ``value`` is a string, not a sequence, empty, or holds an empty or non-string entry.

    Examples:
        >>> check_patterns("layers", ("blocks.0*",))
        ['blocks.0*']
        >>> check_patterns("layers", None) is None
        True
    """
    if value is None:
        return None
    is_list = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    if not is_list or not value or not all(isinstance(p, str) and p for p in value):
        raise ValueError(
            f"{name} must be None or a non-empty list of fnmatch patterns over module names "
            f"(e.g. ['blocks.0*']), got {value!r}"
        )
    return list(value)


def check_mapping(name: str, value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping with string keys.

    Args:
        name: The argument's name, which starts the error message.
        value: What was given.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``value`` is not a mapping, or has a key that is not a string.

    Examples:
        >>> check_mapping("overrides", {"threshold": 0.5})
        {'threshold': 0.5}
        >>> check_mapping("overrides", {1: 0.5})
        Traceback (most recent call last):
        ...
        ValueError: overrides must be a mapping with string keys, got {1: 0.5}
    """
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} must be a mapping with string keys, got {value!r}")
    return value


def check_metric_pattern(name: str, pattern: str) -> str:
    """``pattern`` if it matches a metric of the catalogue (:mod:`spectral_monitor.catalog`).

    Args:
        name: What the pattern is for, which starts the error message (``"rule 'x' metric"``).
        pattern: A metric name or ``fnmatch`` pattern over metric names (``"weights/*"``).

    Returns:
        ``pattern``, unchanged.

    Raises:
        ValueError: ``pattern`` matches no metric the monitor writes; the message lists the families and
            offers the closest names.

    Examples:
        >>> check_metric_pattern("metric", "weights/*")
        'weights/*'
        >>> check_metric_pattern("metric", "attention/entropie")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: metric 'attention/entropie' matches no metric ...; did you mean 'attention/entropy' ...?
    """
    if is_known_metric(pattern):
        return pattern
    close = close_metric_names(pattern)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    families = sorted({metric.split("/", 1)[0] for metric in metric_names()})
    raise ValueError(
        f"{name} {pattern!r} matches no metric the monitor writes (families {families}, "
        f"e.g. 'attention/entropy', 'weights/spectral_norm'){hint}"
    )
