"""Every eigenvalue of a batch of float64 Gram matrices A Aᵀ on the CPU, through whichever LAPACK is faster.

torch's CPU builds call Intel's MKL, which takes its generic code path on other vendors' processors: on a
2-core AMD EPYC, one thread, its float64 Gram product of a 1024 × 1024 matrix took 59 ms and its
``eigvalsh`` 142 ms, where numpy's OpenBLAS took 34 ms (a symmetric rank-k update, half the
multiplications) and 95 ms. From 192 rows up, and only there, numpy's was the faster of the two on that
machine; on Intel processors MKL is kept. OpenBLAS keeps a thread pool of its own, so each call runs with
torch's thread count (``openblas_set_num_threads_local``, OpenBLAS 0.3.27 and later), or the route stays
closed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

HOST_LAPACK_MIN_ROWS = 192
"""The smallest Gram matrix handed to numpy's OpenBLAS where that route is open: below it MKL's ``eigvalsh``
was as fast or faster (n = 64: 0.13 ms against 0.15 ms a matrix; n = 128 within 5%)."""


def gram_eigenvalues(matrices: Tensor) -> Tensor:
    """Every eigenvalue of each A Aᵀ of a float64 (B, n, m) batch, ascending.

    On a CPU that is not Intel's, with torch calling MKL and numpy an OpenBLAS whose thread count can be
    set per call, batches of n ≥ :data:`HOST_LAPACK_MIN_ROWS` that need no gradient go to numpy (the
    product as a symmetric rank-k update, then ``eigvalsh``) at torch's thread count; everything else to
    torch (also where numpy's ``eigvalsh`` does not converge). Either way the eigenvalues are LAPACK's
    ``syevd`` of the float64 Gram matrix.

    Args:
        matrices: float64 (B, n, m) A.

    Returns:
        (B, n) float64 eigenvalues of A Aᵀ, ascending, on ``matrices``' device.

    Examples:
        >>> import torch
        >>> gram_eigenvalues(torch.tensor([[[3.0, 0.0], [0.0, 4.0]]], dtype=torch.float64))
        tensor([[ 9., 16.]], dtype=torch.float64)
    """
    if (
        matrices.device.type == "cpu"
        and matrices.shape[1] >= HOST_LAPACK_MIN_ROWS
        and not matrices.requires_grad
        and not torch.compiler.is_compiling()
        and numpy_route_open()
    ):
        rows = matrices.detach().numpy()
        # Where numpy's LAPACK does not converge, torch's answer (or its error) is the one callers expect.
        with _openblas_threads(torch.get_num_threads()), contextlib.suppress(np.linalg.LinAlgError):
            # numpy recognises a matrix times its own transpose, in either layout, and calls syrk.
            return torch.from_numpy(np.linalg.eigvalsh(rows @ rows.transpose(0, 2, 1)))
    return torch.linalg.eigvalsh(matrices @ matrices.mT)


def numpy_route_open() -> bool:
    """Whether :func:`gram_eigenvalues` sends large CPU batches to numpy in this process: torch calls MKL, the
    processor is not Intel's, and every OpenBLAS loaded can have its thread count set per call.

    Returns:
        True where batches of :data:`HOST_LAPACK_MIN_ROWS` rows or more, without gradient, go to numpy.

    Examples:
        >>> isinstance(numpy_route_open(), bool)
        True
    """
    return bool(_openblas_thread_setters())


@contextlib.contextmanager
def _openblas_threads(count: int) -> Iterator[None]:
    setters = _openblas_thread_setters()
    previous = [setter(count) for setter in setters]
    try:
        yield
    finally:
        for setter, count_before in zip(setters, previous, strict=True):
            setter(count_before)


@functools.cache
def _openblas_thread_setters() -> tuple[Callable[[int], int], ...]:
    """The per-thread thread-count setter (which returns the previous count) of every OpenBLAS in the process
    where the numpy route is to be taken, else none. Which of them is numpy's is not known (scipy brings one
    of its own), so each is set, and the route stays closed unless each can be."""
    if not torch.backends.mkl.is_available() or _cpu_vendor() in ("GenuineIntel", None):
        return ()
    setters = []
    for library in _loaded_openblas_libraries():
        try:
            setter = ctypes.CDLL(library).openblas_set_num_threads_local
        except (OSError, AttributeError):
            return ()
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setters.append(setter)
    return tuple(setters)


def _cpu_vendor() -> str | None:
    """The first ``vendor_id`` of /proc/cpuinfo; None where there is none to read (not Linux on x86)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    return None


def _loaded_openblas_libraries() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (numpy loads its own on import)."""
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "openblas" in line.lower()}
        return sorted(path for path in paths if path.startswith("/"))
    return []
