"""The curvature probe at the edge of stability, against the exact top eigenvalue of the float64 Hessian.

Full-batch gradient descent on a tanh MLP fitting a random teacher (MSE), with the callback's curvature
family on (every ``--every`` steps, each event from a fresh random start). At every curvature event the
model's parameters are copied before the step; afterwards the Hessian of the same loss at those parameters
is formed explicitly in float64 (``torch.autograd.functional.hessian``) and its top eigenvalues come from a
dense symmetric eigensolver (LAPACK ``syevr``). Printed per learning rate: events, the largest relative
error of the logged sharpness, how many events are above 1e-3, how many the probe flagged as not converged,
the products per event, and the range of the logged and of the exact edge-of-stability ratio λ₁η/2 once at
the edge (the second half of the run).

    PYTHONPATH=$PWD python benchmarks/eos_accuracy.py                       # η = 0.8 and 1.2, 2000 steps
    PYTHONPATH=$PWD python benchmarks/eos_accuracy.py --steps 600 --lr 0.8
"""

from __future__ import annotations

import argparse
import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import scipy.linalg
import torch
from pytorch_lightning.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.core.second_order import CurvatureOptions

TOLERANCE = 1e-3


class FullBatchRegression(pl.LightningModule):
    """A 3-layer tanh MLP (8 → hidden → hidden → 4) trained by plain gradient descent on one batch; the
    parameters are copied at the start of every step the curvature probe measures."""

    def __init__(self, hidden: int, learning_rate: float, every: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 4)
        )
        self.learning_rate, self.every = learning_rate, every
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if step == 0 or (step + 1) % self.every == 0:
            self.snapshots[step] = {name: p.detach().clone() for name, p in self.net.named_parameters()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


class ScalarsKept(Logger):
    """Every scalar logged, by name, as (step, value)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars: dict[str, dict[int, float]] = {}

    @property
    def name(self) -> str:
        return "kept"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            self.scalars.setdefault(name, {})[int(step or 0)] = float(value)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def teacher_data() -> DataLoader:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        y = 3 * teacher(x)
    return DataLoader(TensorDataset(x, y), batch_size=64)


@dataclass
class Event:
    step: int
    logged: float
    exact: float
    converged: bool
    products: float

    @property
    def error(self) -> float:
        return abs(self.logged - self.exact) / abs(self.exact)


def exact_top_eigenvalue(model: FullBatchRegression, parameters: dict[str, torch.Tensor]) -> float:
    """λ₁ of the explicit float64 Hessian of the full-batch loss at ``parameters``."""
    net = copy.deepcopy(model.net).double()
    x, y = (t.double() for t in next(iter(teacher_data())))
    names = [name for name, _ in net.named_parameters()]
    shapes = [parameters[name].shape for name in names]
    flat = torch.cat([parameters[name].double().reshape(-1) for name in names])

    def loss_of(vector: torch.Tensor) -> torch.Tensor:
        values = dict(zip(names, torch.split(vector, [s.numel() for s in shapes]), strict=True))
        swapped = {name: values[name].reshape(shape) for name, shape in zip(names, shapes, strict=True)}
        return (torch.func.functional_call(net, swapped, (x,)) - y).square().mean()

    hessian = torch.autograd.functional.hessian(loss_of, flat, vectorize=True)
    n = hessian.shape[0]
    top = scipy.linalg.eigh(hessian.numpy(), subset_by_index=[n - 1, n - 1], eigvals_only=True, driver="evr")
    return float(top[-1])


def run(learning_rate: float, steps: int, every: int, hidden: int) -> list[Event]:
    """The curvature events of one run, each against the exact λ₁."""
    model = FullBatchRegression(hidden, learning_rate, every)
    monitor = SpectralMonitor(families=[], curvature=CurvatureOptions(every_n_steps=every))
    logger = ScalarsKept()
    trainer = pl.Trainer(
        max_steps=steps,
        max_epochs=-1,
        logger=logger,
        callbacks=[monitor],
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, teacher_data())
    sharpness = logger.scalars["curvature/sharpness/model"]
    converged = logger.scalars.get("curvature/converged/model", {})
    products = logger.scalars.get("curvature/hessian_products/model", {})
    return [
        Event(
            step,
            sharpness[step],
            exact_top_eigenvalue(model, model.snapshots[step]),
            converged.get(step, 1.0) == 1.0,
            products.get(step, float("nan")),
        )
        for step in sorted(sharpness)
    ]


def summary(learning_rate: float, events: list[Event]) -> str:
    edge = [event for event in events if event.step >= events[-1].step // 2]
    logged_ratio = [event.logged * learning_rate / 2 for event in edge]
    exact_ratio = [event.exact * learning_rate / 2 for event in edge]
    worst = max(events, key=lambda event: event.error)
    products = sorted(event.products for event in events)
    return (
        f"η = {learning_rate}: {len(events)} events, max relative error {worst.error:.2e} "
        f"(step {worst.step}), "
        f"{sum(event.error > TOLERANCE for event in events)} above {TOLERANCE:g}, "
        f"{sum(not event.converged for event in events)} not converged; products per event median "
        f"{products[len(products) // 2]:g}, max {products[-1]:g}; ratio once at the edge (steps ≥ "
        f"{edge[0].step}): logged {min(logged_ratio):.4f}–{max(logged_ratio):.4f}, exact "
        f"{min(exact_ratio):.4f}–{max(exact_ratio):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.8, 1.2])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for learning_rate in args.lr:
        events = run(learning_rate, args.steps, args.every, args.hidden)
        print(summary(learning_rate, events), flush=True)


if __name__ == "__main__":
    main()
