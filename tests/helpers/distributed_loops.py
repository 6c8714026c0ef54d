"""Two-process CPU (gloo) training runs of the Hugging Face callback and the plain-loop monitor, as scripts
run by test_scale_loops.py under ``torchrun --nproc_per_node 2`` (``python -m torch.distributed.run``).

``distributed_loops.py MODE OUTPUT_DIR``, MODE one of:

- ``trainer``: a ``transformers.Trainer`` (it wraps the model in DDP itself) on a tiny GPT-2 with
  :class:`SpectralMonitorCallback` writing to OUTPUT_DIR/tb, a checkpoint at step ``SAVE_STEP``;
- ``loop_ddp``: a plain loop around ``DistributedDataParallel`` of the demo model with :class:`Monitor`;
- ``loop_fsdp2``: the same loop around the demo model sharded with FSDP2 (``fully_shard`` per block and
  at the root);
- ``trainer_single``: the Trainer run in one process (plain ``python``), on batches of 2 · ``BATCH``.

Each rank trains on its own micro-batch of ``BATCH`` sequences: rank r's batch of step s is batch
2s + r of the sequence of batches that :func:`global_batches` cuts, so a one-process run on batches of
2 · ``BATCH`` (``single_process_loop``, and the Trainer on ``trainer_examples`` with twice the batch size)
sees at each step the concatenation of both ranks' batches, whose mean loss is the mean of the ranks'
losses: its updates are the ranks' averaged ones, and the sequences it measures (the first
``MAX_SEQUENCES``) are rank 0's. Every rank saves its monitor's state to OUTPUT_DIR/rank<r>.pt.
Collectives time out after 60 s, so a deadlock fails.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as a script: helpers.* imported as the tests import them
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.hf_models import tiny_gpt2  # noqa: E402
from spectral_monitor.demo import DemoTransformer  # noqa: E402

STEPS = 4
BATCH = 4
MAX_SEQUENCES = 2
SAVE_STEP = 2
TOKENS = 12
VOCAB = 48
DEMO_MODEL = {
    "vocab_size": VOCAB,
    "d_model": 16,
    "n_layers": 2,
    "n_heads": 2,
    "seq_len": TOKENS,
    "causal": True,
    "init_std": 0.3,
}
TIMEOUT = timedelta(seconds=60)
LOOP_OPTIONS: dict[str, Any] = {
    "every_n_steps": 1,
    "max_sequences": MAX_SEQUENCES,
    "figures_every_n_logs": 0,
    "preflight": False,
}
TRAINER_OPTIONS: dict[str, Any] = {**LOOP_OPTIONS, "families": ["attention", "tokens", "weights"]}


def global_batches() -> torch.Tensor:
    """(2 · STEPS, BATCH, TOKENS) token ids: batch 2s + r is rank r's at step s."""
    generator = torch.Generator().manual_seed(3)
    return torch.randint(1, VOCAB, (2 * STEPS, BATCH, TOKENS), generator=generator)


def demo_model() -> DemoTransformer:
    torch.manual_seed(0)
    return DemoTransformer(**DEMO_MODEL)


def demo_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def single_process_loop(logdir: Path) -> dict[str, Any]:
    """The plain loop in one process on the concatenated batches; returns the monitor's state."""
    from spectral_monitor import Monitor

    model = demo_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = global_batches()
    with Monitor(model, logdir, optimizer=optimizer, **LOOP_OPTIONS) as monitor:
        for step in range(STEPS):
            tokens = torch.cat([batches[2 * step], batches[2 * step + 1]])
            with monitor.step(step, batch=tokens):
                loss = demo_loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return monitor.state_dict()


def distributed_loop(rank: int, output: Path, sharding: str) -> None:
    from spectral_monitor import Monitor

    model = demo_model()
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        trained = fully_shard(model)
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    batches = global_batches()
    with Monitor(trained, output / "tb", optimizer=optimizer, **LOOP_OPTIONS) as monitor:
        for step in range(STEPS):
            tokens = batches[2 * step + rank]
            with monitor.step(step, batch=tokens):
                loss = demo_loss(trained, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.save({"state": monitor.state_dict(), "writes": monitor.writes}, output / f"rank{rank}.pt")


def trainer_examples() -> list[dict[str, torch.Tensor]]:
    """The batches of :func:`global_batches` as examples in order: under two processes the Trainer gives
    rank r every second batch of BATCH from r on; one process with batches of 2 · BATCH sees both."""
    examples = []
    for tokens in global_batches().reshape(-1, TOKENS):
        examples.append({"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens})
    return examples


def trainer_run(output: Path, batch_size: int) -> Any:
    """A Trainer run with the monitor into OUTPUT/tb and a checkpoint at SAVE_STEP; returns the callback."""
    import transformers

    from spectral_monitor.integrations.huggingface import SpectralMonitorCallback

    transformers.logging.set_verbosity_error()
    model = tiny_gpt2(head="causal_lm", vocab_size=VOCAB)
    monitor = SpectralMonitorCallback(log_dir=output / "tb", **TRAINER_OPTIONS)
    arguments = transformers.TrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=batch_size,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        lr_scheduler_type="constant",
        learning_rate=0.1,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=SAVE_STEP,
        use_cpu=True,
        ddp_backend="gloo" if "RANK" in os.environ else None,
        ddp_timeout=int(TIMEOUT.total_seconds()),
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would amplify rounding of tiny gradients
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=trainer_examples(),
        callbacks=[monitor],
        optimizers=(optimizer, None),
    )
    trainer.train()
    return monitor


def main(mode: str, output: Path) -> None:
    torch.set_num_threads(1)
    if mode == "trainer_single":
        trainer_run(output, 2 * BATCH)
        return
    rank = int(os.environ["RANK"])
    if mode == "trainer":
        monitor = trainer_run(output, BATCH)  # the Trainer initialises the process group itself
        torch.save(
            {"state": monitor.state_dict(), "run_directory": monitor.run_directory}, output / f"rank{rank}.pt"
        )
        # Nor does it destroy it: gloo's threads left running at interpreter exit can abort the process.
        _leave_together()
        return
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        distributed_loop(rank, output, "fsdp2" if mode == "loop_fsdp2" else "ddp")
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave_together()


def _leave_together() -> None:
    """Tears the process group down once both ranks are done: a rank that closes its group while the other
    is still in a collective aborts gloo's threads there ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
