"""Two-process CPU (gloo) runs of the monitor, as scripts run by test_scale_distributed.py.

``python tests/distributed_run.py fsdp OUTPUT_DIR``: plain ``torch.distributed.fsdp`` (no Lightning: its FSDP
strategy needs a GPU) around the demo model, FSDP per block and FSDP2 (``fully_shard``) per block; each
rank saves to OUTPUT_DIR/rank<r>.pt what the probes saw (weights measured inside ``full_parameters``,
attention and block outputs of its own batch) and what the collectives of ``spectral_monitor.distributed``
returned.

``python tests/distributed_run.py STRATEGY OUTPUT_DIR MONITORS_JSON``: a Lightning ``Trainer.fit`` with
STRATEGY ``ddp`` or ``ddp_spawn``; MONITORS_JSON a list of SpectralMonitor keyword arguments, one monitor
each (their families must not overlap, so their tags do not either). Writes a TensorBoard run under
OUTPUT_DIR/tb and, from *every* rank, each ``log_metrics`` call its loggers receive to
OUTPUT_DIR/rank<r>.jsonl, so the test sees which rank wrote what.

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
    from spectral_monitor.distributed import any_rank, full_parameters, mean_over_ranks_
    from spectral_monitor.probes import AttentionCapture, ResidualCapture, WeightProbe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
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
            "any_rank": (any_rank(rank == 1), any_rank(False)),
        },
        output / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def fsdp(output: Path) -> None:
    """Rank 1 in a spawned process, rank 0 in this one: one interpreter start fewer than two spawns."""
    import torch.multiprocessing as mp

    other = mp.get_context("spawn").Process(target=fsdp_rank, args=(1, output))
    other.start()
    fsdp_rank(0, output)
    other.join(TIMEOUT.total_seconds())
    if other.exitcode != 0:
        raise SystemExit(f"rank 1 exited with {other.exitcode}")


def main(strategy_name: str, output: Path, monitors: list[dict]) -> None:
    torch.set_num_threads(1)
    data = DataLoader(RankRows(), batch_size=2)
    model = DemoTransformer(**MODEL)
    strategy = DDPStrategy(
        process_group_backend="gloo",
        timeout=TIMEOUT,
        start_method="spawn" if strategy_name == "ddp_spawn" else "popen",
    )
    trainer = pl.Trainer(
        use_distributed_sampler=False,  # RankRows splits; Lightning's sampler would shuffle
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=[TensorBoardLogger(output / "tb", name="", version=0), PerRankLogger(output)],
        callbacks=[SpectralMonitor(**arguments) for arguments in monitors],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if sys.argv[1] == "fsdp":
        fsdp(Path(sys.argv[2]))
    else:
        main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
