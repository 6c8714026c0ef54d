"""The curvature probe's memory and time on GPT-2 and the nanoGPT-style model, against a training step's,
and against the estimate the probe refuses by (``spectral_monitor.core.curvature_budget``).

Each case runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` low, so that freed tensors leave the
resident set and a thread sampling ``/proc/self/statm`` every 0.5 ms follows the allocations: the peak over
the resident set before the model was built, for an AdamW training step and for one curvature event
(``measure_curvature`` with the preset's options and the given ``max_products``). The estimate is computed
in the same process, as the probe computes it before its first event, and compared with each growth over
the resident set just before it (the parameters and the optimizer state, resident through both, left out
of the estimate's side; the peaks also hold the interpreter's and the libraries' own memory, which the
estimate does not count).

    python benchmarks/bench_curvature_budget.py --models gpt2 nanogpt --context 256 --max-products 32 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from _common import describe_machine, markdown_table
from _external_models import model_and_loss, token_batch

from spectral_monitor.core.curvature_budget import (
    estimate_curvature_memory,
    saved_activation_bytes,
    stretched_interval,
)
from spectral_monitor.core.options import FULL_OVERHEAD_PERCENT
from spectral_monitor.core.second_order import CurvatureOptions
from spectral_monitor.probes._autodiff import probing
from spectral_monitor.probes.curvature import ParameterSpace, measure_curvature

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_MB


class PeakResident:
    """The largest resident set seen while the block runs."""

    def __enter__(self) -> PeakResident:
        self.peak, self._stop = resident_mb(), False

        def watch() -> None:
            while not self._stop:
                self.peak = max(self.peak, resident_mb())
                time.sleep(0.0005)

        self._thread = threading.Thread(target=watch)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, resident_mb())


def worker(name: str, context: int, batch: int, max_products: int) -> dict[str, float]:
    torch.set_num_threads(1)
    before_model = resident_mb()
    model, loss_of = model_and_loss(name, context)
    tokens = token_batch(batch, context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> None:
        loss_of(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # the optimizer state exists, as at any event after the first
    steps = []
    idle_before_step = resident_mb()
    with PeakResident() as step_peak:
        for _ in range(3):
            started = time.perf_counter()
            train_step()
            steps.append(time.perf_counter() - started)
    options = CurvatureOptions(max_products=max_products)
    loss = lambda: loss_of(model, tokens)  # noqa: E731
    with probing(model, "eval"):
        activations = saved_activation_bytes(loss, model.parameters())
    space = ParameterSpace.of(model)
    estimate = estimate_curvature_memory(model, [space.size], options, optimizer, activations)
    idle_before_probe = resident_mb()
    with PeakResident() as probe_peak:
        started = time.perf_counter()
        result = measure_curvature(
            model, loss, optimizer=optimizer, max_products=max_products, tol=options.tol
        )
        event = time.perf_counter() - started
    step = sorted(steps)[1]
    # What stays resident through both (the parameters and AdamW's moments) is left out of each side.
    resident = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**20
    return {
        "step_mb": step_peak.peak - before_model,
        "probe_mb": probe_peak.peak - before_model,
        "step_growth_mb": step_peak.peak - idle_before_step,
        "probe_growth_mb": probe_peak.peak - idle_before_probe,
        "estimate_step_growth_mb": estimate.step_bytes / 2**20 - resident,
        "estimate_probe_growth_mb": estimate.probe_bytes / 2**20 - resident,
        "estimate_step_mb": estimate.step_bytes / 2**20,
        "estimate_probe_mb": estimate.probe_bytes / 2**20,
        "products": result.products,
        "converged": float(result.converged),
        "step_s": step,
        "event_s": event,
        "interval": stretched_interval(100, event, step, FULL_OVERHEAD_PERCENT),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["gpt2", "nanogpt"], choices=["gpt2", "nanogpt"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-products", nargs="+", type=int, default=[32, 8])
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, context, batch, max_products = args.worker
        print(json.dumps(worker(name, int(context), int(batch), int(max_products))))
        return
    rows = []
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for name in args.models:
        for max_products in args.max_products:
            command = [sys.executable, __file__, "--worker", name, str(args.context), str(args.batch)]
            output = subprocess.run(
                [*command, str(max_products)], check=True, capture_output=True, text=True, env=environment,
                cwd=Path(__file__).parent,
            ).stdout  # fmt: skip
            r = json.loads(output.strip().splitlines()[-1])
            rows.append(
                [
                    name,
                    str(max_products),
                    f"{r['step_mb']:.0f}",
                    f"{r['probe_mb']:.0f}",
                    f"{r['step_growth_mb']:.0f} / {r['estimate_step_growth_mb']:.0f}",
                    f"{r['probe_growth_mb']:.0f} / {r['estimate_probe_growth_mb']:.0f}",
                    f"{r['probe_mb'] / r['step_mb']:.1f}× / "
                    f"{r['estimate_probe_mb'] / r['estimate_step_mb']:.1f}×",
                    f"{r['products']:.0f} ({'converged' if r['converged'] else 'not converged'})",
                    f"{r['step_s']:.2f}",
                    f"{r['event_s']:.1f} ({r['event_s'] / r['step_s']:.0f}×)",
                    f"{r['interval']:.0f}",
                ]
            )
    print(describe_machine())
    print(f"\ncontext {args.context}, batch {args.batch}, AdamW, one thread\n")
    header = [
        "model",
        "max_products",
        "step peak MiB",
        "probe peak MiB",
        "step growth MiB (measured / estimated)",
        "probe growth MiB (measured / estimated)",
        "probe / step",
        "products",
        "step s",
        "event s (× step)",
        f"steps between events at {FULL_OVERHEAD_PERCENT:g}%",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
