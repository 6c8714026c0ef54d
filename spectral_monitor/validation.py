"""Checks of every argument the monitor takes, at construction: type and range, with a message that starts
with the argument's name and says what is allowed.

``SpectralMonitor``, its option classes (``CurvatureOptions``, ``JacobianOptions``, ``NTKOptions``,
``ProbeDataOptions``) and the alert configuration (``AlertConfig``, ``Rule``, ``Condition``) all check
through these functions. Booleans are ``bool`` (``"no"`` and ``1`` are refused), lists of names are lists
(a single string is refused, not read letter by letter), and an alert's metric pattern must match a metric
the monitor writes (:func:`known_metric_names`), with the nearest names offered when it does not.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from spectral_monitor.metrics import ATTENTION_METRICS

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
    "known_metric_names",
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


_TOKEN_METRICS = ("cosine_similarity", "token_residual", "stable_rank", "effective_rank")
_WEIGHT_METRICS = (
    "spectral_norm",
    "frobenius_norm",
    "stable_rank",
    "spectral_norm_residual",
    "qk_spectral_norm",
    "qk_spectral_norm_max",
    "mp_edge",
    "mp_spikes",
    "alpha",
    "alpha_ks_distance",
    "energy_rank_90",
    "energy_rank_99",
)
_CURVATURE_METRICS = (
    "sharpness",
    "sharpness_threshold",
    "sharpness_ratio",
    "gradient_alignment",
    "hessian_min_eigenvalue",
    "hessian_trace",
    "hessian_trace_se",
    *(f"hessian_eigenvalue_{k}" for k in range(1, 65)),
)
_JACOBIAN_METRICS = ("jacobian_norm", "residual_branch_norm", "end_to_end_norm")
_NTK_METRICS = ("ntk_trace", "ntk_max_eigenvalue", "ntk_condition_number", "ntk_effective_rank")
_OVERHEAD_METRICS = ("overhead_ms", "overhead_percent")


@functools.cache
def known_metric_names() -> frozenset[str]:
    """``family/metric`` of every scalar the monitor writes: the names alert rules may read."""
    attention = [
        f"{metric}{suffix}"
        for metric in (*ATTENTION_METRICS, "head_diversity")
        for suffix in ("", "_min", "_max")
    ]
    names = {
        "attention": attention,
        "tokens": _TOKEN_METRICS,
        "weights": _WEIGHT_METRICS,
        "curvature": (*_CURVATURE_METRICS, *_OVERHEAD_METRICS),
        "jacobian": (*_JACOBIAN_METRICS, *_OVERHEAD_METRICS),
        "ntk": (*_NTK_METRICS, *_OVERHEAD_METRICS),
        "alerts": ("open", "fired"),
    }
    return frozenset(f"{family}/{metric}" for family, metrics in names.items() for metric in metrics)


def check_metric_pattern(name: str, pattern: str, known: Iterable[str] | None = None) -> str:
    """``pattern`` if it matches at least one of ``known`` (default :func:`known_metric_names`); otherwise a
    ValueError naming ``name`` and the closest names."""
    known = sorted(known_metric_names() if known is None else known)
    if any(fnmatch.fnmatchcase(metric, pattern) for metric in known):
        return pattern
    close = difflib.get_close_matches(pattern, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    families = sorted({metric.split("/", 1)[0] for metric in known})
    raise ValueError(
        f"{name} {pattern!r} matches no metric the monitor writes (families {families}, "
        f"e.g. 'attention/entropy', 'weights/spectral_norm'){hint}"
    )
