"""Soak: a long run of the demo model with every family measured every 10 steps; do resources stay flat?

Trains ``DemoTransformer`` on the synthetic recall task for ``--steps`` steps with ``SpectralMonitor`` (every
family, the opt-in curvature, Jacobian and NTK probes included, all on the same cadence; figures on every
10th logging step, the default) writing to TensorBoard, and samples every ``--sample-every``
steps: resident memory (psutil when installed, else ``/proc/self/statm``), live tensors (a ``gc`` scan) and
open file descriptors (``/proc/self/fd``). After ``fit`` it checks that nothing is left on the model (forward
hooks, pre-hooks, torch-function modes) and that the trained model, reused, computes exactly what a fresh
copy of it computes. Growth is measured from the end of the warm-up (the first quarter of the run) to the
end (memory as the median of the last third of the samples after warm-up less that of the first third);
the script exits 1 if memory grows by more than ``--max-growth-mib``, or tensors or descriptors grow at
all, or anything is left on the model.

    python benchmarks/soak.py --steps 2000

tests/reliability/test_soak.py runs the script for a shorter run, in a process of its own.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn

from spectral_monitor import SpectralMonitor
from spectral_monitor.core import FAMILIES
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

WARM_UP_FRACTION = 0.25
SMALL_DEMO = {"vocab_size": 48, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}
SMALL_TASK = {
    "vocab_size": 48,
    "seq_len": 32,
    "batch_size": 8,
    "num_keys": 8,
    "num_values": 4,
    "num_pairs": 4,
    "num_queries": 2,
}


def resident_mib() -> float:
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return psutil.Process().memory_info().rss / 2**20


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        return sum(1 for item in gc.get_objects() if isinstance(item, torch.Tensor))


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def left_on(model: nn.Module) -> int:
    """Forward hooks and pre-hooks on ``model`` and globally, plus active torch-function modes."""
    module_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    module = nn.modules.module
    global_hooks = len(module._global_forward_hooks) + len(module._global_forward_pre_hooks)
    return module_hooks + global_hooks + torch._C._len_torch_function_stack()


@dataclass
class Sample:
    step: int
    resident_mib: float
    live_tensors: int
    open_descriptors: int


class ResourceSampler(pl.Callback):
    """Samples the process's resources at the end of every ``every``-th batch (and of the first)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[Sample] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 1 or step % self.every == 0:
            self.samples.append(Sample(step, resident_mib(), live_tensors(), open_descriptors()))


@dataclass
class SoakResult:
    steps: int
    every_n_steps: int
    seconds: float
    samples: list[Sample]
    warm_up_step: int
    resident_growth_mib: float  # median of the last third after warm-up − median of the first third
    resident_peak_mib: float
    tensor_growth: int
    descriptor_growth: int
    left_on_model: int
    reused_model_matches_fresh_copy: bool
    failures: list[str] = field(default_factory=list)


def run_soak(
    steps: int,
    every_n_steps: int = 10,
    sample_every: int = 100,
    logdir: Path | None = None,
    max_growth_mib: float = 16.0,
    model_arguments: dict | None = None,
    data_arguments: dict | None = None,
) -> SoakResult:
    """Trains and samples as the module docstring says; ``failures`` lists every criterion not met."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(logdir) if logdir is not None else Path(scratch)
        model = DemoTransformer(**(model_arguments or SMALL_DEMO))
        data = SyntheticDataModule(**(data_arguments or SMALL_TASK), num_batches=min(steps, 500))
        sampler = ResourceSampler(sample_every)
        monitor = SpectralMonitor(
            every_n_steps=every_n_steps,
            families=FAMILIES,
            curvature=CurvatureOptions(every_n_steps=every_n_steps, top_k=2, trace_products=6),
            jacobian=JacobianOptions(every_n_steps=every_n_steps),
            ntk=NTKOptions(every_n_steps=every_n_steps, examples=4),
        )
        trainer = pl.Trainer(
            max_steps=steps,
            logger=TensorBoardLogger(str(root), name="soak"),
            callbacks=[monitor, sampler],
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=every_n_steps,
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        seconds = time.perf_counter() - start
        matches = _reused_matches_fresh_copy(model, next(iter(data.train_dataloader()))[0])

    samples = sampler.samples
    warm = next(s for s in samples if s.step >= WARM_UP_FRACTION * steps)
    last = samples[-1]
    # Resident memory swings by several MiB between samples as the allocator returns and retakes pages, so a
    # leak is judged by the medians of the first and last thirds after warm-up, not by two single samples.
    after_warm_up = [s.resident_mib for s in samples if s.step >= warm.step]
    third = max(1, len(after_warm_up) // 3)
    resident_growth = statistics.median(after_warm_up[-third:]) - statistics.median(after_warm_up[:third])
    result = SoakResult(
        steps=steps,
        every_n_steps=every_n_steps,
        seconds=round(seconds, 1),
        samples=samples,
        warm_up_step=warm.step,
        resident_growth_mib=round(resident_growth, 2),
        resident_peak_mib=round(max(s.resident_mib for s in samples), 1),
        tensor_growth=last.live_tensors - warm.live_tensors,
        descriptor_growth=last.open_descriptors - warm.open_descriptors,
        left_on_model=left_on(model),
        reused_model_matches_fresh_copy=matches,
    )
    if result.resident_growth_mib > max_growth_mib:
        result.failures.append(f"resident memory grew {result.resident_growth_mib} MiB after warm-up")
    if result.tensor_growth > 0:
        result.failures.append(f"{result.tensor_growth} more live tensors than after warm-up")
    if result.descriptor_growth > 0:
        result.failures.append(f"{result.descriptor_growth} more open file descriptors than after warm-up")
    if result.left_on_model:
        result.failures.append(f"{result.left_on_model} hooks or modes left on the model after fit")
    if not matches:
        result.failures.append("the model reused after fit computes differently from a fresh copy")
    return result


def _reused_matches_fresh_copy(model: DemoTransformer, tokens: torch.Tensor) -> bool:
    """The trained model against a new instance loaded with its weights: same outputs, train and eval."""
    fresh = DemoTransformer(**model.hparams)
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    same = True
    for training in (True, False):
        model.train(training)
        fresh.train(training)
        with torch.no_grad():
            same = same and torch.equal(model(tokens), fresh(tokens))
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every-n-steps", type=int, default=10)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logdir", type=Path, help="where the event files go (default: a temporary one)")
    parser.add_argument("--result-json", type=Path, help="also write the whole result, samples included")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    result = run_soak(
        arguments.steps,
        arguments.every_n_steps,
        arguments.sample_every,
        logdir=arguments.logdir,
        max_growth_mib=arguments.max_growth_mib,
    )
    if arguments.result_json is not None:
        arguments.result_json.write_text(json.dumps(asdict(result), indent=2))
    print("| step | resident (MiB) | live tensors | open fds |\n|---:|---:|---:|---:|")
    for sample in result.samples:
        row = (sample.step, f"{sample.resident_mib:.1f}", sample.live_tensors, sample.open_descriptors)
        print("| " + " | ".join(map(str, row)) + " |")
    summary = {key: value for key, value in asdict(result).items() if key != "samples"}
    print(json.dumps(summary, indent=2))
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
