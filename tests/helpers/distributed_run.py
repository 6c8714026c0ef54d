"""Two-process CPU (gloo) runs of the monitor, as scripts run by test_scale_distributed.py.

``python tests/helpers/distributed_run.py fsdp OUTPUT_DIR``: plain ``torch.distributed`` (no Lightning:
its FSDP strategy needs a GPU) around the demo model, FSDP per block and FSDP2 (``fully_shard``) per block;
each rank saves to OUTPUT_DIR/rank<r>.pt what the probes saw (weights measured inside ``full_parameters``,
attention and block outputs of its own batch), what the collectives of ``spectral_monitor.distributed``
returned, the curvature of its own shard averaged over the ranks with a tolerance of its own (so only the
agreed stopping keeps the ranks in step), and the refusals of the curvature probes on the sharded models.

``python tests/helpers/distributed_run.py STRATEGY OUTPUT_DIR MONITORS_JSON [OPTIONS_JSON]``: a Lightning
``Trainer.fit`` with STRATEGY ``ddp`` or ``ddp_spawn``; MONITORS_JSON a list of SpectralMonitor keyword
arguments, one monitor each (their families must not overlap, so their tags do not either; ``curvature``,
``jacobian``, ``ntk`` and ``probe_data`` are the keyword arguments of their options classes). Writes a
TensorBoard run under OUTPUT_DIR/tb and, from *every* rank, each ``log_metrics`` call its loggers receive
to OUTPUT_DIR/rank<r>.jsonl, so the test sees which rank wrote what, and the step it stopped at and each
monitor's alert state to OUTPUT_DIR/rank<r>.pt. OPTIONS_JSON: ``precision`` of the Trainer, ``"optimizer":
"sgd"`` for plain SGD (lr 0.1) instead of the demo's AdamW, ``"nan": [rank, step]`` to write a NaN into
that rank's own copy of ``blocks.0.mlp.0.weight`` at the start of that step (before the monitor looks).

A script rather than a test function: Lightning's ``ddp`` launcher starts rank 1 by re-running
``sys.argv``, which must not be pytest. Collectives time out after 60 s, so a deadlock fails.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.loggers import Logger, TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions, ProbeDataOptions
from spectral_monitor.demo import DemoTransformer

STEPS = 6
MODEL = {
    "vocab_size": 32,
    "d_model": 16,
    "n_layers": 2,
    "n_heads": 2,
    "seq_len": 8,
    "causal": False,
    "init_std": 0.3,
}
TIMEOUT = timedelta(seconds=60)
SGD_LEARNING_RATE = 0.1
CURVATURE_TOLERANCES = (1e-2, 1e-9)  # rank 0 would stop Lanczos long before rank 1
OPTIONS_CLASSES = {
    "curvature": CurvatureOptions,
    "jacobian": JacobianOptions,
    "ntk": NTKOptions,
    "probe_data": ProbeDataOptions,
}


def rank_batches() -> torch.Tensor:
    """(STEPS · 4, 8) tokens; rank r's first batch is rows r and r + 2 in every run."""
    return torch.randint(MODEL["vocab_size"], (4 * STEPS, 8), generator=torch.Generator().manual_seed(0))


class RankRows(Dataset):
    """(tokens, previous tokens) of row 2i + r of :func:`rank_batches` on rank r: rank r's first batch of
    two is rows r and r + 2, known to the test without knowing a sampler's permutation."""

    def __len__(self) -> int:
        return 2 * STEPS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = rank_batches()[2 * index + dist.get_rank()]
        return tokens, tokens.roll(1)


def shard_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The demo model's training loss on the sequences ``rows`` of :func:`rank_batches`."""
    tokens = rank_batches()[rows]
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


class SGDTransformer(DemoTransformer):
    """The demo model under plain SGD: its sharpness is λ_max(H) from the first step (AdamW's needs v̂)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=SGD_LEARNING_RATE)


class InjectNaN(pl.Callback):
    """Writes a NaN into one rank's own copy of a weight at a step start, before the monitor looks."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.blocks[0].mlp[0].weight[0, 0] = float("nan")


class PerRankLogger(Logger):
    """Records each ``log_metrics`` call on the rank that made it (no rank-zero guard, unlike Lightning's)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    @property
    def name(self) -> str:
        return "per_rank"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(self.directory / f"rank{rank}.jsonl", "a") as file:
            record = {"step": step, "metrics": {tag: float(value) for tag, value in metrics.items()}}
            file.write(json.dumps(record) + "\n")


def fsdp_rank(rank: int, output: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from spectral_monitor.demo.model import Block
    from spectral_monitor.distributed import any_rank, full_parameters, mean_over_ranks_, on_every_rank
    from spectral_monitor.probes import AttentionCapture, ResidualCapture, WeightProbe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    curvature = own_shard_curvature(rank)
    model = FullyShardedDataParallel(
        DemoTransformer(**MODEL), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
    )
    probe = WeightProbe(model)
    with torch.no_grad(), full_parameters(model):
        weights = {record.tag: record.value for record in probe.measure(0)}
    unsharded = {record.tag: record.value for record in probe.measure(0)}  # without full_parameters

    model_fsdp2 = DemoTransformer(**MODEL)
    for block in model_fsdp2.blocks:
        fully_shard(block)
    fully_shard(model_fsdp2)
    with torch.no_grad(), full_parameters(model_fsdp2):
        weights_fsdp2 = {record.tag: record.value for record in WeightProbe(model_fsdp2).measure(0)}

    attention, residual = AttentionCapture(model), ResidualCapture(model)
    with attention.armed() as attention_recording, residual.armed() as residual_recording:
        loss = model(rank_batches()[rank : rank + 3 : 2]).square().mean()
    loss.backward()
    torch.save(
        {
            "weights": weights,
            "weights_outside_full_parameters": unsharded,
            "weights_fsdp2": weights_fsdp2,
            "attention": {capture.layer: capture.probs() for capture in attention_recording.captured},
            "tokens": {sample.layer: sample.states for sample in residual_recording.states},
            "mean": mean_over_ranks_([torch.tensor([rank + 1.0]), torch.full((2, 2), 10.0 * rank)]),
            "any_rank": any_rank([rank == 1, False]),
            "on_every_rank": on_every_rank(torch.tensor([True, rank == 1, False])).tolist(),
            "curvature": curvature,
            "refusals": {
                "fsdp": curvature_refusals(model, rank),
                "fsdp2": curvature_refusals(model_fsdp2, rank),
            },
        },
        output / f"rank{rank}.pt",
    )
    # Neither rank tears its group down while the other may still be in a collective: a closed peer aborts
    # gloo's threads ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def own_shard_curvature(rank: int) -> dict:
    """Top-2 Hessian eigenvalues and the Hutch++ trace of the mean loss over both ranks' shards (float64),
    each rank passing only its own shard and a tolerance of its own; how many products each spent."""
    from spectral_monitor.probes.curvature import measure_curvature

    model = DemoTransformer(**MODEL).double()
    estimate = measure_curvature(
        model,
        lambda: shard_loss(model, [rank, rank + 2]),
        top_k=2,
        trace_products=12,
        tol=CURVATURE_TOLERANCES[rank],
        max_products=400,
        average_over_ranks=True,
        generator=torch.Generator().manual_seed(0),  # the same on every rank, and in the test's reference
    )
    # Without a generator each rank would draw its own start: rank 0's seed is shared instead.
    unseeded = measure_curvature(
        model, lambda: shard_loss(model, [rank, rank + 2]), top_k=2, tol=1e-9, average_over_ranks=True
    )
    return {
        "eigenvalues": estimate.eigenvalues.tolist(),
        "unseeded_eigenvalues": unseeded.eigenvalues.tolist(),
        "trace": float(estimate.trace.mean[0]),
        "products": estimate.products,
        "converged": estimate.converged,
    }


def curvature_refusals(sharded: torch.nn.Module, rank: int) -> list[str | None]:
    """What the curvature probe and the callback's probes say to a sharded model (None: no refusal)."""
    from spectral_monitor.core.second_order import SecondOrderProbes
    from spectral_monitor.probes.curvature import measure_curvature

    options = [kind() for kind in OPTIONS_CLASSES.values()]
    messages: list[str | None] = []
    for attempt in (
        lambda: measure_curvature(sharded, lambda: shard_loss(sharded, [rank])),
        lambda: SecondOrderProbes(sharded, ["curvature", "jacobian"], *options, failures_of=None),
    ):
        try:
            attempt()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def fsdp(output: Path) -> None:
    """Rank 1 in a spawned process, rank 0 in this one: one interpreter start fewer than two spawns."""
    import torch.multiprocessing as mp

    other = mp.get_context("spawn").Process(target=fsdp_rank, args=(1, output))
    other.start()
    fsdp_rank(0, output)
    other.join(TIMEOUT.total_seconds())
    if other.exitcode != 0:
        raise SystemExit(f"rank 1 exited with {other.exitcode}")


class SaveRankState(pl.Callback):
    """Writes, on every rank at the end of fit (in the worker, also under ``ddp_spawn``), the step it stopped
    at and each monitor's alert state to OUTPUT_DIR/rank<r>.pt."""

    def __init__(self, output: Path) -> None:
        self.output = output

    def on_fit_end(self, trainer, pl_module) -> None:
        monitors = [callback for callback in trainer.callbacks if isinstance(callback, SpectralMonitor)]
        state = {
            "global_step": trainer.global_step,
            "alerts": [monitor.state_dict()["alerts"] for monitor in monitors],
        }
        torch.save(state, self.output / f"rank{trainer.global_rank}.pt")


def monitor(arguments: dict) -> SpectralMonitor:
    options = {
        key: OPTIONS_CLASSES[key](**value) for key, value in arguments.items() if key in OPTIONS_CLASSES
    }
    return SpectralMonitor(**{**arguments, **options})


def main(strategy_name: str, output: Path, monitors: list[dict], options: dict) -> None:
    torch.set_num_threads(1)
    data = DataLoader(RankRows(), batch_size=2)
    model = (SGDTransformer if options.get("optimizer") == "sgd" else DemoTransformer)(**MODEL)
    strategy = DDPStrategy(
        process_group_backend="gloo",
        timeout=TIMEOUT,
        start_method="spawn" if strategy_name == "ddp_spawn" else "popen",
    )
    injected = [InjectNaN(*options["nan"])] if "nan" in options else []
    trainer = pl.Trainer(
        use_distributed_sampler=False,  # RankRows splits; Lightning's sampler would shuffle
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=options.get("precision", "32-true"),
        max_steps=STEPS,
        logger=[TensorBoardLogger(output / "tb", name="", version=0), PerRankLogger(output)],
        callbacks=[*injected, *(monitor(arguments) for arguments in monitors), SaveRankState(output)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, data)
    # Lightning leaves the process group up; torn down by the interpreter's exit instead, gloo's threads can
    # abort the process ("terminate called without an active exception") after a run that succeeded, and so
    # can a rank that closes it while the other is still in a collective.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if sys.argv[1] == "fsdp":
        fsdp(Path(sys.argv[2]))
    else:
        run_options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
        main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), run_options)
