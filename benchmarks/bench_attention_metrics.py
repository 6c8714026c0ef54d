"""Benchmark: the attention metric set against ``torch.linalg.svdvals`` alone, on real attention batches.

For each sequence length n it builds one batch of attention matrices softmax(QKᵀ/√d) from seeded Gaussian
queries and keys (d = 64) and measures, in the same run and each in a fresh process:

- ``svdvals``: ``torch.linalg.svdvals`` of the batch, the obvious alternative and the accuracy reference;
- ``metrics``: ``attention_metrics(A, method="krylov")``, the full metric set;
- ``no rank sums``: the same without effective and threshold rank (``include_rank_sums=False``), the
  spectral sums that need stochastic Lanczos quadrature;
- ``warm``: the metric set on the next step's attention (queries and keys moved by 1%), warm-started from
  the ``KrylovState`` this step's call left.

It reports the median wall time over the repeats (every call starts cold unless it is the warm case), the
peak resident-memory growth (see ``_common``), the speed-up over svdvals and the largest relative error of
σ₁, σ₂ and the effective rank in the batch against svdvals, as a Markdown table, under a line naming the
machine.

    python benchmarks/bench_attention_metrics.py                        # the full table (slow)
    python benchmarks/bench_attention_metrics.py --sizes 128 256 --batch 4   # a smoke test
    python benchmarks/bench_attention_metrics.py --qk-std 0.1 --device cuda  # near-uniform, on a GPU

On a machine other work shares, pass ``--threads 1``: two intra-op threads competing for busy cores made
the Krylov cases 10-100× slower and the table meaningless.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import CaseMeasurement, CaseSkipped, describe_machine, markdown_table, measure_in_fresh_process

from spectral_monitor.metrics import KrylovState, attention_metrics

HEAD_DIM = 64
NEXT_STEP_DRIFT = 0.01


def softmax_attention_batch(
    batch: int, n: int, seed: int, drift: float = 0.0, device: str = "cpu", std: float = 1.0
) -> torch.Tensor:
    """(batch, n, n) float32 softmax(QKᵀ/√d) of Gaussian q, k of standard deviation ``std`` on ``device``;
    ``drift`` moves q, k as a training step."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, HEAD_DIM, generator=generator)
    k = torch.randn(batch, n, HEAD_DIM, generator=generator)
    if drift:
        q = q + drift * torch.randn(q.shape, generator=generator)
        k = k + drift * torch.randn(k.shape, generator=generator)
    q, k = (std * t.to(device) for t in (q, k))
    return torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM), dim=-1)


def to_numpy(metrics: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: value.detach().to(torch.float64).cpu().numpy() for name, value in metrics.items()}


def run_svdvals(attn: torch.Tensor) -> dict[str, np.ndarray]:
    return {"singular_values": torch.linalg.svdvals(attn).to(torch.float64).cpu().numpy()}


def run_metrics(attn: torch.Tensor) -> dict[str, np.ndarray]:
    return to_numpy(attention_metrics(attn, method="krylov", generator=torch.Generator().manual_seed(0)))


def run_metrics_without_rank_sums(attn: torch.Tensor) -> dict[str, np.ndarray]:
    return to_numpy(
        attention_metrics(
            attn, method="krylov", include_rank_sums=False, generator=torch.Generator().manual_seed(0)
        )
    )


def prime_warm_state(attn: torch.Tensor) -> KrylovState:
    """This step's metrics, computed to keep their Krylov vectors (untimed)."""
    state = KrylovState()
    attention_metrics(attn, method="krylov", state=state, generator=torch.Generator().manual_seed(0))
    return state


def run_warm(attn_perturbed: torch.Tensor, state: KrylovState) -> dict[str, np.ndarray]:
    # A copy per call: the state is updated in place, and every timed call must start from this step's
    # vectors, not from the previous repeat's (already converged on the same matrix).
    return to_numpy(
        attention_metrics(
            attn_perturbed,
            method="krylov",
            state=copy.deepcopy(state),
            generator=torch.Generator().manual_seed(0),
        )
    )


def build_cold(batch: int, n: int, seed: int, device: str, std: float) -> torch.Tensor:
    return softmax_attention_batch(batch, n, seed, device=device, std=std)


def build_warm(
    batch: int, n: int, seed: int, device: str, std: float
) -> tuple[torch.Tensor, Any, np.ndarray]:
    """The next step's attention, the state primed on this step's, and the next step's exact spectrum."""
    state = prime_warm_state(softmax_attention_batch(batch, n, seed, device=device, std=std))
    attn_perturbed = softmax_attention_batch(batch, n, seed, drift=NEXT_STEP_DRIFT, device=device, std=std)
    return attn_perturbed, state, run_svdvals(attn_perturbed)["singular_values"]


def run_warm_case(inputs: tuple[torch.Tensor, Any, np.ndarray]) -> dict[str, np.ndarray]:
    attn_perturbed, state, singular_values = inputs
    return {**run_warm(attn_perturbed, state), "singular_values": singular_values}


# name -> (build(batch, n, seed, device, std) -> inputs, run(inputs) -> outputs). An output holding
# "singular_values" is compared with those (the warm case measures a different batch); every other with the
# svdvals case.
CASES: dict[str, tuple[Callable[..., Any], Callable[[Any], dict[str, np.ndarray]]]] = {
    "svdvals": (build_cold, run_svdvals),
    "metrics": (build_cold, run_metrics),
    "no rank sums": (build_cold, run_metrics_without_rank_sums),
    "warm": (build_warm, run_warm_case),
}


def reference_from_singular_values(sigma: np.ndarray) -> dict[str, np.ndarray]:
    """σ₁, σ₂ and the Roy–Vetterli effective rank of each row of (batch, n) singular values."""
    p = sigma / sigma.sum(axis=1, keepdims=True)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return {"sigma1": sigma[:, 0], "sigma2": sigma[:, 1], "effective_rank": np.exp(-plogp.sum(axis=1))}


def largest_relative_error(output: dict[str, np.ndarray], reference: dict[str, np.ndarray], name: str) -> str:
    if name not in output or np.isnan(output[name]).all():  # not computed by this case
        return "—"
    return f"{np.max(np.abs(output[name] - reference[name]) / np.abs(reference[name])):.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[128, 512, 1024, 2048],
        help="sequence lengths n (attention matrices are n×n)",
    )
    parser.add_argument("--batch", type=int, default=64, help="attention matrices per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (median reported)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--qk-std",
        type=float,
        default=1.0,
        help="std of q and k (0.1: a fresh model's near-uniform attention)",
    )
    args = parser.parse_args()
    for name in ("batch", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.sizes) < 2:
        parser.error(f"--sizes must all be >= 2 (σ₂ needs two singular values), got {args.sizes}")

    torch.set_num_threads(args.threads)
    print(describe_machine())
    print(
        f"Attention: softmax(QKᵀ/√{HEAD_DIM}) of seeded Gaussian q, k of std {args.qk_std}; float32; "
        f"batch {args.batch}; device {args.device}; "
        f"median of {args.repeats} calls; peak = resident-memory growth over the inputs, fresh process.\n"
    )

    headers = [
        "n",
        "case",
        "median time (s)",
        "svdvals time / case time",
        "peak memory (MiB)",
        "σ₁ rel. err",
        "σ₂ rel. err",
        "eff. rank rel. err",
    ]
    print(markdown_table(headers, []), flush=True)  # rows follow as each case finishes
    for n in args.sizes:
        baseline: CaseMeasurement | None = None
        for name, (build, run) in CASES.items():
            try:
                result = measure_in_fresh_process(
                    functools.partial(build, args.batch, n, args.seed, args.device, args.qk_std),
                    run,
                    repeats=args.repeats,
                    threads=args.threads,
                )
            except (CaseSkipped, RuntimeError) as reason:
                print(f"| {n} | {name} | {type(reason).__name__}: {reason} |" + " |" * 5, flush=True)
                continue
            baseline = result if name == "svdvals" else baseline
            if baseline is None:
                raise SystemExit(f"n={n}: the svdvals baseline did not run")
            print(table_row(n, name, result, baseline), flush=True)


def table_row(n: int, name: str, result: CaseMeasurement, baseline: CaseMeasurement) -> str:
    if name == "svdvals":
        errors = ["(reference)"] * 3
    else:
        exact = result.output.get("singular_values", baseline.output["singular_values"])
        reference = reference_from_singular_values(exact)
        errors = [
            largest_relative_error(result.output, reference, metric)
            for metric in ("sigma1", "sigma2", "effective_rank")
        ]
    peak = "n/a" if result.peak_bytes is None else f"{result.peak_bytes / 2**20:.1f}"
    speedup = baseline.median_seconds / result.median_seconds
    cells = [str(n), name, f"{result.median_seconds:.4f}", f"{speedup:.2f}", peak, *errors]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
