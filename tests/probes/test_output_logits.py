"""Output logits (opt-in): the LM head's largest logit and mean log-partition over real tokens.

Float64 references and closed forms for the metric; the LM head found by name, by
``get_output_embeddings()`` and by vocabulary size; and a real ``Trainer.fit`` whose logged values equal the
float64 recomputation from the model at step 0 on the same batch, padded tokens left out.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_models import tiny_gpt2
from helpers.lightning_runs import fit
from helpers.lightning_runs import read_viewed as read_back
from helpers.reference_metrics import output_logit_reference
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.metrics import output_logit_metrics
from spectral_monitor.probes.output_logits import OutputLogitCapture, find_lm_head

VOCAB, TOKENS = 24, 8


def test_uniform_logits_have_log_partition_log_v() -> None:
    metrics = output_logit_metrics(torch.full((1, 5, VOCAB), 3.0, dtype=torch.float64))
    assert float(metrics["log_partition"][0]) == pytest.approx(3.0 + math.log(VOCAB), rel=1e-15)
    assert float(metrics["max_logit"][0]) == 3.0


def test_output_logits_match_the_float64_reference_and_padding_does_not_count() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, TOKENS, VOCAB, generator=generator, dtype=torch.float64)
    real = torch.ones(3, TOKENS, dtype=torch.bool)
    real[1, 5:] = False
    real[2, :] = False
    logits[1, 6, 2] = 1e4  # a padded token's huge logit
    metrics = output_logit_metrics(logits, token_mask=real)
    for sequence in range(2):
        expected = output_logit_reference(logits[sequence].numpy(), token_mask=real[sequence].numpy())
        for name, value in expected.items():
            assert float(metrics[name][sequence]) == pytest.approx(value, rel=1e-14), name
    assert float(metrics["max_logit"][1]) < 100
    assert metrics["max_logit"][2].isnan() and metrics["log_partition"][2].isnan()  # nothing to measure


def test_float32_logits_are_measured_to_float32_accuracy() -> None:
    logits = 30 * torch.randn(2, TOKENS, 1000, generator=torch.Generator().manual_seed(1))
    metrics = output_logit_metrics(logits)
    for sequence in range(2):
        expected = output_logit_reference(logits[sequence].double().numpy())
        assert float(metrics["log_partition"][sequence]) == pytest.approx(expected["log_partition"], rel=1e-6)


def test_the_lm_head_is_found_by_vocabulary_size_by_name_and_refused_by_name() -> None:
    model = DemoTransformer(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, seq_len=TOKENS)
    assert find_lm_head(model)[0] == "head"
    assert find_lm_head(model, "blocks.0.mlp.0")[0] == "blocks.0.mlp.0"
    with pytest.raises(ValueError, match="output_logits names the module 'lm_head'"):
        find_lm_head(model, "lm_head")
    with pytest.raises(ValueError, match="found no LM head"):
        find_lm_head(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_a_hugging_face_head_is_its_output_embeddings() -> None:
    model = tiny_gpt2(
        head="causal_lm", seed=None, n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16
    )
    name, head = find_lm_head(model)
    assert name == "lm_head" and head is model.get_output_embeddings()


def test_the_capture_keeps_the_first_sequences_and_nothing_after_disarm() -> None:
    model = DemoTransformer(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, seq_len=TOKENS)
    capture = OutputLogitCapture(model, max_sequences=2)
    tokens = torch.randint(VOCAB, (4, TOKENS), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, TOKENS, dtype=torch.bool)
    mask[0, -3:] = False
    capture.arm(mask)
    output = model(tokens)
    sample = capture.disarm()
    assert sample is not None and torch.equal(sample.logits, output[:2].detach())
    assert sample.token_mask is not None and torch.equal(sample.token_mask, mask[:2])
    assert not capture.is_armed and not model.head._forward_hooks
    model(tokens)
    assert capture.disarm() is None


@pytest.mark.slow
def test_a_fit_writes_the_output_logits_of_the_model_at_step_0(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DemoTransformer(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, seq_len=TOKENS)
    before = copy.deepcopy(model)
    tokens = torch.randint(VOCAB, (4, TOKENS), generator=torch.Generator().manual_seed(3))
    real = torch.ones(4, TOKENS, dtype=torch.bool)
    real[1, 4:] = False
    data = DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=4)
    monitor = SpectralMonitor(
        every_n_steps=100, families=("attention",), output_logits=True, max_sequences=2,
        token_mask=lambda batch: real, strict=True, preflight=False,
    )  # fmt: skip
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run", version=0)
    fit(model, [monitor], logger, max_steps=1, data=data)
    events = read_back(logger.log_dir)

    with torch.no_grad():
        logits = before.double()(tokens[:2]).numpy()
    per_sequence = [output_logit_reference(logits[s], token_mask=real[s].numpy()) for s in range(2)]
    counts = real[:2].sum(dim=1).numpy()
    expected_max = max(values["max_logit"] for values in per_sequence)
    expected_partition = float(
        np.dot([values["log_partition"] for values in per_sequence], counts) / counts.sum()
    )
    (max_logit,) = events.Scalars("outputs/max_logit/model")
    (log_partition,) = events.Scalars("outputs/log_partition/model")
    assert max_logit.step == 0 and log_partition.step == 0
    assert max_logit.value == pytest.approx(expected_max, rel=1e-5)
    assert log_partition.value == pytest.approx(expected_partition, rel=1e-5)
