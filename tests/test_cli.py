"""The ``spectral-monitor`` command line: ``demo`` trains with the monitor and says where the logs are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from spectral_monitor.cli import main, shipped_configs

MONITOR_FAMILIES = ("attention/", "tokens/", "weights/")

TINY_CONFIG = """\
seed_everything: 0
model:
  d_model: 16
  n_layers: 1
  n_heads: 2
  seq_len: 16
data:
  seq_len: 16
  batch_size: 4
  num_batches: 8
trainer:
  max_steps: 100
  accelerator: cpu
  enable_checkpointing: false
  callbacks:
    - class_path: spectral_monitor.SpectralMonitor
      init_args:
        options:
          every_n_steps: 2
          outputs:
            figures_every_n_logs: 0
"""

# Bidirectional attention checked at a context far beyond its 16 positions: the preflight's logit-scale
# check warns; everything else is quiet.
PREFLIGHT_WARNING_CONFIG = """\
seed_everything: 0
model:
  d_model: 16
  n_layers: 1
  n_heads: 2
  seq_len: 16
  causal: false
data:
  seq_len: 16
  batch_size: 4
  num_batches: 8
trainer:
  log_every_n_steps: 1
  callbacks:
    - class_path: spectral_monitor.SpectralMonitor
      init_args:
        options:
          preflight_context_length: 8192
          outputs:
            figures_every_n_logs: 0
"""

pytestmark = pytest.mark.usefixtures("one_thread")


def scalar_tags(run: Path) -> dict[str, list[int]]:
    accumulator = event_accumulator.EventAccumulator(str(run), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_the_demo_config_ships_with_the_package() -> None:
    assert "demo" in shipped_configs()
    assert shipped_configs()["demo"].is_file()


@pytest.mark.slow
def test_demo_trains_with_the_monitor_and_prints_how_to_open_the_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--max-steps", "6", "--logdir", str(tmp_path)]) == 0

    (run,) = tmp_path.glob("demo/version_*")
    assert list(run.glob("events.out.tfevents*"))
    steps = scalar_tags(run)
    assert any(tag.startswith(MONITOR_FAMILIES) for tag in steps)
    assert max(step for tag_steps in steps.values() for step in tag_steps) < 6
    output = capsys.readouterr().out
    assert str(run) in output
    commands = [line.strip() for line in output.splitlines()]
    assert f"tensorboard --logdir {tmp_path}" in commands
    assert f"spectral-monitor report {run}" in commands


@pytest.mark.slow
def test_demo_runs_a_config_file_with_the_given_steps_and_seed(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    logdir = tmp_path / "logs"
    argv = ["demo", "--config", str(config), "--logdir", str(logdir), "--max-steps", "4", "--seed", "7"]
    assert main(argv) == 0

    steps = scalar_tags(logdir / "tiny" / "version_0")
    # log_first_step, then (step + 1) % 2 == 0, within the 4 steps asked for (not the config's 100).
    assert steps["attention/entropy/blocks.0.attention"] == [0, 1, 3]
    saved = (logdir / "tiny" / "version_0" / "config.yaml").read_text()
    assert "seed_everything: 7" in saved and "seed: 7" in saved


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--config", "no-such-config"], "--config"),
        (["demo", "--max-steps", "0"], "--max-steps"),
        (["demo", "--seed", "-1"], "--seed"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_exit_with_a_message_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def spectral_monitor_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``spectral-monitor ARGV`` in a fresh process, as a user runs it: stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "spectral_monitor.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": ""},
        timeout=600,
    )


def test_version_prints_the_installed_version(tmp_path: Path) -> None:
    run = spectral_monitor_command("--version", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"spectral-monitor {metadata.version('spectral-monitor')}"


@pytest.mark.slow
def test_the_demo_screen_shows_only_its_own_findings_and_ends_with_both_next_steps(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(PREFLIGHT_WARNING_CONFIG)
    run = spectral_monitor_command("demo", "--config", str(config), "--max-steps", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    screen = run.stdout + run.stderr

    preflight = [line for line in screen.splitlines() if "SpectralMonitor preflight (logit_scale" in line]
    assert preflight and all(
        line.startswith("RuntimeWarning: SpectralMonitor preflight") for line in preflight
    )
    assert not re.search(r"\.py:\d+: ", screen), screen  # no source path and line of a warning
    for noise in (
        "LightningCLI's args parameter",
        "💡 Tip",
        "LeafSpec",
        "Epoch 0/-",
        "Warning: " + "jsonargparse",
    ):
        assert noise not in screen, (noise, screen)
    assert [line for line in screen.splitlines() if "Warning" in line] == preflight

    (run_directory,) = (tmp_path / "runs" / "tiny").glob("version_*")
    closing = [line.strip() for line in run.stdout.splitlines()[-2:]]
    assert closing == [
        "tensorboard --logdir runs",
        f"spectral-monitor report {run_directory.relative_to(tmp_path)}",
    ]
