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
    """``value`` if it is an int (not a bool) in [smallest, largest]."""
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
    """``value`` if it is ``True`` or ``False``."""
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
    """``value`` as a float if it is a finite int or float (not a bool) within the bounds given."""
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
    """``value`` if it is one of ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_callable(name: str, value: object, what: str = "a callable") -> Any:
    """``value`` if it is None or callable."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be None or {what}, got {value!r}")
    return value


def check_instance(name: str, value: object, kind: type) -> Any:
    """``value`` if it is a ``kind``; None gives ``kind()``, its defaults."""
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
    """``value`` as a list if it is None or a non-empty list of non-empty ``fnmatch`` patterns."""
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
    """``value`` if it is a mapping with string keys."""
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} must be a mapping with string keys, got {value!r}")
    return value


def check_metric_pattern(name: str, pattern: str) -> str:
    """``pattern`` if it matches a metric of the catalogue (:mod:`spectral_monitor.catalog`); otherwise a
    ValueError naming ``name`` and the closest names."""
    if is_known_metric(pattern):
        return pattern
    close = close_metric_names(pattern)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    families = sorted({metric.split("/", 1)[0] for metric in metric_names()})
    raise ValueError(
        f"{name} {pattern!r} matches no metric the monitor writes (families {families}, "
        f"e.g. 'attention/entropy', 'weights/spectral_norm'){hint}"
    )
