"""The random blocks the solvers start from and probe with, and the dtype they compute in.

Every draw comes from a generator the solver holds, never from the global RNG, so monitoring a run does not
change its random stream.
"""

from __future__ import annotations

import torch
from torch import Tensor


def working_dtype(dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype iterative methods compute in: ``requested`` if given, else at least float32.

    Args:
        dtype: The operator's dtype.
        requested: The dtype a caller asked for, or ``None``.

    Returns:
        ``requested``, else float64 for a float64 operator and float32 for any other floating dtype.

    Raises:
        ValueError: ``requested`` is given and not floating, or ``dtype`` is not floating.

    Examples:
        >>> import torch
        >>> working_dtype(torch.bfloat16), working_dtype(torch.float64)
        (torch.float32, torch.float64)
        >>> working_dtype(torch.int8, requested=torch.float64)
        torch.float64
    """
    if requested is not None:
        if not requested.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {requested}")
        return requested
    if not dtype.is_floating_point:
        raise ValueError(f"expected a floating dtype, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def rademacher(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> Tensor:
    """±1 entries, drawn from ``generator`` (never the global RNG when a generator is given).

    Args:
        shape: The shape of the draw.
        dtype: The dtype of the result.
        device: The device of the result (the draw is made on the generator's).
        generator: The generator to draw from, or ``None`` for the global RNG.

    Returns:
        A tensor of ``shape`` with entries −1 and 1.

    Examples:
        >>> import torch
        >>> signs = rademacher((1000,), dtype=torch.float32, device="cpu", generator=torch.Generator())
        >>> sorted(signs.unique().tolist()), signs.dtype
        ([-1.0, 1.0], torch.float32)
    """
    bits = torch.randint(0, 2, shape, generator=generator, device=generator.device if generator else device)
    return bits.to(device=device, dtype=dtype) * 2 - 1


def gaussian(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> Tensor:
    """Standard normal entries, drawn from ``generator`` (never the global RNG when a generator is given).

    Args:
        shape: The shape of the draw.
        dtype: The dtype of the draw and the result.
        device: The device of the result (the draw is made on the generator's).
        generator: The generator to draw from, or ``None`` for the global RNG.

    Returns:
        A tensor of ``shape`` with independent N(0, 1) entries.

    Examples:
        >>> import torch
        >>> gaussian((2, 3), dtype=torch.float64, device="cpu", generator=torch.Generator()).shape
        torch.Size([2, 3])
    """
    draw_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=draw_device, dtype=dtype).to(device)


def default_generator(device: torch.device, seed: int = 0) -> torch.Generator:
    """A private generator, so solvers never consume the user's global RNG stream.

    Args:
        device: The device the draws are meant for; the generator is a CPU one whatever it is, since the
            draws are made on the generator's device and moved.
        seed: The seed.

    Returns:
        A CPU ``torch.Generator`` seeded with ``seed``: the same draws at every call.

    Examples:
        >>> import torch
        >>> first = torch.randn(2, generator=default_generator(torch.device("cpu")))
        >>> torch.equal(first, torch.randn(2, generator=default_generator(torch.device("cpu"))))
        True
    """
    return torch.Generator(device="cpu").manual_seed(seed)


def independent_seeds(generator: torch.Generator | None, count: int) -> list[int]:
    """``count`` seeds drawn from ``generator`` (``None``: :func:`default_generator`), for estimates that each
    need a generator of their own: how much one of them draws then cannot change another's draws.

    Args:
        generator: The source of the seeds; ``None`` for :func:`default_generator`.
        count: How many seeds.

    Returns:
        The seeds, in [0, 2⁶²).

    Examples:
        >>> import torch
        >>> independent_seeds(None, 2) == independent_seeds(torch.Generator().manual_seed(0), 2)
        True
    """
    source = generator if generator is not None else default_generator(torch.device("cpu"))
    return torch.randint(0, 2**62, (count,), generator=source, device=source.device).tolist()
