"""A config the CLI cannot use is one message naming the key and what is allowed, and a non-zero exit: never
a traceback, and never code run from the file (``!!python/object`` is refused by the safe loader)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from spectral_monitor.cli import main, shipped_configs
from spectral_monitor.core.options import grouped_keywords


def demo_config(tmp_path: Path, **monitor_arguments: object) -> Path:
    config = yaml.safe_load(shipped_configs()["demo"].read_text())
    config["trainer"]["callbacks"][0]["init_args"]["options"].update(grouped_keywords(monitor_arguments))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"every_n_steps": -1}, "every_n_steps must be an int >= 1, got -1"),
        ({"memory_budget_mb": float("nan")}, "memory_budget_mb must be a finite positive number"),
        (
            {"stop_on": ["no_such_rule"]},
            "stop_on names rules ['no_such_rule'] that do not run; the rules are",
        ),
    ],
    ids=["every_n_steps", "memory_budget_mb", "stop_on"],
)
def test_a_demo_config_the_monitor_refuses_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: dict[str, object], message: str
) -> None:
    path = demo_config(tmp_path, **arguments)
    assert main(["demo", "--config", str(path), "--logdir", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    (line,) = [line for line in error.splitlines() if line.startswith("spectral-monitor demo: error:")]
    assert line.startswith(f"spectral-monitor demo: error: {path}: {message}")
    assert "Traceback" not in error
    assert not (tmp_path / "runs").exists()  # refused before anything trained


def misspelt(section: str, key: str, wrong: str) -> Callable[[dict], None]:
    """Renames ``key`` of a demo config's ``section`` (a path of keys) to ``wrong``."""

    def edit(config: dict) -> None:
        for name in section.split("."):
            config = config[name][0] if name == "callbacks" else config[name]
        config[wrong] = config.pop(key)

    return edit


def set_to(section: str, key: str, value: object) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for name in section.split("."):
            config = config[name]
        config[key] = value

    return edit


UNPARSED = {
    "monitor option misspelt": (
        misspelt("trainer.callbacks.init_args.options", "every_n_steps", "every_n_step"),
        "trainer.callbacks.options: Option 'every_n_step' is not accepted (did you mean every_n_steps?)",
    ),
    "monitor option of a wrong type": (
        lambda config: config["trainer"]["callbacks"][0]["init_args"]["options"].update(every_n_steps="abc"),
        "trainer.callbacks.options.every_n_steps: Expected a <class 'int'>. Got value: abc",
    ),
    "trainer value of a wrong type": (
        set_to("trainer", "max_steps", "three hundred"),
        "trainer.max_steps: Expected a <class 'int'>. Got value: three hundred",
    ),
    "model argument misspelt": (
        misspelt("model.init_args", "n_layers", "n_layer"),
        "model: Option 'n_layer' is not accepted (did you mean n_layers?)",
    ),
    "trainer argument misspelt": (
        misspelt("trainer", "max_steps", "max_step"),
        "Group 'trainer' does not accept option 'max_step' (did you mean max_steps?)",
    ),
    "empty": (lambda config: config.clear(), "a config is a mapping of trainer:, model: and data:"),
}


@pytest.mark.parametrize("case", UNPARSED, ids=list(UNPARSED))
def test_a_demo_config_that_does_not_parse_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    edit, message = UNPARSED[case]
    config = yaml.safe_load(shipped_configs()["demo"].read_text())
    edit(config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config) if config else "")
    assert main(["demo", "--config", str(path), "--logdir", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    assert error.splitlines()[-1].startswith(f"spectral-monitor demo: error: {path}: {message}")
    assert "usage:" not in error and "Traceback" not in error
    assert not (tmp_path / "runs").exists()


SWEEP_CONFIGS = {
    "empty": ("", "must be a mapping with a model: entry (a LightningCLI config), got NoneType"),
    "list": ("- model\n- data\n", "must be a mapping with a model: entry (a LightningCLI config), got list"),
    "model_5": ("model: 5\n", "model must be a mapping of DemoTransformer's arguments, got 5"),
    "unknown_key": (
        "model:\n  class_path: spectral_monitor.demo.DemoTransformer\n  init_args:\n    no_such: 1\n",
        "model.init_args: no_such not among the arguments of DemoTransformer, which are vocab_size, d_model",
    ),
    "python_object": (
        "model: !!python/object/apply:os.system ['echo ran > ran.txt']\n",
        "not a YAML file the sweep reads (could not determine a constructor for the tag",
    ),
    "bad_value": ("model:\n  d_model: -3\n", "model: d_model must be >= 1, got -3"),
}


@pytest.mark.parametrize("name", SWEEP_CONFIGS, ids=list(SWEEP_CONFIGS))
def test_a_sweep_config_it_cannot_use_is_one_line_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    text, message = SWEEP_CONFIGS[name]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "--config", str(path), "--lengths", "8", "--out", str(tmp_path / "sweep")])
    assert str(exit_.value).startswith(f"spectral-monitor sweep: error: {path}: {message}")
    assert "\n" not in str(exit_.value)
    assert not (tmp_path / "ran.txt").exists() and not (tmp_path / "sweep").exists()
