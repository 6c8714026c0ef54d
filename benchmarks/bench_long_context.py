"""Long-context attention metrics: time and peak memory against n, blockwise from q and k against dense.

For each n, one causal head softmax(q kᵀ/√64) of seeded Gaussian q, k, in a fresh process:

- ``blockwise``: ``attention_metrics_from_qk(q, k, causal=True, max_bytes=budget)``;
- ``dense``: the probabilities formed from q and k, then ``attention_metrics(probs, method="krylov")``, where
  they fit in ``--dense-max-n``; above it the dense path's peak is extrapolated as c·n² from the largest
  measured n and marked so.

Peak memory is resident-set growth over the inputs (``benchmarks/_common.py`` says why not tracemalloc);
each case is timed once, after a small warm-up call, with the memory measurement on the same call (buffers
over 128 KiB mapped per allocation, which costs page faults: times are upper bounds). Writes a Markdown
table to stdout and ``bench_long_context.png`` (log-log) next to this file.

    PYTHONPATH=$PWD python benchmarks/bench_long_context.py --sizes 1024 2048 4096 8192 16384
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import time
from pathlib import Path

import torch
from _common import (
    FIXED_MMAP_THRESHOLD,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    _peak_resident_bytes,
    _reset_peak_resident,
    _resident_bytes,
    describe_machine,
    markdown_table,
)

HEAD_DIM = 64


def _inputs(n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    return (
        torch.randn(1, 1, n, HEAD_DIM, generator=generator).to(device),
        torch.randn(1, 1, n, HEAD_DIM, generator=generator).to(device),
    )


def _blockwise(q: torch.Tensor, k: torch.Tensor, budget: int, rank_sums: bool) -> dict[str, float]:
    from spectral_monitor.metrics import attention_metrics_from_qk

    result = attention_metrics_from_qk(q, k, causal=True, max_bytes=budget, include_rank_sums=rank_sums)
    return {name: float(value.flatten()[0]) for name, value in result.items()}


def _dense(q: torch.Tensor, k: torch.Tensor, budget: int, rank_sums: bool) -> dict[str, float]:
    from spectral_monitor.metrics import attention_metrics

    n = q.shape[2]
    logits = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
    probs = torch.softmax(
        logits.masked_fill_(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -torch.inf), dim=-1
    )
    del logits
    result = attention_metrics(probs, causal=True, method="krylov", include_rank_sums=rank_sums)
    return {name: float(value.flatten()[0]) for name, value in result.items()}


CASES = {"blockwise": _blockwise, "dense": _dense}


def _child(case: str, n: int, budget: int, rank_sums: bool, threads: int, device: str, sender) -> None:
    try:
        torch.set_num_threads(threads)
        CASES[case](*_inputs(512, device), budget, rank_sums)  # lazy initialisation out of the measurement
        q, k = _inputs(n, device)
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, 0)
        libc.malloc_trim(0)
        baseline = _resident_bytes()
        _reset_peak_resident()
        start = time.perf_counter()
        output = CASES[case](q, k, budget, rank_sums)
        seconds = time.perf_counter() - start
        sender.send(("ok", seconds, _peak_resident_bytes() - baseline, output))
    except Exception as error:
        sender.send(("failed", f"{type(error).__name__}: {error}", None, None))


def measure(
    case: str, n: int, budget: int, rank_sums: bool, threads: int, device: str = "cpu"
) -> tuple[float, int, dict]:
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(case, n, budget, rank_sums, threads, device, sender))
    process.start()
    sender.close()
    status, seconds, peak, output = receiver.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(seconds)
    return seconds, peak, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--dense-max-n", type=int, default=4096)
    parser.add_argument("--rank-sums", action="store_true", help="include effective and threshold rank")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    arguments = parser.parse_args()
    budget = int(arguments.budget_mb * 2**20)

    print(describe_machine())
    print(
        f"One causal head, d = {HEAD_DIM}, device {arguments.device}, budget {arguments.budget_mb:g} MiB, "
        "rank sums "
        f"{'on' if arguments.rank_sums else 'off'}; peak = resident-set growth over the inputs, "
        "fresh process.\n"
    )
    rows, points = [], {"blockwise": [], "dense": [], "dense (extrapolated)": []}
    last_dense: tuple[int, int] | None = None
    for n in arguments.sizes:
        seconds, peak, output = measure(
            "blockwise", n, budget, arguments.rank_sums, arguments.threads, arguments.device
        )
        points["blockwise"].append((n, seconds, peak))
        dense_time, dense_peak, note, sigma_error = "—", "—", "", "—"
        if n <= arguments.dense_max_n:
            dense_seconds, peak_dense, dense_output = measure(
                "dense", n, budget, arguments.rank_sums, arguments.threads, arguments.device
            )
            points["dense"].append((n, dense_seconds, peak_dense))
            last_dense = (n, peak_dense)
            dense_time, dense_peak = f"{dense_seconds:.2f}", f"{peak_dense / 2**20:.1f}"
            sigma_error = f"{abs(output['sigma2'] - dense_output['sigma2']) / dense_output['sigma2']:.1e}"
        elif last_dense is not None:
            extrapolated = last_dense[1] * (n / last_dense[0]) ** 2
            points["dense (extrapolated)"].append((n, float("nan"), extrapolated))
            dense_peak, note = f"{extrapolated / 2**20:.0f}", " (extrapolated c·n²)"
        rows.append(
            [
                str(n),
                f"{seconds:.2f}",
                f"{peak / 2**20:.1f}",
                dense_time,
                dense_peak + note,
                f"{4 * n * n / 2**20:.0f}",
                sigma_error,
            ]
        )
        print(f"n = {n}: blockwise {seconds:.2f} s, {peak / 2**20:.1f} MiB", flush=True)
    print()
    print(
        markdown_table(
            [
                "n",
                "blockwise time (s)",
                "blockwise peak (MiB)",
                "dense time (s)",
                "dense peak (MiB)",
                "one head's probs (MiB)",
                "σ₂ blockwise vs dense",
            ],
            rows,
        )
    )
    _figure(points, budget, Path(__file__).with_name("bench_long_context.png"))


def _figure(points: dict[str, list[tuple[int, float, float]]], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for label, series in points.items():
        if not series:
            continue
        sizes = [n for n, _, _ in series]
        style = "--" if "extrapolated" in label else "-"
        if "extrapolated" not in label:
            time_axis.loglog(sizes, [seconds for _, seconds, _ in series], "o" + style, label=label)
        memory_axis.loglog(sizes, [peak / 2**20 for _, _, peak in series], "o" + style, label=label)
    memory_axis.axhline(budget / 2**20, color="grey", linestyle=":", label="budget")
    time_axis.set(xlabel="n (tokens)", ylabel="time (s)", title="time, one head")
    memory_axis.set(xlabel="n (tokens)", ylabel="peak extra memory (MiB)", title="peak memory, one head")
    for axis in (time_axis, memory_axis):
        axis.legend()
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"\nfigure: {path}")


if __name__ == "__main__":
    main()
