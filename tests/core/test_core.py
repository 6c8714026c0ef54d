"""The framework-free core: :class:`MonitorSession` imports without Lightning and runs a plain PyTorch loop,
its numbers checked against the attention weights ``nn.MultiheadAttention`` itself returns."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from spectral_monitor import (
    AlertConfig,
    CurvatureOptions,
    Measurement,
    MonitorOptions,
    MonitorSession,
    OutputOptions,
    ProbeDataOptions,
    Rule,
)
from spectral_monitor.alerts import Condition
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.sinks import Capability, Sink

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
VOCAB, WIDTH, HEADS, TOKENS = 16, 8, 2, 6


def test_the_core_and_the_flat_api_import_with_lightning_blocked() -> None:
    """``pytorch_lightning`` and ``lightning`` unimportable: the core, the plain-loop ``Monitor`` and every
    options class of the flat API still import, and nothing of Lightning or of the Lightning layer is
    loaded."""
    script = textwrap.dedent(
        """
        import sys
        for name in ("pytorch_lightning", "lightning"):
            sys.modules[name] = None  # `import` of either, or of a submodule, raises ImportError
        import spectral_monitor.core.session
        from spectral_monitor import (
            AlertConfig, CurvatureOptions, JacobianOptions, Measurement, Monitor, MonitorOptions,
            MonitorSession, NTKOptions, ProbeDataOptions,
        )
        loaded = [
            name for name in sys.modules
            if name.split(".")[0] in ("pytorch_lightning", "lightning") and sys.modules[name] is not None
            or name.startswith("spectral_monitor.lightning")
        ]
        assert not loaded, loaded
        try:
            from spectral_monitor import SpectralMonitor
        except ImportError as error:
            print("refused:", error)
        """
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout  # the block was real: the Lightning layer cannot import


class TinyAttention(nn.Module):
    """Embedding, one ``nn.MultiheadAttention`` with a residual, a linear head: a plain ``nn.Module``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states = self.embedding(tokens)
        mixed, _ = self.attention(states, states, states, need_weights=False)
        return self.head(states + mixed)


class RecordingSink(Sink):
    capabilities = frozenset({Capability.SCALARS})

    def __init__(self) -> None:
        self.records: list[Measurement] = []

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        self.records += list(records)


def reference_entropy(model: TinyAttention, tokens: torch.Tensor) -> float:
    """Normalised attention entropy in float64 from the module's own weights (``need_weights=True``), the
    mean over queries, heads and sequences."""
    with torch.no_grad():
        states = model.embedding(tokens)
        _, weights = model.attention(states, states, states, need_weights=True, average_attn_weights=False)
    probs = weights.double()
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(probs.shape[-1])
    return float(entropy.mean())


def test_a_plain_loop_logs_on_cadence_disarms_before_backward_and_measures_what_the_module_computes() -> None:
    torch.manual_seed(0)
    model = TinyAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    session = MonitorSession(
        MonitorOptions(every_n_steps=2, families=["attention", "weights"], preflight=False, strict=True)
    )
    sink = RecordingSink()
    session.start(model, [sink], disarm_after_forward=True)
    logging_steps, expected = [], {}
    for step in range(4):
        expected[step] = reference_entropy(model, tokens)
        if session.begin_step(step, tokens):
            logging_steps.append(step)
        logits = model(tokens)
        # The one-shot hook disarmed the capture when the forward returned: the backward runs unobserved.
        assert torch._C._len_torch_function_stack() == 0
        assert not model._forward_hooks
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert session.end_step() == []
    session.close()

    assert logging_steps == [0, 1, 3]  # (step + 1) % 2 == 0, and step 0
    entropy = {r.step: r.value for r in sink.records if r.tag == "attention/entropy/attention"}
    assert sorted(entropy) == logging_steps
    for step, value in entropy.items():
        assert value == pytest.approx(expected[step], abs=1e-5)
    assert expected[0] != pytest.approx(expected[3], abs=1e-4)  # training moved it: each step is its own
    assert {r.step for r in sink.records if r.tag == "weights/spectral_norm/attention.out_proj"} == {0, 1, 3}


def test_a_stop_on_rule_that_fires_is_returned_and_asks_the_integration_to_stop() -> None:
    always = Rule("always", [Condition("attention/entropy", ">=", 0.0)])
    session = MonitorSession(
        MonitorOptions(
            every_n_steps=1,
            families=["attention"],
            preflight=False,
            alerts=AlertConfig(defaults=False, rules=[always]),
            stop_on=["always"],
        )
    )
    asked: list[int] = []
    model = TinyAttention()
    session.start(model, [RecordingSink()], request_stop=lambda: asked.append(1))
    tokens = torch.randint(VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    assert session.begin_step(0, tokens)
    model(tokens)
    session.end_forward()
    assert session.end_step() == ["always"]
    assert asked == [1]
    session.close()


@pytest.mark.parametrize(
    ("cadence", "due"),
    [
        (Cadence.of_steps(4), [0, 3, 7, 11]),  # Lightning's log_every_n_steps rule, and step 0
        (Cadence.of_steps(4, first_step=False), [3, 7, 11]),
        (Cadence.of_steps(1), list(range(12))),
        (Cadence.of_steps(8, log_spaced=True), [0, 1, 3, 7]),  # dense early, then every 8th
        (Cadence.of_logs(4), [0, 4, 8]),  # every 4th logging step, starting with the first
        (Cadence.of_logs(1), list(range(12))),
        (Cadence.of_logs(0), []),
    ],
)
def test_each_cadence_falls_on_the_counts_its_rule_names(cadence: Cadence, due: list[int]) -> None:
    assert [count for count in range(12) if cadence.due(count)] == due


PRESET_VALUES = {
    "light": (("attention", "weights"), False, False, 0, 0, 0),
    "standard": (("attention", "tokens", "weights"), False, True, 10, 4, 0),
    "full": (("attention", "tokens", "weights", "curvature"), True, True, 10, 1, 10),
}


@pytest.mark.parametrize("preset", sorted(PRESET_VALUES))
def test_each_preset_sets_what_it_documents_and_an_explicit_argument_overrides_it(preset: str) -> None:
    options = MonitorOptions(preset=preset)
    assert (
        options.families,
        options.outputs.per_head,
        options.outputs.histograms,
        options.outputs.figures_every_n_logs,
        options.outputs.head_diversity_every_n_logs,
        options.outputs.weight_spectra_every_n_logs,
    ) == PRESET_VALUES[preset]
    assert MonitorOptions(preset=preset) == MonitorOptions(preset=preset)  # fresh options, equal
    overridden = MonitorOptions(
        preset=preset, outputs=OutputOptions(histograms=not options.outputs.histograms), families=["tokens"]
    )
    assert overridden.outputs.histograms is not options.outputs.histograms
    assert overridden.families[0] == "tokens"
    assert overridden.outputs.per_head is options.outputs.per_head  # the rest stays the preset's


def test_the_default_preset_is_the_standard_one() -> None:
    assert MonitorOptions() == MonitorOptions(preset="standard")


def test_a_step_offset_keeps_the_cadences_on_the_batch_index_and_files_under_the_callers_steps() -> None:
    """A framework that files a batch's scalars after its update (Hugging Face's ``global_step``) passes
    steps one ahead of the batch index; the logging and second-order cadences still count the index."""
    torch.manual_seed(0)
    model = TinyAttention()
    tokens = torch.randint(VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    session = MonitorSession(
        MonitorOptions(
            every_n_steps=2,
            families=["attention"],
            preflight=False,
            strict=True,
            curvature=CurvatureOptions(every_n_steps=3, max_products=8, tol=0.1),
            probe_data=ProbeDataOptions(loss_fn=lambda module, batch: module(batch).logsumexp(-1).mean()),
        )
    )
    sink = RecordingSink()
    session.start(model, [sink], disarm_after_forward=True, step_offset=1)
    logging_steps = []
    for step in range(1, 7):  # batches 0 to 5
        if session.begin_step(step, tokens):
            logging_steps.append(step)
        model(tokens)
        session.end_step()
    session.close()

    assert logging_steps == [1, 2, 4, 6]  # batches 0, 1, 3, 5: (index + 1) % 2 == 0, and index 0
    assert sorted({r.step for r in sink.records if r.family == "attention"}) == logging_steps
    assert sorted({r.step for r in sink.records if r.family == "curvature"}) == [1, 3, 6]  # batches 0, 2, 5
