"""Attention-logit growth on a CPU: the shipped pair configs/logit_growth.yaml and its QK-norm twin.

Trains both configs as ``spectral-monitor demo`` would (LightningCLI, the monitor's default alert rules),
reads their event files back, and prints for each: the step the ``logit_growth`` alert fired, the
loss-spike step and the largest attention logit seen. Writes ``docs/img/logit_growth.png``: the largest
attention logit (over heads and layers) and the training loss against the step, both runs, the alert and
the spike marked.

The loss-spike step is the first step whose loss exceeds the smallest loss of the steps before it by
``SPIKE_NATS`` = 1 nat (an e-fold rise in perplexity over the best so far): a rise no run of the healthy
twin shows, and one that small losses near 0 do not reach by noise, as a ratio to the running minimum would.

    PYTHONPATH=$PWD python benchmarks/logit_growth.py [--max-steps N] [--logdir DIR] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIGS = ("logit_growth", "logit_growth_qk_norm")
SPIKE_NATS = 1.0
RULE = "logit_growth"
DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "logit_growth.png"


@dataclass
class PairRun:
    """What one run of the pair showed: per-step loss, the largest attention logit per logging step, and the
    first step at which the ``logit_growth`` alert had fired and the loss had spiked (None: never)."""

    name: str
    loss: dict[int, float]
    max_logit: dict[int, float]
    alert_step: int | None
    spike_step: int | None


def loss_spike_step(loss: dict[int, float], nats: float = SPIKE_NATS) -> int | None:
    """The first step whose loss exceeds the smallest loss of the steps before it by ``nats`` (a non-finite
    loss counts as a spike); None if there is none."""
    best = math.inf
    for step in sorted(loss):
        value = loss[step]
        if not math.isfinite(value) or value > best + nats:
            return step
        best = min(best, value)
    return None


def train(name: str, logdir: Path, max_steps: int | None = None) -> PairRun:
    """Train the shipped config ``name`` (``max_steps`` overrides its own) logging under ``logdir``."""
    from pytorch_lightning.cli import LightningCLI

    from spectral_monitor.cli import shipped_configs
    from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

    logger = {
        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(logdir), "name": name},
    }
    arguments = [
        f"--config={shipped_configs()[name]}",
        f"--trainer.logger={json.dumps(logger)}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]
    if max_steps is not None:
        arguments.append(f"--trainer.max_steps={max_steps}")
    cli = LightningCLI(
        DemoTransformer,
        SyntheticDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=arguments,
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return read_run(name, Path(cli.trainer.logger.log_dir))


def read_run(name: str, run_dir: Path) -> PairRun:
    """The loss, largest attention logit and alert of the run whose event files are in ``run_dir``."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    loss = {event.step: event.value for event in events.Scalars("train/loss")}
    max_logit: dict[int, float] = {}
    for tag in (tag for tag in tags if tag.startswith("attention/max_logit_max/")):
        for event in events.Scalars(tag):
            max_logit[event.step] = max(max_logit.get(event.step, -math.inf), event.value)
    fired = [event.step for event in events.Scalars(f"alerts/fired/{RULE}") if event.value > 0]
    return PairRun(name, loss, max_logit, min(fired, default=None), loss_spike_step(loss))


def plot(runs: list[PairRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (logits, losses) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, constrained_layout=True)
    for run, colour in zip(runs, ("tab:red", "tab:blue"), strict=True):
        label = "QK-norm" if run.name.endswith("qk_norm") else "no QK-norm"
        steps = sorted(run.max_logit)
        logits.plot(steps, [run.max_logit[s] for s in steps], color=colour, marker=".", label=label)
        steps = sorted(run.loss)
        losses.plot(steps, [run.loss[s] for s in steps], color=colour, linewidth=0.8, label=label)
        for axis in (logits, losses):
            if run.alert_step is not None:
                axis.axvline(run.alert_step, color=colour, linestyle="--", linewidth=1)
            if run.spike_step is not None:
                axis.axvline(run.spike_step, color=colour, linestyle=":", linewidth=1.5)
    logits.axhline(50, color="grey", linewidth=0.8)
    logits.set_yscale("log")
    logits.set_ylabel("largest attention logit")
    logits.set_title("logit_growth fires (dashed) before the loss spikes (dotted); grey: its threshold")
    logits.legend()
    losses.set_ylabel("training loss")
    losses.set_xlabel("step")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the configs')")
    parser.add_argument("--logdir", type=Path, default=None, help="TensorBoard logs (default: a temp folder)")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="the figure (default: %(default)s)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        logdir = arguments.logdir or Path(scratch)
        runs = [train(name, logdir, arguments.max_steps) for name in CONFIGS]
        for run in runs:
            print(
                f"{run.name}: logit_growth alert at step {run.alert_step}, loss spike at step "
                f"{run.spike_step}, largest attention logit {max(run.max_logit.values()):.1f}, best loss "
                f"{min(run.loss.values()):.3f}"
            )
        plot(runs, arguments.plot)
        print(f"wrote {arguments.plot}")


if __name__ == "__main__":
    main()
