"""The second-order probes' checkpoint entries: the probe batch's types that a resume can rebuild."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["check_resumable", "checked_list"]


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
