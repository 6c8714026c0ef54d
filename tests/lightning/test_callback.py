"""SpectralMonitor in real ``Trainer.fit`` runs, its event files read back with TensorBoard's own reader.

What a run writes (scalars on exactly the logging steps, on the step axis ``self.log`` uses; histograms;
figures; the Custom Scalars layout), that the numbers are those of the model (recomputed independently with
``need_weights=True`` on a copy), that nothing is installed on the model between logging steps, and how
bad input and failures are reported. That the trajectory is unchanged: tests/core/test_non_perturbation.py.
"""

from __future__ import annotations

import copy
import csv
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers.events import scalar_at, scalar_steps
from helpers.lightning_runs import fit, tensorboard_logger
from helpers.lightning_runs import read_viewed as read_back
from helpers.models import HEADS, TinyEncoder, hook_count, previous_token_batches
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from spectral_monitor import SpectralMonitor
from spectral_monitor.catalog import CATALOG, metric_info
from spectral_monitor.core.attention_plan import attention_images
from spectral_monitor.core.session import HEATMAP_METRICS, HISTOGRAM_METRICS
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.metrics import attention_metrics, token_metrics
from spectral_monitor.probes import AttentionCapture, WeightProbe
from spectral_monitor.sinks.attention_images import DrawnHead

LAYERS = ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn")
BLOCKS = ("encoder.layers.0", "encoder.layers.1")
LAYOUT_TAG = "custom_scalars__config__"


pytestmark = pytest.mark.usefixtures("one_thread")


def monitor_warnings(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in record if "SpectralMonitor" in str(w.message) and text in str(w.message)]


# -- constructor -------------------------------------------------------------------------------------------


# Every argument's bad values: tests/core/test_configuration.py.


def test_heatmaps_of_one_shape_share_a_figure_and_each_image_is_its_own_layers() -> None:
    """The first and last layers' heatmaps are drawn on one kept figure while their shapes agree, and only
    the shapes of the last figure step are kept; every image is the fresh figure of its own layer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from spectral_monitor.sinks.figures import attention_block_means, attention_heatmap_figure

    rng = np.random.default_rng(0)

    def head(layer: str, queries: int) -> tuple[DrawnHead, np.ndarray]:
        attention = rng.random((queries, 8))
        attention /= attention.sum(axis=1, keepdims=True)
        blocks = attention_block_means(attention)
        return DrawnHead(layer, blocks, np.linalg.svd(attention, compute_uv=False), {}), attention

    images = attention_images()
    for step, last_queries in ((0, 8), (10, 8), (20, 6), (30, 8)):
        heads, attentions = zip(*(head("l0", 8), head("l1", 8), head("l2", last_queries)), strict=True)
        drawn = dict(images.drawn(list(heads)))
        assert len(images.heatmaps) == (1 if last_queries == 8 else 2)
        for drawn_head, attention in ((heads[0], attentions[0]), (heads[2], attentions[2])):
            image = drawn[f"attention/figures/heatmap/{drawn_head.layer}"]()
            canvas = FigureCanvasAgg(attention_heatmap_figure(attention, f"{drawn_head.layer}, head 0"))
            canvas.draw()
            assert np.array_equal(image, np.array(canvas.buffer_rgba())), (drawn_head.layer, step)


def test_an_unknown_family_is_reported_with_the_allowed_ones() -> None:
    allowed = r"\['attention', 'tokens', 'weights'\]"
    with pytest.raises(ValueError, match=allowed + r".*\['jacobians'\]"):
        SpectralMonitor(families=["attention", "jacobians"])


def test_state_key_tells_apart_monitors_that_measure_different_things() -> None:
    assert SpectralMonitor().state_key == SpectralMonitor(strict=True, histograms=False).state_key
    keys = {
        SpectralMonitor().state_key,
        SpectralMonitor(every_n_steps=10).state_key,
        SpectralMonitor(families=["weights"]).state_key,
        SpectralMonitor(include=["blocks.0*"]).state_key,
        SpectralMonitor(exclude=["blocks.0*"]).state_key,
    }
    assert len(keys) == 5


def test_load_state_dict_fills_missing_keys_with_defaults() -> None:
    monitor = SpectralMonitor()
    monitor.load_state_dict({})
    state = monitor.state_dict()
    assert state.pop("alerts") == {"subjects": [], "first": {}, "recent": {}, "history": [],
                                   "fired": dict.fromkeys(state_rules(monitor), 0)}  # fmt: skip
    assert state == {
        "last_logged_step": -1,
        "logging_steps_done": 0,
        "weight_probe": None,
        "second_order": None,
        "attention_krylov_vectors": {},
        "previous_max_logit": {},
    }


def state_rules(monitor: SpectralMonitor) -> list[str]:
    return [rule.name for rule in monitor._alerting.engine.rules]


# -- real runs ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    events: event_accumulator.EventAccumulator
    initial: TinyEncoder  # the model before its first update
    monitor: SpectralMonitor


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """6 steps, the monitor every 2 steps (and at step 0) with per-head scalars, figures every second logging
    step."""
    torch.manual_seed(0)
    model = TinyEncoder()
    initial = copy.deepcopy(model)
    monitor = SpectralMonitor(every_n_steps=2, figures_every_n_logs=2, per_head=True)
    logger = tensorboard_logger(tmp_path_factory.mktemp("tiny_run"))
    fit(model, [monitor], logger, max_steps=6, log_every_n_steps=2)
    return Run(read_back(logger.log_dir), initial, monitor)


TINY_RUN_LOGGING_STEPS = [0, 1, 3, 5]


@pytest.mark.slow
def test_every_family_lands_on_exactly_the_steps_of_self_log(tiny_run: Run) -> None:
    events = tiny_run.events
    # Lightning logs when (step + 1) % log_every_n_steps == 0, the monitor too, and also at step 0.
    assert scalar_steps(events, "train/loss") == [1, 3, 5]
    for layer in LAYERS:
        for metric in ("entropy", "spectral_gap", "eigen_gap", "effective_rank_ratio", "dobrushin"):
            tag = f"attention/{metric}/{layer}"
            heads = [f"{tag}/head_{head}" for head in range(HEADS)]
            spread = [
                f"attention/{metric}_{a}/{layer}" for a in metric_info("attention", metric).head_aggregates
            ]
            for written in (tag, *spread, *heads):
                assert scalar_steps(events, written) == TINY_RUN_LOGGING_STEPS, written
                assert all(math.isfinite(event.value) for event in events.Scalars(written)), written
    for block in BLOCKS:
        for metric in ("cosine_similarity", "token_residual", "stable_rank", "effective_rank"):
            assert scalar_steps(events, f"tokens/{metric}/{block}") == TINY_RUN_LOGGING_STEPS
    weight_tags = {tag for tag in events.Tags()["scalars"] if tag.startswith("weights/")}
    assert {f"weights/spectral_norm/{block}.linear1" for block in BLOCKS} <= weight_tags
    assert {f"weights/qk_spectral_norm_max/{layer}" for layer in LAYERS} <= weight_tags
    assert all(scalar_steps(events, tag) == TINY_RUN_LOGGING_STEPS for tag in weight_tags)


@pytest.mark.slow
def test_a_layer_scalar_is_the_mean_of_its_heads_between_their_min_and_max(tiny_run: Run) -> None:
    for layer in LAYERS:
        for metric in ("entropy", "spectral_gap", "effective_rank_ratio"):
            for step in TINY_RUN_LOGGING_STEPS:
                tag = f"attention/{metric}/{layer}"
                heads = [scalar_at(tiny_run.events, f"{tag}/head_{h}", step) for h in range(HEADS)]
                assert scalar_at(tiny_run.events, tag, step) == pytest.approx(np.mean(heads), rel=1e-6)
                lowest = scalar_at(tiny_run.events, f"attention/{metric}_min/{layer}", step)
                highest = scalar_at(tiny_run.events, f"attention/{metric}_max/{layer}", step)
                assert (lowest, highest) == pytest.approx((min(heads), max(heads)))


@pytest.mark.slow
def test_step_zero_matches_the_need_weights_attention_of_the_initial_model(tiny_run: Run) -> None:
    # Step 0 is measured before the first update, on the first max_sequences sequences of the first batch.
    tokens = next(iter(previous_token_batches()))[0][: tiny_run.monitor.max_sequences]
    with torch.no_grad():
        states = tiny_run.initial.embedding(tokens)
        for layer, block_name, block in zip(LAYERS, BLOCKS, tiny_run.initial.encoder.layers, strict=True):
            _, probs = block.self_attn(states, states, states, need_weights=True, average_attn_weights=False)
            expected = attention_metrics(probs.double())
            for metric in ("entropy", "sigma1", "effective_rank_ratio", "rank_one_residual"):
                for head in range(HEADS):
                    written = scalar_at(tiny_run.events, f"attention/{metric}/{layer}/head_{head}", 0)
                    assert written == pytest.approx(float(expected[metric][:, head].mean()), rel=1e-4)
            states = block(states)
            cosine = float(token_metrics(states.double())["cosine_similarity"].mean())
            assert scalar_at(tiny_run.events, f"tokens/cosine_similarity/{block_name}", 0) == pytest.approx(
                cosine, rel=1e-4
            )


@pytest.mark.slow
def test_histograms_hold_per_head_values_and_on_figure_steps_weight_spectra(tiny_run: Run) -> None:
    events = tiny_run.events
    # TensorBoard's default loader keeps one data class per tag: a shared tag would hide the scalar.
    assert not set(events.Tags()["histograms"]) & set(events.Tags()["scalars"])
    for layer in LAYERS:
        entropy = events.Histograms(f"attention/entropy_per_head/{layer}")
        assert [event.step for event in entropy] == TINY_RUN_LOGGING_STEPS
        assert all(event.histogram_value.num == HEADS for event in entropy)
        qk_norms = events.Histograms(f"weights/qk_spectral_norm_per_head/{layer}")
        assert [event.step for event in qk_norms] == TINY_RUN_LOGGING_STEPS
    # Full spectra, like figures, on logging steps 1 and 3 of 4 (figures_every_n_logs=2): steps 0 and 3.
    spectrum = events.Histograms(f"weights/singular_values/{BLOCKS[0]}.linear1")
    assert [event.step for event in spectrum] == [0, 3]
    assert spectrum[0].histogram_value.num == 16  # linear1 is 32 x 16


@pytest.mark.slow
def test_figures_are_drawn_on_every_second_logging_step(tiny_run: Run) -> None:
    images = set(tiny_run.events.Tags()["images"])
    assert images == {
        "attention/figures/spectrum",
        "attention/figures/entropy",
        "attention/figures/rank_one_residual",
        "attention/figures/effective_rank_ratio",
        *(f"attention/figures/heatmap/{layer}" for layer in LAYERS),
    }
    for tag in images:
        assert [event.step for event in tiny_run.events.Images(tag)] == [0, 3], tag


@pytest.mark.slow
def test_the_custom_scalars_layout_draws_one_line_per_layer_grouped_by_diagnosis(tiny_run: Run) -> None:
    events = tiny_run.events
    layout = layout_pb2.Layout.FromString(events.Tensors(LAYOUT_TAG)[-1].tensor_proto.string_val[0])
    charts = {(c.title, chart.title): list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    categories = {"Rank collapse", "Entropy", "Token collapse", "Weights", "Alerts", "Overhead"}
    assert categories == {c for c, _ in charts}
    for category, family, metric, layers in (
        ("Entropy", "attention", "entropy", LAYERS),
        ("Token collapse", "tokens", "token_residual", BLOCKS),
    ):
        regexes = charts[category, f"{family}/{metric}"]
        drawn = {tag for tag in events.Tags()["scalars"] if any(re.match(regex, tag) for regex in regexes)}
        assert drawn == {f"{family}/{metric}/{layer}" for layer in layers}


@pytest.mark.slow
def test_demo_transformer_scalars_share_the_step_axis_of_self_log(tmp_path: Path) -> None:
    model = DemoTransformer(vocab_size=24, d_model=32, n_layers=2, n_heads=2, seq_len=16)
    data = SyntheticDataModule(
        vocab_size=24,
        seq_len=16,
        batch_size=4,
        num_batches=8,
        num_keys=4,
        num_values=2,
        num_pairs=2,
        num_queries=1,
    )
    monitor = SpectralMonitor(every_n_steps=3, log_first_step=False, figures_every_n_logs=0)
    logger = tensorboard_logger(tmp_path)
    fit(model, [monitor], logger, max_steps=7, data=data, log_every_n_steps=3)
    events = read_back(logger.log_dir)
    scalars = set(events.Tags()["scalars"])

    loss_steps = scalar_steps(events, "train/loss")
    assert loss_steps == [2, 5]
    for block in ("blocks.0", "blocks.1"):
        assert scalar_steps(events, f"attention/entropy/{block}.attention") == loss_steps
        assert scalar_steps(events, f"tokens/token_residual/{block}") == loss_steps
        # The demo's attention is causal: its eigenvalues are its diagonal, so eigen_gap is not written.
        assert f"attention/eigen_gap/{block}.attention" not in scalars
    assert not events.Tags()["images"]


class HookCountingEncoder(TinyEncoder):
    """Records, during each training forward, how many hooks and torch-function modes are active."""

    def __init__(self) -> None:
        super().__init__(seed=None)
        self.hooks_by_step: dict[int, int] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.hooks_by_step[self.trainer.fit_loop.epoch_loop._batches_that_stepped] = hook_count(self)
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
def test_nothing_is_installed_on_the_model_between_logging_steps(tmp_path: Path) -> None:
    model = HookCountingEncoder()
    monitor = SpectralMonitor(every_n_steps=3, log_first_step=False, figures_every_n_logs=0)
    fit(model, [monitor], tensorboard_logger(tmp_path), max_steps=7)

    armed = {step for step, hooks in model.hooks_by_step.items() if hooks}
    assert armed == {2, 5}
    assert hook_count(model) == 0


def test_without_rank_sums_the_ranks_are_left_out_and_the_rest_is_written(tmp_path: Path) -> None:
    monitor = SpectralMonitor(
        every_n_steps=2,
        metric_method="krylov",
        attention_rank_sums=False,
        families=["attention"],
        figures_every_n_logs=1,
        head_diversity_every_n_logs=0,
    )
    logger = tensorboard_logger(tmp_path)
    fit(TinyEncoder(seed=None), [monitor], logger, max_steps=2)
    tags = read_back(logger.log_dir).Tags()
    attention = {tag.split("/")[1] for tag in tags["scalars"] if tag.startswith("attention/")}
    assert {"entropy", "sigma2", "spectral_gap", "eigen_gap", "dobrushin"} <= attention
    assert not {"effective_rank", "effective_rank_ratio", "threshold_rank"} & attention
    images = set(tags["images"])
    assert "attention/figures/spectrum" in images
    assert "attention/figures/effective_rank_ratio" not in images


@pytest.mark.slow
def test_a_non_tensorboard_logger_gets_the_scalars_and_one_warning(tmp_path: Path) -> None:
    logger = CSVLogger(save_dir=str(tmp_path), name="run", version=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            TinyEncoder(seed=None),
            [SpectralMonitor(every_n_steps=2)],
            logger,
            max_steps=4,
            log_every_n_steps=2,
        )

    (dropped,) = monitor_warnings(record, "keeps scalars only")
    assert "CSVLogger" in dropped and "histograms" in dropped and "figures" in dropped
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    tag = f"attention/entropy/{LAYERS[0]}"
    measured = [row for row in rows if row.get(tag)]
    assert [int(row["step"]) for row in measured] == [0, 1, 3]
    assert all(0 < float(row[tag]) <= 1 for row in measured)
    assert not list(tmp_path.rglob("events.out.tfevents*"))


@pytest.mark.slow
def test_a_trainer_without_a_logger_is_refused_at_setup() -> None:
    with pytest.raises(MisconfigurationException, match="needs a logger"):
        fit(TinyEncoder(seed=None), [SpectralMonitor()], logger=False, max_steps=1)


@pytest.mark.slow
def test_unmatched_patterns_warn_once_with_existing_module_names(tmp_path: Path) -> None:
    monitor = SpectralMonitor(every_n_steps=1, include=["encoder.layers.1*", "decoder.*"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(TinyEncoder(seed=None), [monitor], tensorboard_logger(tmp_path), max_steps=2, log_every_n_steps=1)

    (unmatched,) = monitor_warnings(record, "match no module")
    assert "decoder.*" in unmatched and "encoder.layers.1" not in unmatched.split("look like")[0]
    assert "encoder" in unmatched.split("look like")[1]
    scalars = set(read_back(str(tmp_path / "run" / "version_0")).Tags()["scalars"])
    assert f"attention/entropy/{LAYERS[1]}" in scalars and f"tokens/token_residual/{BLOCKS[1]}" in scalars
    assert not any(LAYERS[0] in tag or tag.endswith(BLOCKS[0]) for tag in scalars)


@pytest.mark.slow
def test_a_tight_memory_budget_keeps_fewer_sequences_and_says_so_once(tmp_path: Path) -> None:
    # Per layer and sequence, q, k and the probabilities take 2 heads x 3 x 8 x 8 x 4 bytes = 1.5 KiB:
    # 4 KiB holds one sequence of both layers, not two.
    monitor = SpectralMonitor(every_n_steps=1, memory_budget_mb=4 / 1024, per_head=True)
    logger = tensorboard_logger(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(TinyEncoder(seed=None), [monitor], logger, max_steps=3)

    # The capture's cut, and the working memory: 4 KiB holds no matrix's exact measurement.
    budget, working = sorted(
        monitor_warnings(record, "memory budget"), key=lambda message: "kept" not in message
    )
    assert "kept 1 of 2 sequences" in budget and all(layer in budget for layer in LAYERS)
    assert "too small for the exact measurement" in working and "Krylov path" in working
    assert scalar_steps(read_back(logger.log_dir), f"attention/entropy/{LAYERS[1]}/head_1") == [0, 1, 2]


def break_attention_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    def arm(self, token_mask=None, every_module=False):
        raise RuntimeError("probe broke")

    monkeypatch.setattr(AttentionCapture, "arm", arm)


@pytest.mark.slow
def test_a_failing_probe_is_reported_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_attention_capture(monkeypatch)
    logger = tensorboard_logger(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(TinyEncoder(seed=None), [SpectralMonitor(every_n_steps=1)], logger, max_steps=4)

    (failure,) = monitor_warnings(record, "probe broke")
    assert "arming the attention capture" in failure
    assert trainer.global_step == 4
    events = read_back(logger.log_dir)
    assert scalar_steps(events, f"tokens/token_residual/{BLOCKS[0]}") == [0, 1, 2, 3]
    assert not any(tag.startswith("attention/") for tag in events.Tags()["scalars"])


@pytest.mark.slow
def test_strict_mode_raises_the_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    break_attention_capture(monkeypatch)
    with pytest.raises(RuntimeError, match="probe broke"):
        fit(
            TinyEncoder(seed=None),
            [SpectralMonitor(every_n_steps=1, strict=True)],
            tensorboard_logger(tmp_path),
            4,
        )


def poisoned_encoder() -> TinyEncoder:
    model = TinyEncoder(seed=None)
    with torch.no_grad():
        model.embedding.weight[0] = math.nan  # every sequence holding token 0 turns to NaN
    return model


@pytest.mark.slow
def test_non_finite_measurements_are_written_and_reported_once(tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(poisoned_encoder(), [SpectralMonitor(every_n_steps=1)], logger, max_steps=3)

    assert len(monitor_warnings(record, "non-finite attention")) == 1
    assert len(monitor_warnings(record, "non-finite tokens")) == 1
    assert trainer.global_step == 3
    entropy = read_back(logger.log_dir).Scalars(f"attention/entropy/{LAYERS[0]}")
    assert [event.step for event in entropy] == [0, 1, 2]
    assert all(math.isnan(event.value) for event in entropy)


@pytest.mark.slow
def test_strict_mode_raises_on_non_finite_measurements(tmp_path: Path) -> None:
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        fit(poisoned_encoder(), [SpectralMonitor(strict=True)], tensorboard_logger(tmp_path), max_steps=1)


@pytest.mark.slow
def test_only_global_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl.Trainer, "is_global_zero", property(lambda trainer: False))
    logger = tensorboard_logger(tmp_path)
    model = HookCountingEncoder()
    fit(model, [SpectralMonitor(every_n_steps=2)], logger, max_steps=4, log_every_n_steps=2)

    assert {step for step, hooks in model.hooks_by_step.items() if hooks} == {0, 1, 3}  # it still measures
    scalars = read_back(logger.log_dir).Tags()["scalars"]
    assert "train/loss" in scalars
    assert not any(tag.startswith(("attention/", "tokens/", "weights/", "alerts/")) for tag in scalars)


@pytest.mark.slow
def test_a_resumed_run_keeps_the_cadence_and_the_warm_weight_vectors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = SpectralMonitor(every_n_steps=2, figures_every_n_logs=2)
    # Width 48: the 48 x 48 attention projections take the warm-started path (smaller ones are exact).
    trainer = fit(TinyEncoder(width=48, seed=None), [first], tensorboard_logger(tmp_path), max_steps=4)
    saved = first.state_dict()
    assert (saved["last_logged_step"], saved["logging_steps_done"]) == (3, 3)  # steps 0, 1, 3
    saved_vectors = saved["weight_probe"]["right_vectors"]
    assert saved_vectors
    checkpoint = tmp_path / "step_4.ckpt"
    trainer.save_checkpoint(checkpoint)

    loaded_vectors = {}
    load = WeightProbe.load_state_dict

    def spy(self, state_dict):
        loaded_vectors.update(state_dict["right_vectors"])
        load(self, state_dict)

    monkeypatch.setattr(WeightProbe, "load_state_dict", spy)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run", version=1)
    second = SpectralMonitor(every_n_steps=2, figures_every_n_logs=2)
    fit(TinyEncoder(width=48, seed=None), [second], logger, max_steps=8, ckpt_path=str(checkpoint))

    assert loaded_vectors.keys() == saved_vectors.keys()
    assert all(torch.equal(loaded_vectors[key], saved_vectors[key]) for key in saved_vectors)
    events = read_back(logger.log_dir)
    assert scalar_steps(events, f"attention/entropy/{LAYERS[0]}") == [5, 7]
    # Logging steps 4 and 5 of the run: figures (every second one, from the first) on the fifth only.
    assert [event.step for event in events.Images("attention/figures/spectrum")] == [7]


@pytest.mark.slow
def test_a_default_monitor_writes_at_most_30_scalars_per_attention_layer_of_12_heads(tmp_path: Path) -> None:
    """Per layer the head means, the catalogue's head aggregates and head diversity; per head only the
    histograms and the layer × head images; the Custom Scalars charts are exactly the written metrics."""
    model = DemoTransformer(vocab_size=24, d_model=48, n_layers=2, n_heads=12, seq_len=16, causal=False)
    data = SyntheticDataModule(
        vocab_size=24, seq_len=16, batch_size=4, num_batches=4, num_keys=4, num_values=2, num_pairs=2,
        num_queries=1,
    )  # fmt: skip
    logger = tensorboard_logger(tmp_path)
    fit(model, [SpectralMonitor(every_n_steps=2)], logger, max_steps=2, data=data, log_every_n_steps=2)
    events = read_back(logger.log_dir)
    scalars = set(events.Tags()["scalars"])
    layers = ("blocks.0.attention", "blocks.1.attention")
    for layer in layers:
        written = {tag for tag in scalars if tag.startswith("attention/") and layer in tag}
        assert len(written) <= 30, sorted(written)
        expected = {
            f"{name}/{layer}" for info in CATALOG if info.family == "attention" for name in info.written_names
        }
        assert written == expected  # bidirectional, so eigen_gap too: every attention metric of the catalogue
        for metric in HISTOGRAM_METRICS:
            histogram = events.Histograms(f"attention/{metric}_per_head/{layer}")
            assert [event.histogram_value.num for event in histogram] == [12, 12]
    assert not [tag for tag in scalars if re.search(r"/head_\d+$", tag)]
    assert {f"attention/figures/{metric}" for metric in HEATMAP_METRICS} <= set(events.Tags()["images"])

    layout = layout_pb2.Layout.FromString(events.Tensors(LAYOUT_TAG)[-1].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    monitor_tags = {tag for tag in scalars if tag.split("/")[0] in {info.family for info in CATALOG}}
    for title, regexes in charts.items():
        drawn = {tag for tag in monitor_tags if any(re.match(regex, tag) for regex in regexes)}
        assert drawn and all(tag.startswith(title + "/") for tag in drawn), title
    assert {"/".join(tag.split("/")[:2]) for tag in monitor_tags} == set(charts)
