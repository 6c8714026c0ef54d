"""Benchmark: every eigenvalue of float64 Gram matrices A Aᵀ, torch (the float64 product and
``torch.linalg.eigvalsh``) against ``spectral_monitor.linalg.host_lapack.gram_eigenvalues``.

Square A of n = 64 … 1536 (a batch of 2048 / n of them), one torch thread. Where the route to numpy's
OpenBLAS is closed (an Intel processor, torch without MKL, an OpenBLAS whose thread count cannot be set per
call) both columns are torch, and the table says so. Both are timed alternately in one process on the same
matrices, and must agree within 1e-12 of the largest eigenvalue.

    python benchmarks/bench_host_lapack.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import describe_machine, markdown_table

from spectral_monitor.linalg import host_lapack

SIZES = (64, 128, 192, 256, 384, 512, 1024, 1536)


def torch_gram_eigenvalues(matrices: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvalsh(matrices @ matrices.mT)


def seconds(function, matrices: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    values = function(matrices)
    return time.perf_counter() - start, values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    route_open = host_lapack.numpy_route_open()
    rows = []
    for n in SIZES:
        batch = max(1, 2048 // n)
        matrices = torch.randn(batch, n, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        takes_route = route_open and n >= host_lapack.HOST_LAPACK_MIN_ROWS
        torch_times, route_times = [], []
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            elapsed, reference = seconds(torch_gram_eigenvalues, matrices)
            torch_times.append(elapsed)
            elapsed, values = seconds(host_lapack.gram_eigenvalues, matrices)
            route_times.append(elapsed)
            error = float((values - reference).abs().max() / reference.abs().max())
            if error > 1e-12:
                raise SystemExit(f"the eigenvalues differ at n = {n}: {error:.1e} of the largest")
        torch_ms = 1000 * statistics.median(torch_times[1:]) / batch
        route_ms = 1000 * statistics.median(route_times[1:]) / batch
        rows.append(
            [
                str(n),
                str(batch),
                f"{torch_ms:.3f}",
                f"{route_ms:.3f}",
                "numpy (OpenBLAS)" if takes_route else "torch",
                f"{route_ms / torch_ms:.2f}×",
            ]
        )
    print(describe_machine())
    print(
        f"\nroute to numpy's OpenBLAS {'open' if route_open else 'closed'}; median of {args.repeats} "
        "alternating calls each, per matrix, one thread\n"
    )
    print(
        markdown_table(
            ["n", "batch", "torch (ms)", "gram_eigenvalues (ms)", "taken by", "gram_eigenvalues / torch"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
