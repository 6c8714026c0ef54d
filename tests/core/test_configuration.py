"""Configuration: every option is checked at construction, and every shipped YAML loads.

Each option ``SpectralMonitor`` takes (``options=`` and every flat keyword of ``MonitorOptions``) has bad
values here; a bad value raises ``ValueError`` whose message names the option and says what is allowed,
before any training starts. A new option without a case here fails
``test_every_option_has_bad_value_cases``. Patterns that match no module warn
once, listing module names that exist. Every ``configs/*.yaml``, present and future, instantiates through
``LightningCLI`` (no fit).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
from helpers.models import TinyEncoder
from helpers.reliability import fit, monitor_reports, tensorboard_logger
from jsonargparse import ArgumentParser
from pytorch_lightning.cli import LightningCLI

from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertConfig, Condition, Rule, default_rules
from spectral_monitor.core.options import keyword_names
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions, ProbeDataOptions
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.validation import check_metric_pattern

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))

# argument -> (bad values, what the message must say is allowed)
BAD_VALUES = {
    "every_n_steps": ([0, -3, 2.5, True, "10"], "int >= 1"),
    "families": (
        [["attention", "jacobians"], "attention", [], ["weights", 3], ["attention", "curvature"]],
        "['attention', 'tokens', 'weights']",
    ),
    "include": (["blocks.*", [3], [], [""]], "fnmatch patterns"),
    "exclude": (["blocks.*", [None], [3], [], [""]], "fnmatch patterns"),
    "block_patterns": (["blocks.*", [3], [], [""]], "fnmatch patterns"),
    "max_sequences": ([0, 1.5, False], "int >= 1"),
    "memory_budget_mb": ([0, -1.0, math.nan, math.inf, True, "256"], "positive number of megabytes"),
    "per_head": (["yes", 1], "True or False"),
    "histograms": ([1, "no"], "True or False"),
    "figures_every_n_logs": ([-1, 0.5], "int >= 0"),
    "metric_method": (["svd", "", None], "('auto', 'exact', 'krylov')"),
    "attention_rank_sums": (["no", 0], "True or False"),
    "attention_cost_ratio": ([0, -1.0, math.nan, -math.inf, True, "1"], "positive number (or math.inf"),
    "strict": ([None, 0, "true"], "True or False"),
    "log_first_step": (["no", 1], "True or False"),
    "curvature": ([{"top_k": 3}, 3, "yes"], "CurvatureOptions or None"),
    "jacobian": ([{"every_n_logs": 2}, True], "JacobianOptions or None"),
    "ntk": ([{"samples": 4}, 1.0], "NTKOptions or None"),
    "probe_data": ([{"source": "current"}, "current"], "ProbeDataOptions or None"),
    "head_diversity_every_n_logs": ([-1, 1.5], "int >= 0"),
    "weight_spectra_every_n_logs": ([-2, "4"], "int >= 0"),
    "preflight": (["yes", 1], "True or False"),
    "preflight_context_length": ([1, 0, 2.5], "int >= 2"),
    "alerts": ([{"disable": ["non_finite"]}, "default"], "AlertConfig"),
    "on_alert": (["print", 3], "callable"),
    "stop_on": (["rank_collapse", ["no_such_rule"]], "rule"),
    "token_mask": ([3, "attention_mask"], "function of the batch"),
    "attention_families": ([{"padding_mask_keywords": ["pad"]}, "default"], "AttentionFamilies or None"),
    "output_logits": ([1, None, ""], "True, False or the name of the LM head module"),
    "preset": (["heavy", None, "Light"], "('light', 'standard', 'full')"),
    "capture": ([{"max_sequences": 1}, 3], "CaptureOptions or None"),
    "outputs": ([{"per_head": True}, "all"], "OutputOptions or None"),
    "budget": ([{"memory_budget_mb": 64}, 64], "BudgetOptions or None"),
    "options": ([{"every_n_steps": 5}, 5], "MonitorOptions or None"),
}

BAD_CASES = [
    pytest.param(argument, value, allowed, id=f"{argument}={value!r}")
    for argument, (values, allowed) in BAD_VALUES.items()
    for value in values
]


def test_every_option_has_bad_value_cases() -> None:
    assert list(inspect.signature(SpectralMonitor.__init__).parameters) == ["self", "options", "keywords"]
    assert sorted(BAD_VALUES) == sorted(["options", *keyword_names()])


@pytest.mark.parametrize(("argument", "value", "allowed"), BAD_CASES)
def test_a_bad_value_raises_naming_the_argument_and_what_is_allowed(
    argument: str, value, allowed: str
) -> None:
    with pytest.raises(ValueError) as raised:
        SpectralMonitor(**{argument: value})
    message = str(raised.value)
    assert message.startswith(argument) and allowed in message, message


def test_the_defaults_are_valid() -> None:
    SpectralMonitor()


@pytest.mark.parametrize("value", ["no", 0, None])
def test_min_eigenvalue_of_the_curvature_options_must_be_a_bool(value) -> None:
    # The option dataclasses check their own fields; the table above covers the monitor's arguments.
    with pytest.raises(ValueError, match=rf"^min_eigenvalue must be a bool \(True or False\), got {value!r}"):
        CurvatureOptions(min_eigenvalue=value)


@pytest.mark.slow
def test_patterns_matching_nothing_warn_once_listing_module_names(tmp_path: Path) -> None:
    monitor = SpectralMonitor(
        every_n_steps=1, include=["encoder.*", "decoder.*"], exclude=["*.dropout9"], figures_every_n_logs=0
    )
    model = TinyEncoder()
    with monitor_reports() as reports:
        fit(model, [monitor], tensorboard_logger(tmp_path), 2)
        fit(model, [monitor], tensorboard_logger(tmp_path, version=1), 3)  # the same monitor, fitted again

    (report,) = [message for message in reports.messages if "match no module" in message]
    unmatched, _, examples = report.partition("look like")
    assert "decoder.*" in unmatched and "*.dropout9" in unmatched and "encoder.*" not in unmatched
    assert "embedding" in examples and "encoder.layers.0" in examples


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_every_shipped_config_instantiates_through_lightning_cli(
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a config's relative log directory lands here
    cli = LightningCLI(
        DemoTransformer,
        SyntheticDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[f"--config={config}"],
        run=False,
    )
    monitors = [callback for callback in cli.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    assert monitors, f"{config.name} attaches no SpectralMonitor"
    assert isinstance(cli.model, DemoTransformer) and isinstance(cli.datamodule, SyntheticDataModule)
    assert cli.model.hparams.seq_len >= cli.datamodule.hparams.seq_len
    assert cli.model.hparams.vocab_size >= cli.datamodule.hparams.vocab_size


def test_there_are_configs_to_check() -> None:
    assert len(CONFIGS) >= 3


REFUSED_AT_CONSTRUCTION = [
    pytest.param(lambda: SpectralMonitor(memory_budget_mb=1e-12), "memory_budget_mb", id="budget-1e-12"),
    pytest.param(lambda: AlertConfig(disable=[5]), "disable", id="disable-int"),
    pytest.param(lambda: AlertConfig(disable="token_collapse"), "disable", id="disable-str"),
    pytest.param(lambda: AlertConfig(tune={"rank_collapse": 4}), "tune['rank_collapse']", id="tune-int"),
    pytest.param(lambda: AlertConfig(defaults="no"), "defaults", id="defaults-str"),
    pytest.param(lambda: SpectralMonitor(stop_on=5), "stop_on", id="stop_on-int"),
    pytest.param(lambda: SpectralMonitor(stop_on=None), "stop_on", id="stop_on-None"),
    pytest.param(lambda: JacobianOptions(residual_branch="no"), "residual_branch", id="residual_branch-str"),
    pytest.param(lambda: JacobianOptions(end_to_end=1), "end_to_end", id="end_to_end-int"),
    pytest.param(lambda: NTKOptions(max_megabytes=True), "max_megabytes", id="max_megabytes-bool"),
    pytest.param(lambda: CurvatureOptions(blocks="mlp"), "blocks", id="blocks-str"),
    pytest.param(lambda: CurvatureOptions(trace_products=False), "trace_products", id="trace_products-bool"),
    pytest.param(lambda: ProbeDataOptions(probe_batches=True), "probe_batches", id="probe_batches-bool"),
    pytest.param(
        lambda: AlertConfig(rules=[Rule("mine", [Condition("atention/entropy", "<=", 0.1)])]),
        "rules: the metric of rule 'mine' 'atention/entropy'",
        id="misspelt-metric",
    ),
    pytest.param(
        lambda: SpectralMonitor(families=["attention", "weights"], stop_on=["edge_of_stability"]),
        "stop_on names rule 'edge_of_stability'",
        id="stop_on-family-off",
    ),
]


@pytest.mark.parametrize(("make", "named"), REFUSED_AT_CONSTRUCTION)
def test_bad_arguments_of_the_monitor_and_its_options_are_refused_naming_them(make, named: str) -> None:
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value).startswith(named), str(raised.value)


def test_a_misspelt_metric_is_refused_with_the_name_it_was_meant_to_be() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'attention/entropy'"):
        AlertConfig(rules=[Rule("mine", [Condition("atention/entropy", "<=", 0.1)])])


def test_a_misspelt_metric_in_yaml_is_refused_when_lightning_cli_builds_the_monitor() -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(SpectralMonitor, "monitor")
    config = parser.parse_string(
        """
monitor:
  options:
    alerts:
      rules:
        - name: low_entropy
          conditions: [{metric: atention/entropy, op: "<=", threshold: 0.1}]
"""
    )
    with pytest.raises(ValueError, match=r"did you mean 'attention/entropy'"):
        parser.instantiate(config)


def test_every_metric_the_default_rules_read_is_known_and_a_rule_on_a_turned_on_family_may_stop() -> None:
    for rule in default_rules():
        for condition in rule.conditions:
            check_metric_pattern("metric", condition.metric)
    monitor = SpectralMonitor(curvature=CurvatureOptions(), stop_on=["edge_of_stability", "non_finite"])
    assert monitor._alerting.stop_on == ("edge_of_stability", "non_finite")
