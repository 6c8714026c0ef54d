"""Hugging Face models as users have them: ``eager`` attention is captured as ``sdpa`` attention is.

Each family is a tiny random-init model built offline, initialised with a large weight scale so that its
attention is far from uniform (a check on uniform attention cannot tell definitions apart). The independent
source is the model itself: its float64 eager twin's ``output_attentions``; and its ``sdpa`` twin (same
weights) through the capture's kernel path. Training with the eager capture armed stays bit-identical.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.events import read_back, scalar_series
from helpers.hf_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from helpers.reference_metrics import attention_reference_batch
from helpers.reliability import fit, monitor_reports, tensorboard_logger
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.probes import (
    AttentionCapture,
    AttentionInputs,
    AttentionRecording,
    CapturedAttention,
    LogitSoftcap,
    huggingface,
)
from spectral_monitor.probes.huggingface import attention_not_seen_advice

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, TOKENS, BATCH, PADDED = 64, 10, 3, 3
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Family:
    """A model family: how to build it, how its attention layers are named, whether it is causal."""

    build: Any
    layer_name: str
    causal: bool
    paddings: tuple[str, ...] = ("none", "right", "left")


def gpt2(implementation: str, dropout: float = 0.0) -> nn.Module:
    return tiny_gpt2(
        head="causal_lm",
        attention=implementation,
        dropout=dropout,
        seed=None,
        n_positions=16,
        vocab_size=VOCAB,
        initializer_range=0.3,
    )


def llama(implementation: str, dropout: float = 0.0) -> nn.Module:
    return tiny_llama(
        head="causal_lm",
        attention=implementation,
        dropout=dropout,
        seed=None,
        vocab_size=VOCAB,
        initializer_range=0.3,
    )


def bert(implementation: str, dropout: float = 0.0) -> nn.Module:
    return tiny_bert(
        head="masked_lm",
        attention=implementation,
        dropout=dropout,
        seed=None,
        vocab_size=VOCAB,
        initializer_range=0.5,
    )


def t5_encoder(implementation: str, dropout: float = 0.0) -> nn.Module:
    return tiny_t5(
        attention=implementation,
        dropout=dropout,
        seed=None,
        vocab_size=VOCAB,
        relative_attention_num_buckets=8,
        initializer_factor=2.0,
    )


FAMILIES = {
    "gpt2": Family(gpt2, "transformer.h.{}.attn", causal=True),
    "llama": Family(llama, "model.layers.{}.self_attn", causal=True),
    "bert": Family(bert, "bert.encoder.layer.{}.attention.self", causal=False),
    "t5": Family(
        t5_encoder, "encoder.block.{}.layer.0.SelfAttention", causal=False, paddings=("none", "right")
    ),
}
CASES = [
    pytest.param(family, padding, id=f"{family}-{padding}")
    for family, spec in FAMILIES.items()
    for padding in spec.paddings
]


def twins(family: str) -> tuple[nn.Module, nn.Module]:
    """The eager model and its sdpa twin with the same weights, both in eval mode."""
    torch.manual_seed(0)
    eager = FAMILIES[family].build("eager").eval()
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    return eager, sdpa


def batch(padding: str) -> dict[str, torch.Tensor]:
    """Token ids, and for a padded case an attention mask whose second sequence has ``PADDED`` pads."""
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(1, VOCAB, (BATCH, TOKENS), generator=generator)}
    if padding != "none":
        real = torch.ones(BATCH, TOKENS, dtype=torch.long)
        real[1, TOKENS - PADDED :] = 0 if padding == "right" else 1
        real[1, :PADDED] = 0 if padding == "left" else 1
        inputs["attention_mask"] = real
    return inputs


def real_tokens(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs.get("attention_mask", torch.ones(BATCH, TOKENS, dtype=torch.long)).bool()


def captured(model: nn.Module, inputs: dict[str, torch.Tensor]) -> AttentionRecording:
    with AttentionCapture(model, max_sequences=BATCH, strict=True).armed() as recording:
        model(**inputs)
    return recording


def float64_attentions(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every layer's attention probabilities from the model's own eager path, in float64."""
    left_padded = not bool(real_tokens(inputs)[:, 0].all())
    if left_padded and isinstance(model, transformers.LlamaPreTrainedModel):
        pytest.skip(
            "Llama's eager softmax runs in float32: in float64 its fully masked (left-padded) query rows "
            "are NaN and spread to the real rows; the sdpa twin covers this case"
        )
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        return list(reference(**inputs, output_attentions=True).attentions)


def logged_metrics(recording: AttentionRecording) -> list[dict[str, torch.Tensor]]:
    """What the monitor computes per layer and head from a recording: (S, H) per metric."""
    metrics = []
    for sample in recording.samples():
        heads = sample.probs.shape[1]

        def per_head(mask: torch.Tensor | None, heads: int = heads) -> torch.Tensor | None:
            return None if mask is None else mask[:, None, :].expand(-1, heads, -1)

        metrics.append(
            attention_metrics(
                sample.probs,
                key_mask=per_head(sample.key_mask),
                query_mask=per_head(sample.query_mask),
                causal=sample.causal,
                method="exact",
            )
        )
    return metrics


@pytest.mark.parametrize(("family", "padding"), CASES)
def test_eager_capture_holds_the_models_own_float64_attention(family: str, padding: str) -> None:
    eager, _ = twins(family)
    inputs = batch(padding)
    recording = captured(eager, inputs)
    references = float64_attentions(eager, inputs)

    layers = [FAMILIES[family].layer_name.format(index) for index in range(len(references))]
    assert [capture.layer for capture in recording.captured] == layers and not recording.skipped
    real = real_tokens(inputs)
    for sample, reference in zip(recording.samples(), references, strict=True):
        for sequence in range(BATCH):
            rows = real[sequence]
            error = (sample.probs[sequence][:, rows].double() - reference[sequence][:, rows]).abs().max()
            assert error < TOLERANCE, (sample.layer, sequence, float(error))
    # far from uniform: the check would not tell definitions apart otherwise
    top = references[0][0].max(dim=-1).values
    assert float(top.mean()) > 0.5


@pytest.mark.parametrize(("family", "padding"), CASES)
def test_eager_and_sdpa_twins_capture_the_same_attention(family: str, padding: str) -> None:
    eager, sdpa = twins(family)
    inputs = batch(padding)
    from_eager, from_sdpa = captured(eager, inputs), captured(sdpa, inputs)

    assert [c.layer for c in from_eager.captured] == [c.layer for c in from_sdpa.captured]
    # Padded positions are left out: their rows have no attendable key, which the eager and sdpa paths
    # resolve differently inside the model, so from the second layer on their states differ.
    real = real_tokens(inputs)
    for first, second in zip(from_eager.captured, from_sdpa.captured, strict=True):
        assert first.scale == pytest.approx(second.scale, rel=1e-12)
        for sequence in range(BATCH):
            rows = real[sequence]
            for eager_part, sdpa_part in (
                (first.q, second.q),  # after rotary embedding
                (first.k, second.k),  # grouped key heads repeated alike
                (first.probs(), second.probs()),
            ):
                error = (eager_part[sequence][:, rows] - sdpa_part[sequence][:, rows]).abs().max()
                assert error < TOLERANCE, (first.layer, sequence, float(error))


def close_or_both_nan(first: torch.Tensor, second: np.ndarray | torch.Tensor) -> bool:
    """Equal within ``TOLERANCE`` (relative above 1: stable and effective ranks reach the head count)."""
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    both = ~np.isnan(second)
    bound = TOLERANCE * np.maximum(1.0, np.abs(second[both]))
    return bool(np.all(np.isnan(first) == np.isnan(second))) and bool(
        np.all(np.abs(first[both] - second[both]) < bound)
    )


@pytest.mark.parametrize(("family", "padding"), CASES)
def test_eager_and_sdpa_twins_log_the_same_attention_metrics(family: str, padding: str) -> None:
    eager, sdpa = twins(family)
    inputs = batch(padding)
    from_eager, from_sdpa = logged_metrics(captured(eager, inputs)), logged_metrics(captured(sdpa, inputs))
    for layer, (first, second) in enumerate(zip(from_eager, from_sdpa, strict=True)):
        for metric in first:
            assert close_or_both_nan(first[metric], second[metric]), (
                layer,
                metric,
                first[metric],
                second[metric],
            )


@pytest.mark.parametrize(("family", "padding"), CASES)
def test_eager_metrics_equal_the_float64_reference_on_real_queries_and_attendable_keys(
    family: str, padding: str
) -> None:
    eager, _ = twins(family)
    inputs = batch(padding)
    metrics = logged_metrics(captured(eager, inputs))
    real = real_tokens(inputs).numpy()[:, None, :]
    for layer, attention in enumerate(float64_attentions(eager, inputs)):
        reference = attention_reference_batch(
            attention.numpy(), key_mask=real, query_mask=real, causal=FAMILIES[family].causal
        )
        for metric, expected in reference.items():
            got = metrics[layer][metric]
            assert close_or_both_nan(got, expected), (layer, metric, got, expected)


def adamw_steps(model: nn.Module, inputs: dict[str, torch.Tensor], capture: AttentionCapture | None) -> None:
    """Three training steps with dropout on; the capture, when given, armed around every forward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    labels = inputs["input_ids"]
    torch.manual_seed(5)
    for _ in range(3):
        if capture is None:
            loss = model(**inputs, labels=labels).loss
        else:
            with capture.armed() as recording:
                loss = model(**inputs, labels=labels).loss
            assert len(recording.captured) == 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_training_with_the_eager_capture_armed_is_bit_identical(family: str) -> None:
    torch.manual_seed(0)
    watched = FAMILIES[family].build("eager", dropout=0.1).train()
    unwatched = copy.deepcopy(watched)
    inputs = batch("right")

    adamw_steps(watched, inputs, AttentionCapture(watched))
    adamw_steps(unwatched, inputs, None)

    for (name, parameter), other in zip(watched.named_parameters(), unwatched.parameters(), strict=True):
        assert torch.equal(parameter, other), name


def test_disarm_restores_the_modeling_files_attention_function_and_other_models_are_not_recorded() -> None:
    modeling_gpt2 = sys.modules[type(gpt2("eager")).__module__]
    original = modeling_gpt2.eager_attention_forward
    torch.manual_seed(0)
    watched, other = gpt2("eager").eval(), gpt2("eager").eval()
    inputs = batch("none")
    capture = AttentionCapture(watched)
    with capture.armed() as recording:
        assert modeling_gpt2.eager_attention_forward is not original
        other(**inputs)
    assert modeling_gpt2.eager_attention_forward is original
    assert not recording.captured and not recording.skipped


def gemma2() -> nn.Module:
    """Gemma 2 with its default ``attn_logit_softcapping`` (50), eager attention (it supports no other
    captured one), a sliding-window layer and a global one; weights large enough that the cap changes the
    probabilities."""
    config = transformers.Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
        vocab_size=VOCAB,
        initializer_range=1.0,
        pad_token_id=0,
    )
    return transformers.Gemma2ForCausalLM(config).eval()


GEMMA2_CAP = 50.0


class Float64Softmax(TorchFunctionMode):
    """Keeps a softmax of float64 logits in float64 where the modeling file asks for float32: Gemma 2's
    eager softmax upcasts to float32, where its float64 mask minimum becomes -inf and the fully masked rows
    of left padding turn NaN (and spread through the values to the real rows)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.softmax and args[0].dtype == torch.float64:
            kwargs.pop("dtype", None)
        return func(*args, **kwargs)


def gemma2_float64_attentions(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    reference = copy.deepcopy(model).double()
    with torch.no_grad(), Float64Softmax():
        return list(reference(**inputs, output_attentions=True).attentions)


def float64_softcapped_max_logits(capture: CapturedAttention) -> torch.Tensor:
    """(S, H) largest cap · tanh(scale · q·k / cap) + mask over real queries and attendable keys, in
    float64, from the captured q and k: the logits after the cap, as the softmax sees them."""
    logits = (capture.q.double() @ capture.k.double().transpose(-1, -2)) * capture.scale
    logits = GEMMA2_CAP * torch.tanh(logits / GEMMA2_CAP)
    if capture.mask is not None:
        logits = logits + capture.mask.double()
    if capture.causal:
        later = torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1)
        logits = logits.masked_fill(later, -math.inf)
    if capture.key_mask is not None:
        logits = logits.masked_fill(~capture.key_mask[:, None, None, :], -math.inf)
    if capture.query_mask is not None:
        logits = logits.masked_fill(~capture.query_mask[:, None, :, None], -math.inf)
    return logits.amax(dim=(-1, -2))


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_gemma2_softcapped_attention_is_captured_as_the_model_uses_it(padding: str) -> None:
    torch.manual_seed(0)
    model = gemma2()
    assert model.config._attn_implementation == "eager"
    assert model.config.attn_logit_softcapping == GEMMA2_CAP
    inputs = batch(padding)
    recording = captured(model, inputs)
    references = gemma2_float64_attentions(model, inputs)

    assert [capture.layer for capture in recording.captured] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert not recording.skipped
    real = real_tokens(inputs)
    metrics = logged_metrics(recording)
    for layer, (capture, sample, reference) in enumerate(
        zip(recording.captured, recording.samples(), references, strict=True)
    ):
        for sequence in range(BATCH):
            rows = real[sequence]
            error = (sample.probs[sequence][:, rows].double() - reference[sequence][:, rows]).abs().max()
            assert error < TOLERANCE, (capture.layer, sequence, float(error))
        expected = attention_reference_batch(
            reference.numpy(),
            key_mask=real.numpy()[:, None, :],
            query_mask=real.numpy()[:, None, :],
            causal=True,
        )
        for metric, value in expected.items():
            assert close_or_both_nan(metrics[layer][metric], value), (layer, metric)
        max_logit = float64_softcapped_max_logits(capture)
        assert torch.allclose(sample.max_logit.double(), max_logit, rtol=TOLERANCE, atol=TOLERANCE)
        assert float(sample.max_logit.max()) < GEMMA2_CAP
        # The blockwise path forms its logits on its own: it applies the cap too.
        blockwise = capture.blockwise_metrics(method="exact")
        for metric, value in metrics[layer].items():
            if metric in blockwise:
                assert close_or_both_nan(blockwise[metric], value.numpy()), (layer, metric)
        assert torch.allclose(blockwise["max_logit"].double(), max_logit, rtol=TOLERANCE, atol=TOLERANCE)

        # The cap matters here: without it the probabilities are far from the model's.
        uncapped = dataclasses.replace(capture, logit_transform=None).probs()
        assert float((uncapped.double() - reference).nan_to_num().abs().max()) > 0.1


def test_eager_attention_with_sinks_is_reported_not_measured() -> None:
    config = transformers.GptOssConfig(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        vocab_size=VOCAB,
        layer_types=["full_attention"],
        attn_implementation="eager",
    )
    model = transformers.GptOssForCausalLM(config).eval()
    recording = captured(model, batch("none"))
    assert not recording.captured
    (skipped,) = recording.skipped
    assert skipped.layer == "model.layers.0.self_attn" and "s_aux" in skipped.reason


def test_an_extractor_expresses_softcapping_with_a_logit_transform() -> None:
    torch.manual_seed(0)
    attention = SoftcappedHandWrittenAttention(cap=2.0)
    x = torch.randn(2, 6, 8) * 3
    with AttentionCapture(
        attention,
        extractors={SoftcappedHandWrittenAttention: SoftcappedHandWrittenAttention.extract},
        max_sequences=2,
        strict=True,
    ).armed() as recording:
        attention(x)
    (sample,) = recording.samples()
    with torch.no_grad():
        expected = attention.probabilities(x.double())
    assert torch.allclose(sample.probs[:, 0].double(), expected, atol=1e-6)
    assert float(sample.max_logit.max()) < 2.0


class SoftcappedHandWrittenAttention(nn.Module):
    """One head whose logits are softcapped before the softmax, written by hand."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap
        self.project = nn.Linear(8, 24)

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        q, k, _ = F.linear(x, self.project.weight.to(x.dtype), self.project.bias.to(x.dtype)).chunk(3, dim=-1)
        logits = self.cap * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / self.cap)
        return torch.softmax(logits, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.probabilities(x) @ self.project(x).chunk(3, dim=-1)[2]

    @staticmethod
    def extract(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> AttentionInputs:
        q, k, _ = module.project(args[0]).chunk(3, dim=-1)
        return AttentionInputs(q=q, k=k, logit_transform=LogitSoftcap(module.cap))


class HandWrittenAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
        return weights @ v


def test_the_advice_for_unseen_attention_names_the_concrete_fix() -> None:
    flex = llama("sdpa")
    flex.set_attn_implementation("flex_attention")
    advice = attention_not_seen_advice(flex)
    assert "'flex_attention'" in advice and 'model.set_attn_implementation("sdpa")' in advice
    assert 'attn_implementation="sdpa"' in advice

    reordered = tiny_gpt2(
        head="causal_lm",
        attention="eager",
        seed=None,
        n_layer=1,
        vocab_size=VOCAB,
        reorder_and_upcast_attn=True,
    )
    assert not captured(reordered, batch("none")).captured
    assert "register_attention_extractor(GPT2Attention, extractor)" in attention_not_seen_advice(reordered)

    hand_written = nn.Sequential(nn.Linear(8, 8), HandWrittenAttention())
    assert "register_attention_extractor(HandWrittenAttention, extractor)" in attention_not_seen_advice(
        hand_written
    )


class CausalLanguageModel(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, real = batch
        return self.model(input_ids=ids, attention_mask=real, labels=ids.masked_fill(real == 0, -100)).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.slow
def test_a_fit_with_the_monitor_on_eager_gpt2_logs_attention_and_trains_bit_identically(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    watched = CausalLanguageModel(gpt2("eager", dropout=0.1))
    unwatched = copy.deepcopy(watched)
    inputs = batch("right")
    data = DataLoader(TensorDataset(inputs["input_ids"], inputs["attention_mask"]), batch_size=BATCH)

    monitor = SpectralMonitor(every_n_steps=1, families=["attention"], figures_every_n_logs=0)
    for model, callbacks in ((watched, [monitor]), (unwatched, [])):
        torch.manual_seed(3)
        fit(model, callbacks, tensorboard_logger(tmp_path, version=len(callbacks)), 3, data=data)

    for (name, parameter), other in zip(watched.named_parameters(), unwatched.parameters(), strict=True):
        assert torch.equal(parameter, other), name
    entropy = scalar_series(read_back(tmp_path / "run" / "version_1"), "attention/entropy/")
    layers = {tag for tag in entropy if "/head_" not in tag}
    assert layers == {f"attention/entropy/model.transformer.h.{index}.attn" for index in range(2)}
    assert all([step for step, _ in series] == [0, 1, 2] for series in entropy.values())


def test_a_failure_reading_an_eager_call_is_recorded_and_the_forward_goes_on_unless_strict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreadable(*args: Any) -> None:
        raise RuntimeError("unreadable eager call")

    monkeypatch.setattr(huggingface, "_report", unreadable)
    torch.manual_seed(0)
    model = gpt2("eager").eval()
    inputs = batch("none")
    with torch.no_grad():
        expected = model(**inputs).logits
        with AttentionCapture(model).armed() as recording:
            logits = model(**inputs).logits
        assert torch.equal(logits, expected)
        assert [skipped.layer for skipped in recording.skipped] == [
            "transformer.h.0.attn",
            "transformer.h.1.attn",
        ]
        assert all("unreadable eager call" in skipped.reason for skipped in recording.skipped)

        with (
            pytest.raises(RuntimeError, match="unreadable eager call"),
            AttentionCapture(model, strict=True).armed(),
        ):
            model(**inputs)


class HandWrittenModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.attention = HandWrittenAttention()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self.attention(self.embedding(ids)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
def test_the_monitors_warning_for_unseen_attention_names_the_extractor_to_register(tmp_path: Path) -> None:
    inputs = batch("right")
    data = DataLoader(TensorDataset(inputs["input_ids"], inputs["attention_mask"]), batch_size=BATCH)
    monitor = SpectralMonitor(every_n_steps=1, families=["attention"], figures_every_n_logs=0)
    with monitor_reports() as reports:
        fit(HandWrittenModel(), [monitor], tensorboard_logger(tmp_path), 2, data=data)
    (report,) = reports.messages
    assert "no attention-kernel call" in report
    assert "spectral_monitor.probes.register_attention_extractor(HandWrittenAttention, extractor)" in report


def test_the_plain_loop_monitor_logs_gemma2s_softcapped_attention_below_the_cap(tmp_path: Path) -> None:
    from spectral_monitor import Monitor

    torch.manual_seed(0)
    model = gemma2().train()
    inputs = batch("right")
    monitor = Monitor(model, tmp_path, every_n_steps=1, figures_every_n_logs=0, preflight=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported as not captured
        with monitor, monitor.step(0, batch=inputs):
            model(**inputs)
    series = scalar_series(read_back(tmp_path), "attention/")
    for layer in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        ((_, entropy),) = series[f"attention/entropy/{layer}"]
        ((_, max_logit),) = series[f"attention/max_logit_max/{layer}"]
        assert 0 < entropy < 1 and 0 < max_logit < GEMMA2_CAP
