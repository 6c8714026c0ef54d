"""The ``spectral-monitor`` command: ``demo`` trains the embedded model with the monitor watching it;
``report`` summarises a finished run from its event files.

``spectral-monitor demo`` runs a YAML config of the embedded demo (``configs/demo.yaml`` by default; see
``configs/`` for a run that collapses next to one that does not) through Lightning's ``LightningCLI``, logs to
TensorBoard under ``./runs`` and prints the command that opens the result. Each subcommand is one
``_add_<name>_command`` function that declares its arguments and the function that runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from pytorch_lightning.cli import LightningCLI

from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

__all__ = ["main", "shipped_configs"]

DEFAULT_CONFIG = "demo"
DEFAULT_LOGDIR = Path("runs")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``spectral-monitor`` with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="spectral-monitor",
        description="Watch the attention, residual-stream and weight spectra of a transformer as it trains.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo_command(commands)
    _add_report_command(commands)
    arguments = parser.parse_args(argv)
    return arguments.run(arguments)


def shipped_configs() -> dict[str, Path]:
    """The YAML configs that come with spectral-monitor, by name (file stem).

    From the ``configs/`` folder next to the package in a source checkout (or an editable install), else from
    the package data of an installed wheel.
    """
    folder = _config_folder()
    return {} if folder is None else {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="train the embedded tiny transformer on a synthetic task with SpectralMonitor attached",
        description=(
            "Train the embedded demo transformer on a synthetic recall task (no download) with "
            "SpectralMonitor attached, logging to TensorBoard. The config is a LightningCLI YAML: model, "
            "data, trainer (callbacks included)."
        ),
    )
    demo.add_argument(
        "--config",
        type=_config_file,
        default=DEFAULT_CONFIG,
        help="a LightningCLI YAML file, or the name of a shipped config "
        f"(one of: {', '.join(shipped_configs()) or 'none found'}); default: %(default)s",
    )
    demo.add_argument(
        "--logdir",
        type=Path,
        default=DEFAULT_LOGDIR,
        help="folder of the TensorBoard logs; each run gets <logdir>/<config name>/version_<k> "
        "(default: %(default)s)",
    )
    demo.add_argument(
        "--max-steps", type=_positive_int, default=None, help="optimizer steps (default: the config's)"
    )
    demo.add_argument(
        "--seed",
        type=_non_negative_int,
        default=None,
        help="seed of the initialisation, the data and Lightning's RNGs (default: the config's)",
    )
    demo.set_defaults(run=_run_demo)


def _add_report_command(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="summarise a finished run from its TensorBoard event files: table, alerts, plots",
        description=(
            "Read the event files under LOGDIR (no training code), print a per-layer table of the key "
            "metrics (latest, min, trend) and the alerts with their steps, and write PNG plots and a "
            "Markdown summary for each run found."
        ),
    )
    report.add_argument("logdir", type=Path, metavar="LOGDIR", help="a run folder, or a folder of runs")
    report.add_argument(
        "--out", type=Path, default=None, help="folder of the plots and report.md (default: LOGDIR/report)"
    )
    report.set_defaults(run=_run_report)


def _run_report(arguments: argparse.Namespace) -> int:
    from spectral_monitor.report import ReportError, write_report

    try:
        write_report(arguments.logdir, arguments.out)
    except ReportError as error:
        print(f"spectral-monitor report: error: {error}", file=sys.stderr)
        return 2
    return 0


def _run_demo(arguments: argparse.Namespace) -> int:
    config = arguments.config
    logger = {
        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(arguments.logdir), "name": config.stem},
    }
    cli_arguments = [
        f"--config={config}",
        f"--trainer.logger={json.dumps(logger)}",
        "--trainer.enable_progress_bar=true",
    ]
    if arguments.max_steps is not None:
        cli_arguments.append(f"--trainer.max_steps={arguments.max_steps}")
    if arguments.seed is not None:
        seed = arguments.seed
        cli_arguments += [f"--seed_everything={seed}", f"--model.seed={seed}", f"--data.seed={seed}"]

    # Subclass mode takes `model:` / `data:` written either as init arguments or as class_path + init_args.
    cli = LightningCLI(
        DemoTransformer,
        SyntheticDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=cli_arguments,
        run=False,
        parser_kwargs={"prog": "spectral-monitor demo"},
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    print(f"\nTensorBoard logs of this run: {cli.trainer.logger.log_dir}")
    print("See them, next to earlier runs, with:")
    print(f"tensorboard --logdir {arguments.logdir}")
    return 0


def _config_file(config: str) -> Path:
    """A path to an existing file, else the shipped config of that name (``demo`` or ``demo.yaml``)."""
    path = Path(config)
    if path.is_file():
        return path
    shipped = shipped_configs()
    name = path.stem if path.suffix in (".yaml", ".yml") and path.parent == Path() else config
    if name in shipped:
        return shipped[name]
    raise argparse.ArgumentTypeError(
        f"{config!r} is neither a file nor a shipped config; shipped configs: "
        f"{', '.join(shipped) or 'none found (is spectral-monitor installed with its configs?)'}"
    )


def _config_folder() -> Path | None:
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if (checkout / f"{DEFAULT_CONFIG}.yaml").is_file():
        return checkout
    packaged = resources.files("spectral_monitor") / "configs"
    if packaged.is_dir():
        return Path(str(packaged))
    return None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


if __name__ == "__main__":
    raise SystemExit(main())
