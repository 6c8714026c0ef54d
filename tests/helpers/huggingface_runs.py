"""Runs of a real ``transformers.Trainer`` with the monitor's callback on a tiny GPT-2 language model and
padded batches: the model, the examples, the optimizer and the arguments the Trainer-callback tests, the
dashboard's and the unwritable-log-dir test train with. Skips the test without ``transformers`` or
``accelerate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from helpers.hf_models import tiny_gpt2

if TYPE_CHECKING:
    from spectral_monitor.integrations.huggingface import SpectralMonitorCallback

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, TOKENS, BATCH = 64, 16, 4
LR = 1e-2


def trainer_gpt2() -> nn.Module:
    """The GPT-2 language model of these runs (seed 0). Dropout off: the Trainer seeds the generator and
    Lightning does not, and a test compares the two runs."""
    return tiny_gpt2(head="causal_lm", dropout=0.0, vocab_size=VOCAB)


def padded_examples(count: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of TOKENS ids, every third right-padded (pad id 0) after a length of 9 to 15 tokens; labels
    -100 on the padding."""
    generator = torch.Generator().manual_seed(1)
    examples = []
    for index in range(count):
        ids = torch.randint(1, VOCAB, (TOKENS,), generator=generator)
        real = torch.ones(TOKENS, dtype=torch.long)
        if index % 3 == 0:
            real[9 + index % 7 :] = 0
            ids = ids.masked_fill(real == 0, 0)
        labels = ids.masked_fill(real == 0, -100)
        examples.append({"input_ids": ids, "attention_mask": real, "labels": labels})
    return examples


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def training_arguments(output_dir: Path, **overrides: Any) -> transformers.TrainingArguments:
    """Six CPU steps of BATCH sequences in order, a constant learning rate LR, no clipping, no checkpoints,
    the Trainer's own scalars on the first step and every third; ``overrides`` replace any of them."""
    arguments: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": BATCH,
        "max_steps": 6,
        "logging_steps": 3,
        "logging_first_step": True,
        "report_to": ["tensorboard"],
        "lr_scheduler_type": "constant",
        "learning_rate": LR,
        "max_grad_norm": 0.0,
        "save_strategy": "no",
        "use_cpu": True,
        "train_sampling_strategy": "sequential",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        **overrides,
    }
    return transformers.TrainingArguments(**arguments)


def hf_train(
    model: nn.Module,
    arguments: transformers.TrainingArguments,
    monitor: SpectralMonitorCallback | None,
    count: int,
) -> transformers.Trainer:
    """Trains ``model`` on the first ``count`` padded examples with AdamW and ``monitor`` as a callback (None:
    unmonitored)."""
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=padded_examples(count),
        callbacks=[] if monitor is None else [monitor],
        optimizers=(adamw(model), None),
    )
    trainer.train()
    return trainer
