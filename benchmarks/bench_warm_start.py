"""Benchmark: do the Krylov vectors kept from one logging step cut the products of the next, in training?

The demo model, bidirectional (so its attention takes the Krylov path above 128 tokens and has an eigen gap),
is trained on associative recall at ``--tokens`` tokens with AdamW. Every ``--every`` steps the attention of
its sampled sequences is captured, and each layer's matrices are measured twice by ``attention_metrics``
(``method="krylov"``): warm, from the vectors its previous logging step kept (as the monitor does), and cold.
The table gives, per logging step and summed over layers, the products of the σ₁, σ₂ Lanczos (the part a warm
start can shorten), every product with A the call spent (Lanczos, Arnoldi and rank sums), the seconds, and the
largest σ₂ difference between the two.

    python benchmarks/bench_warm_start.py --tokens 512 --steps 200 --every 20
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import describe_machine, markdown_table

import spectral_monitor.metrics.attention_krylov as attention_krylov
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.linalg import DenseOperator
from spectral_monitor.metrics import KrylovState, attention_metrics
from spectral_monitor.probes import AttentionCapture


class ProductCounts:
    """Counts the σ₁, σ₂ Lanczos products and every product with a dense attention batch, while installed."""

    def __init__(self) -> None:
        self.lanczos = 0
        self.all = 0
        self._top_singular = attention_krylov.top_singular
        self._methods = {name: getattr(DenseOperator, name) for name in ("matmat", "rmatmat", "gram_matmat")}

    def __enter__(self) -> ProductCounts:
        def top_singular(*args, **kwargs):
            result = self._top_singular(*args, **kwargs)
            self.lanczos += result.info.products
            return result

        attention_krylov.top_singular = top_singular
        for name, method in self._methods.items():
            products = 2 if name == "gram_matmat" else 1

            def counted(operator, x, method=method, products=products):
                self.all += products * x.shape[0] * x.shape[-1]
                return method(operator, x)

            setattr(DenseOperator, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        attention_krylov.top_singular = self._top_singular
        for name, method in self._methods.items():
            setattr(DenseOperator, name, method)


def measured(probs: torch.Tensor, state: KrylovState | None) -> tuple[int, int, float, torch.Tensor]:
    with ProductCounts() as counts:
        start = time.perf_counter()
        metrics = attention_metrics(probs, method="krylov", state=state)
        seconds = time.perf_counter() - start
    return counts.lanczos, counts.all, seconds, metrics["sigma2"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DemoTransformer(vocab_size=160, d_model=64, n_layers=2, n_heads=4, seq_len=args.tokens,
                            causal=False, lr=3e-3, seed=0)  # fmt: skip
    data = SyntheticDataModule(vocab_size=160, seq_len=args.tokens, batch_size=4, num_batches=args.steps,
                               num_pairs=8)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    states: dict[str, KrylovState] = {}
    rows = []
    for step, (tokens, targets) in enumerate(data.train_dataloader()):
        if step % args.every == 0:
            with torch.no_grad(), AttentionCapture(model, max_sequences=2).armed() as recording:
                model(tokens)
            cells = [0, 0, 0.0, 0, 0, 0.0, 0.0]
            for captured in recording.captured:
                probs = captured.sample().probs
                state = states.setdefault(captured.layer, KrylovState())
                warm_start = state.vectors is not None
                warm = measured(probs, state)
                cold = measured(probs, None)
                for index, value in enumerate((*warm[:3], *cold[:3])):
                    cells[index] += value
                cells[6] = max(cells[6], float((warm[3] - cold[3]).abs().max()))
            rows.append(
                [str(step), "warm" if warm_start else "cold (first)", *map(str, cells[:2]), f"{cells[2]:.2f}",
                 *map(str, cells[3:5]), f"{cells[5]:.2f}", f"{cells[6]:.1e}"]
            )  # fmt: skip
        logits = model(tokens).flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(describe_machine())
    print(
        f"\nbidirectional demo model, 2 layers, 4 heads, n = {args.tokens}, 2 sequences, every {args.every}\n"
    )
    print(
        markdown_table(
            [
                "step",
                "start",
                "warm: Lanczos products",
                "all products",
                "s",
                "cold: Lanczos products",
                "all products",
                "s",
                "largest σ₂ difference",
            ],
            rows,
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
