"""Every eigenvalue of a batch of float64 Gram matrices A Aᵀ on the CPU, through whichever LAPACK is faster.

torch's CPU builds call Intel's MKL, which takes its generic code path on other vendors' processors: on a
2-core AMD EPYC, one thread, its float64 Gram product of a 1024 × 1024 matrix took 59 ms and its
``eigvalsh`` 142 ms, where numpy's OpenBLAS took 34 ms (a symmetric rank-k update, half the
multiplications) and 95 ms. From 192 rows up, and only there, numpy's was the faster of the two on that
machine; on Intel processors MKL is kept. OpenBLAS keeps a thread pool of its own, so each call runs with
torch's thread count (``openblas_set_num_threads_local``, OpenBLAS 0.3.27 and later) or not at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

HOST_LAPACK_MIN_ROWS = 192
"""The smallest Gram matrix handed to numpy's OpenBLAS where that route is open: below it torch's MKL was
as fast or faster (n = 64: 0.13 ms against 0.15 ms a matrix; n = 128 within 5%)."""


def gram_eigenvalues(matrices: Tensor) -> Tensor:
    """Every eigenvalue of each A Aᵀ of a float64 (B, n, m) batch, ascending.

    On a CPU that is not Intel's, with torch calling MKL and numpy an OpenBLAS whose thread count can be
    set per call, batches of n ≥ :data:`HOST_LAPACK_MIN_ROWS` that need no gradient go to numpy (the
    product as a symmetric rank-k update, then ``eigvalsh``) at torch's thread count; everything else to
    torch. Either way the eigenvalues are LAPACK's ``syevd`` of the float64 Gram matrix.

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
        and _openblas_thread_setter() is not None
    ):
        rows = np.ascontiguousarray(matrices.detach().numpy())
        with _openblas_threads(torch.get_num_threads()):
            # numpy recognises a matrix times its own transpose and calls syrk.
            return torch.from_numpy(np.linalg.eigvalsh(rows @ rows.transpose(0, 2, 1)))
    return torch.linalg.eigvalsh(matrices @ matrices.mT)


@contextlib.contextmanager
def _openblas_threads(count: int) -> Iterator[None]:
    setter = _openblas_thread_setter()
    previous = setter(count)
    try:
        yield
    finally:
        setter(previous)


@functools.cache
def _openblas_thread_setter() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """OpenBLAS's per-thread thread-count setter (returns the previous count) where the numpy route is to be
    taken, else None."""
    if not torch.backends.mkl.is_available() or _cpu_vendor() in ("GenuineIntel", None):
        return None
    for library in _loaded_openblas_libraries():
        with contextlib.suppress(OSError, AttributeError):
            setter = ctypes.CDLL(library).openblas_set_num_threads_local
            setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
            return setter
    return None


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
