"""The Hugging Face Trainer callback: a real ``transformers.Trainer`` on a tiny GPT-2 writes the monitor's
tags into its own TensorBoard run, on its own steps, with the tags and values the Lightning callback writes
for the same model and batches; ``stop_on`` stops it; gradient accumulation measures each optimizer step
once, on its first micro-batch.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.events import read_back, scalar_series
from helpers.huggingface_runs import (
    BATCH,
    adamw,
    hf_train,
    padded_examples,
    trainer_gpt2,
    training_arguments,
)
from helpers.models import hook_count
from helpers.reliability import fit, tensorboard_logger

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from spectral_monitor import AlertConfig, CurvatureOptions, MonitorSession, Rule, SpectralMonitor  # noqa: E402
from spectral_monitor.alerts import Condition  # noqa: E402
from spectral_monitor.integrations.huggingface import (  # noqa: E402
    COMPILED_BY_THE_TRAINER,
    SpectralMonitorCallback,
    model_output_loss,
    tensorboard_run_directory,
)
from spectral_monitor.lightning.namespaces import pl  # noqa: E402

CHECKPOINTING = next(  # the name transformers 5 gives gradient checkpointing, else 4.x's
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in transformers.TrainingArguments.__dataclass_fields__
)
MONITOR_FAMILIES = ("attention/", "tokens/", "weights/", "outputs/", "alerts/")


class WrappedGPT2(pl.LightningModule):
    """The same GPT-2 in Lightning, trained on the same batches with the same optimizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self)


def monitor_scalars(directory: str | Path) -> dict[str, list]:
    return {
        tag: series
        for tag, series in scalar_series(read_back(directory)).items()
        if tag.startswith(MONITOR_FAMILIES)
    }


@pytest.mark.slow
def test_the_trainer_run_holds_the_lightning_callbacks_tags_and_values_on_its_own_steps(
    tmp_path: Path, one_thread: None
) -> None:
    model = trainer_gpt2()
    twin = copy.deepcopy(model)
    options = {"every_n_steps": 3, "figures_every_n_logs": 0}
    monitor = SpectralMonitorCallback(**options)
    hf_train(model, training_arguments(tmp_path / "hf"), monitor, count=6 * BATCH)

    run = Path(monitor.run_directory)
    assert run.parent == tmp_path / "hf" / "runs"  # 5.x: output_dir/runs/<Mon DD_HH-MM-SS>_<host>
    events = read_back(run)
    trainer_loss_steps = [event.step for event in events.Scalars("train/loss")]
    assert trainer_loss_steps == [1, 3, 6]  # logging_first_step, then every logging_steps
    hf = monitor_scalars(run)
    assert hf["attention/entropy/transformer.h.0.attn"]  # the sdpa attention was seen
    assert [step for step, _ in hf["weights/spectral_norm/transformer.h.1.attn.q"]] == trainer_loss_steps
    for tag, series in hf.items():
        assert {step for step, _ in series} <= set(trainer_loss_steps), tag
    (_, first), *_, (_, last) = hf["weights/spectral_norm/transformer.h.1.attn.q"]
    assert first != pytest.approx(last, abs=1e-3)  # training moved the weights: each step is its own

    lightning = WrappedGPT2(twin)
    data = torch.utils.data.DataLoader(padded_examples(6 * BATCH), batch_size=BATCH)
    logger = tensorboard_logger(tmp_path / "lightning")
    fit(lightning, [SpectralMonitor(**options)], logger, max_steps=6, data=data)
    # The LightningModule holds the GPT-2 as `model`: its layers' names start with "model.".
    lightning_scalars = monitor_scalars(logger.log_dir)
    expected = {tag.replace("/model.", "/"): series for tag, series in lightning_scalars.items()}

    assert sorted(hf) == sorted(expected)
    for tag, series in expected.items():
        # Lightning files batch g at step g, the Trainer at g + 1.
        assert [step + 1 for step, _ in series] == [step for step, _ in hf[tag]], tag
        for (_, ours), (step, theirs) in zip(hf[tag], series, strict=True):
            # Before any update the two measure the same weights on the same batch. After it, both runs
            # compute the same loss with the same kernels and AdamW (one thread: equal to the last bit
            # here); 1e-5 leaves room for another reduction order, which Adam amplifies on gradients near 0.
            tolerance = 1e-6 if step == 0 else 1e-5
            assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance), (tag, step)


def test_the_run_directory_is_the_explicit_one_then_logging_dir_then_the_environment_then_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    args = SimpleNamespace(output_dir=str(tmp_path), report_to=["tensorboard"])
    this_process = f"{socket.gethostname()}.{os.getpid()}"
    older, newer, other, ours = (tmp_path / "runs" / name for name in "abcd")
    for directory, name in (
        (older, f"1.{this_process}.0"),
        (newer, f"1.{this_process}.0"),
        (other, f"1.{this_process}9.0"),  # another process's
        (ours, f"1.{this_process}.1.spectral_monitor"),  # the monitor's own
    ):
        directory.mkdir(parents=True)
        (directory / f"events.out.tfevents.{name}").write_bytes(b"")
        time.sleep(0.01)  # modification times in that order
    assert tensorboard_run_directory(args) == str(newer)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "env"))
    assert tensorboard_run_directory(args) == str(tmp_path / "env")
    args.logging_dir = str(tmp_path / "v4")
    assert tensorboard_run_directory(args) == str(tmp_path / "v4")
    assert tensorboard_run_directory(args, str(tmp_path / "mine")) == str(tmp_path / "mine")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    made = tensorboard_run_directory(SimpleNamespace(output_dir=str(tmp_path), report_to=[]))
    assert Path(made).parent == tmp_path / "runs" and socket.gethostname() in Path(made).name
    assert made not in {str(older), str(newer), str(other), str(ours)}


def test_unknown_arguments_and_a_bad_log_dir_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="every_n_step.*every_n_steps"):
        SpectralMonitorCallback(every_n_step=3)
    with pytest.raises(ValueError, match="log_dir"):
        SpectralMonitorCallback(log_dir=3)
    with pytest.raises(ValueError, match="every_n_steps"):
        SpectralMonitorCallback(every_n_steps=0)


def test_the_default_loss_is_the_models_own_and_leaves_the_trainers_token_count_out() -> None:
    model = trainer_gpt2()
    batch = torch.utils.data.default_collate(padded_examples(BATCH))
    expected = model(**batch).loss
    assert model_output_loss(model, {**batch, "num_items_in_batch": torch.tensor(1)}) == expected
    with pytest.raises(ValueError, match="loss_fn"):
        model_output_loss(model, batch["input_ids"])
    with pytest.raises(ValueError, match="labels"):
        model_output_loss(model, {"input_ids": batch["input_ids"]})


@pytest.mark.slow
def test_a_stop_on_rule_stops_the_trainer_after_that_step_into_the_explicit_log_dir(
    tmp_path: Path, one_thread: None
) -> None:
    always = Rule("always", [Condition("attention/entropy", ">=", 0.0)])
    monitor = SpectralMonitorCallback(
        log_dir=tmp_path / "mine",
        every_n_steps=2,
        families=["attention"],
        preflight=False,
        alerts=AlertConfig(defaults=False, rules=[always]),
        stop_on=["always"],
    )
    model = trainer_gpt2()
    trainer = hf_train(model, training_arguments(tmp_path / "hf", logging_steps=2), monitor, count=6 * BATCH)
    assert trainer.state.global_step == 1  # the first logging step (batch 0) fired; max_steps was 6
    assert monitor.run_directory == str(tmp_path / "mine")
    series = monitor_scalars(tmp_path / "mine")
    assert series["alerts/fired/always"] == [(1, 2.0)]  # in both layers, on the Trainer's step 1
    assert hook_count(model) == 0


@pytest.mark.slow
def test_gradient_accumulation_and_checkpointing_measure_each_optimizer_step_once_on_its_first_micro_batch(
    tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    began: list[tuple[int, bool, torch.Tensor]] = []
    begin_step = MonitorSession.begin_step

    def recorded(session: MonitorSession, step: int, batch: Any, **kwargs: Any) -> bool:
        logging = begin_step(session, step, batch, **kwargs)
        began.append((step, logging, batch["input_ids"].clone()))
        return logging

    monkeypatch.setattr(MonitorSession, "begin_step", recorded)
    monitor = SpectralMonitorCallback(every_n_steps=1, families=["attention"], preflight=False)
    model = trainer_gpt2()
    arguments = training_arguments(
        tmp_path, max_steps=3, logging_steps=1, gradient_accumulation_steps=2, **{CHECKPOINTING: True}
    )
    hf_train(model, arguments, monitor, count=6 * BATCH)

    examples = padded_examples(6 * BATCH)
    assert [(step, logging) for step, logging, _ in began] == [(1, True), (2, True), (3, True)]
    for update, (_, _, ids) in enumerate(began):
        first_micro_batch = [example["input_ids"] for example in examples[2 * update * BATCH :][:BATCH]]
        assert torch.equal(ids, torch.stack(first_micro_batch))
    series = monitor_scalars(monitor.run_directory)
    assert [step for step, _ in series["attention/entropy/transformer.h.1.attn"]] == [1, 2, 3]
    # Gradient checkpointing leaves one forward hook of its own: the embeddings' `make_inputs_require_grads`.
    assert hook_count(model) == 1 and model.transformer.wte._forward_hooks


@pytest.mark.slow
def test_a_failing_monitor_leaves_training_going_with_one_warning_and_strict_raises_it(
    tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(MonitorSession, "begin_step", broken)
    model = trainer_gpt2()
    arguments = training_arguments(tmp_path, max_steps=2, logging_steps=1, report_to=[])
    with pytest.warns(RuntimeWarning, match="probe exploded") as warned:
        trainer = hf_train(model, arguments, SpectralMonitorCallback(every_n_steps=1), count=2 * BATCH)
    assert trainer.state.global_step == 2
    assert sum("probe exploded" in str(warning.message) for warning in warned) == 1
    assert hook_count(model) == 0
    with pytest.raises(RuntimeError, match="probe exploded"):
        hf_train(trainer_gpt2(), arguments, SpectralMonitorCallback(strict=True), count=2 * BATCH)


@pytest.mark.slow
def test_a_model_the_trainer_compiles_is_left_untouched_with_one_warning(
    tmp_path: Path, one_thread: None
) -> None:
    # Hooks added and removed around a compiled forward each step would recompile it, and a pre-hook inside
    # it would be traced: the callback must leave such a run exactly as it is without it.
    compiles, losses = {}, {}
    for name, monitor in (("alone", None), ("monitored", SpectralMonitorCallback(every_n_steps=1))):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = trainer_gpt2()
        arguments = training_arguments(
            tmp_path / name, max_steps=3, logging_steps=1, report_to=[], torch_compile=True
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = hf_train(model, arguments, monitor, count=3 * BATCH)
        compiles[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        ours = [warning for warning in caught if "SpectralMonitor" in str(warning.message)]
        assert [str(warning.message) for warning in ours] == (
            [] if monitor is None else [COMPILED_BY_THE_TRAINER]
        )
        assert hook_count(model) == 0
    assert compiles["monitored"] == compiles["alone"] > 0
    assert losses["monitored"] == losses["alone"] and len(losses["alone"]) == 3
    assert monitor.run_directory is None  # nothing written


@pytest.mark.slow
def test_the_second_order_probes_take_the_models_own_loss_in_the_trainer(
    tmp_path: Path, one_thread: None
) -> None:
    monitor = SpectralMonitorCallback(
        families=[], preflight=False, curvature=CurvatureOptions(every_n_steps=2, max_products=16)
    )
    hf_train(
        trainer_gpt2(), training_arguments(tmp_path, max_steps=3, logging_steps=2), monitor, count=3 * BATCH
    )
    (sharpness,) = scalar_series(read_back(monitor.run_directory), "curvature/sharpness/").values()
    assert [step for step, _ in sharpness] == [1, 2]  # batches 0 and 1 of (index + 1) % 2 == 0, and 0
    assert all(value > 0 for _, value in sharpness)


class ReferenceForwards(transformers.TrainerCallback):
    """Runs, at every step's start, the forwards a user's callback may run before the training forward:
    one in eval mode (an ``evaluate()``) and one in training mode without gradients (a reference model's
    forward), on a batch of its own."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.eval()
        model(**self.batch)
        model.train()
        with torch.no_grad():
            model(**self.batch)


@pytest.mark.slow
def test_forwards_run_before_the_training_forward_in_eval_mode_or_without_gradients_are_not_measured(
    tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    began: list[torch.Tensor] = []
    begin_step = MonitorSession.begin_step

    def recorded(session: MonitorSession, step: int, batch: Any, **kwargs: Any) -> bool:
        began.append(batch["input_ids"].clone())
        return begin_step(session, step, batch, **kwargs)

    monkeypatch.setattr(MonitorSession, "begin_step", recorded)
    options = {"every_n_steps": 1, "families": ["attention", "tokens"], "preflight": False}
    examples = padded_examples(4 * BATCH)
    other = torch.utils.data.default_collate(padded_examples(5 * BATCH)[4 * BATCH :])
    other["input_ids"] = other["input_ids"].flip(1)
    runs = {}
    for name, extra in (("plain", []), ("with_reference_forwards", [ReferenceForwards(other)])):
        began.clear()
        model = trainer_gpt2()
        monitor = SpectralMonitorCallback(**options)
        trainer = transformers.Trainer(
            model=model,
            args=training_arguments(tmp_path / name, max_steps=3, logging_steps=1),
            train_dataset=examples,
            callbacks=[monitor, *extra],
            optimizers=(adamw(model), None),
        )
        trainer.train()
        for update, ids in enumerate(began):  # the training micro-batch, every step
            assert torch.equal(ids, torch.stack([e["input_ids"] for e in examples[update * BATCH :][:BATCH]]))
        assert len(began) == 3
        runs[name] = monitor_scalars(monitor.run_directory)
        assert hook_count(model) == 0

    assert runs["plain"]["attention/entropy/transformer.h.1.attn"]
    assert sorted(runs["plain"]) == sorted(runs["with_reference_forwards"])
    for tag, series in runs["plain"].items():
        assert series == runs["with_reference_forwards"][tag], tag


def resumable_monitor() -> SpectralMonitorCallback:
    """Logs every step; a rule that holds on every layer fires after four evaluations in a row, so when it
    fires after a resume tells whether the alert history came back with the checkpoint."""
    always = Rule("always", [Condition("attention/entropy", ">=", 0.0)], patience=4)
    return SpectralMonitorCallback(
        every_n_steps=1,
        families=["attention", "weights"],
        preflight=False,
        figures_every_n_logs=0,
        alerts=AlertConfig(defaults=False, rules=[always]),
    )


def checkpointed_training(output_dir: Path, **overrides: Any) -> dict[str, Any]:
    return {"max_steps": 6, "logging_steps": 1, "save_strategy": "steps", "save_steps": 3, **overrides}


@pytest.mark.slow
def test_the_monitors_state_is_saved_with_each_checkpoint_and_a_resumed_run_goes_on_as_the_whole_one(
    tmp_path: Path, one_thread: None
) -> None:
    whole = resumable_monitor()
    arguments = training_arguments(tmp_path / "whole", **checkpointed_training(tmp_path / "whole"))
    hf_train(trainer_gpt2(), arguments, whole, count=6 * BATCH)
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert sorted(path.name for path in checkpoint.glob("spectral_monitor*")) == ["spectral_monitor.pt"]
    assert torch.load(checkpoint / "spectral_monitor.pt", weights_only=True)["logging_steps_done"] == 3
    expected = monitor_scalars(whole.run_directory)
    fired = expected["alerts/fired/always"]
    assert min(step for step, count in fired if count) == 4  # at the fourth evaluation

    # Resumed from a folder elsewhere (named in the arguments too), and from the output directory's own.
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copytree(checkpoint, copied / "checkpoint-3")
    for name, resume_from, extra in (
        ("elsewhere", str(checkpoint), {"resume_from_checkpoint": str(checkpoint)}),
        ("own", True, {}),
    ):
        output_dir = copied if name == "own" else tmp_path / name
        resumed = resumable_monitor()
        model = trainer_gpt2()
        trainer = transformers.Trainer(
            model=model,
            args=training_arguments(output_dir, **checkpointed_training(output_dir, **extra)),
            train_dataset=padded_examples(6 * BATCH),
            callbacks=[resumed],
            optimizers=(adamw(model), None),
        )
        trainer.train(resume_from_checkpoint=resume_from)
        got = monitor_scalars(resumed.run_directory)
        assert sorted(got) == sorted(expected), name
        for tag, series in expected.items():
            assert got[tag] == [(step, value) for step, value in series if step > 3], (name, tag)
        state, whole_state = resumed.state_dict(), whole.state_dict()
        assert state["logging_steps_done"] == whole_state["logging_steps_done"] == 6
        assert state["alerts"]["history"] == whole_state["alerts"]["history"]
        for key, vector in whole_state["weight_probe"]["right_vectors"].items():
            assert torch.equal(state["weight_probe"]["right_vectors"][key], vector), (name, key)


@pytest.mark.slow
def test_a_resumed_run_whose_checkpoint_lacks_the_monitors_state_warns_once_and_starts_it_anew(
    tmp_path: Path, one_thread: None
) -> None:
    arguments = training_arguments(tmp_path, **checkpointed_training(tmp_path, max_steps=3))
    hf_train(trainer_gpt2(), arguments, resumable_monitor(), count=6 * BATCH)
    (tmp_path / "checkpoint-3" / "spectral_monitor.pt").unlink()
    model = trainer_gpt2()
    trainer = transformers.Trainer(
        model=model,
        args=training_arguments(tmp_path, **checkpointed_training(tmp_path)),
        train_dataset=padded_examples(6 * BATCH),
        callbacks=[resumed := resumable_monitor()],
        optimizers=(adamw(model), None),
    )
    with pytest.warns(RuntimeWarning, match="resumed at step 3, but no spectral_monitor.pt") as warned:
        trainer.train(resume_from_checkpoint=True)
    assert sum("spectral_monitor.pt" in str(warning.message) for warning in warned) == 1
    assert resumed.state_dict()["logging_steps_done"] == 3  # steps 4 to 6 only
    assert not any(count for _, count in monitor_scalars(resumed.run_directory)["alerts/fired/always"])
