"""Benchmark: the attention cost budget's cost model, measured.

For each context length n, one causal head of dimension d = 64 with near-uniform attention (q and k Gaussian
of standard deviation 0.3, as a freshly initialised model gives): the time of its training attention (forward
and backward of ``F.scaled_dot_product_attention(is_causal=True)``, per head of a batch of 4) and of
measuring its attention matrix on the path ``method="auto"`` takes there (dense up to 2048 tokens, blockwise
from q and k from 4096), with and without the rank sums. The table gives each measurement as a multiple of
the training attention: the units of ``spectral_monitor.core.attention_budget``'s cost model, whose values
are printed beside them. ``--bidirectional`` does the same for bidirectional heads, which take the dense
Krylov path from 129 tokens.

    python benchmarks/bench_attention_cost.py --contexts 256 512 1024 2048 4096
    python benchmarks/bench_attention_cost.py --bidirectional --contexts 512 640 768 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import describe_machine, markdown_table

from spectral_monitor.core.attention_budget import matrix_cost
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.metrics.attention import uses_exact_path
from spectral_monitor.metrics.long_context import attention_metrics_from_qk
from spectral_monitor.probes.attention_records import BLOCKWISE_MIN_TOKENS

HEAD_DIM = 64
HEADS = 4


def seconds(work: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(n: int, rounds: int, causal: bool) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=generator) * 0.3 for _ in range(3))

    def train() -> None:
        leaves = [tensor.clone().requires_grad_() for tensor in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=causal).sum().backward()

    unit = seconds(train, rounds) / HEADS
    blockwise = n >= BLOCKWISE_MIN_TOKENS
    cells = [str(n), f"{1000 * unit:.1f}"]
    for rank_sums in (True, False):
        if blockwise:
            spent = seconds(
                lambda rank_sums=rank_sums: attention_metrics_from_qk(
                    q[0, :1], k[0, :1], causal=causal, include_rank_sums=rank_sums
                ),
                1,
            )
        else:
            logits = q[0] @ k[0].mT / HEAD_DIM**0.5
            if causal:
                logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            probs = logits.softmax(dim=-1)
            spent = (
                seconds(
                    lambda rank_sums=rank_sums, probs=probs: attention_metrics(
                        probs, causal=causal, include_rank_sums=rank_sums
                    ),
                    1,
                )
                / HEADS
            )
        modelled = matrix_cost(
            n,
            n,
            HEAD_DIM,
            exact=uses_exact_path(n, n, "auto", causal=causal),
            blockwise=blockwise,
            rank_sums=rank_sums,
            eigen_gap=not causal,
        )
        cells += [f"{1000 * spent:.0f}", f"{spent / unit:.1f}", f"{modelled:.1f}"]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bidirectional", action="store_true", help="bidirectional heads, not causal")
    args = parser.parse_args()
    kind = "bidirectional" if args.bidirectional else "causal"
    torch.set_num_threads(1)
    print(describe_machine())
    print(f"\none {kind} head, d = {HEAD_DIM}, one thread; training attention over {args.rounds} rounds\n")
    print(
        markdown_table(
            [
                "n",
                "training attention a head (ms)",
                "measured, rank sums (ms)",
                "× training",
                "model",
                "measured, no rank sums (ms)",
                "× training",
                "model",
            ],
            [row(n, args.rounds, not args.bidirectional) for n in args.contexts],
        )
    )


if __name__ == "__main__":
    main()
