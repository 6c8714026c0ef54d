"""The ``spectral-monitor`` command: ``demo`` trains the embedded model with the monitor watching it;
``report`` summarises a finished run from its event files.

``spectral-monitor demo`` runs a YAML config of the embedded demo (``configs/demo.yaml`` by default; see
``configs/`` for a run that collapses next to one that does not) through Lightning's ``LightningCLI``, logs to
TensorBoard under ``./runs``, prints only what the run itself has to say (warnings on one line, none that
the demo causes itself) and ends with the two commands that show the result: TensorBoard and ``report``.
``spectral-monitor sweep`` measures the demo model's (or a checkpoint's) attention and token metrics
against sequence length. Each subcommand is one ``_add_<name>_command`` function that declares its
arguments and the function that runs it.
Torch and Lightning are imported by the commands that train or run a model, so ``report`` starts without them.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import inspect
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from importlib import metadata, resources
from pathlib import Path
from typing import Any, NoReturn, TextIO

import yaml

__all__ = ["main", "shipped_configs"]

DEFAULT_CONFIG = "demo"
DEFAULT_LOGDIR = Path("runs")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``spectral-monitor``.

    Args:
        argv: The arguments; by default the process's.

    Returns:
        The exit status.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as empty:
        ...     main(["report", empty])  # no event files: an error on stderr and exit status 2
        2
    """
    parser = argparse.ArgumentParser(
        prog="spectral-monitor",
        description="Watch the attention, residual-stream and weight spectra of a transformer as it trains.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {metadata.version('spectral-monitor')}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo_command(commands)
    _add_sweep_command(commands)
    _add_report_command(commands)
    arguments = parser.parse_args(argv)
    return arguments.run(arguments)


def shipped_configs() -> dict[str, Path]:
    """The YAML configs that come with spectral-monitor, by name (file stem).

    From the ``configs/`` folder next to the package in a source checkout (or an editable install), else from
    the package data of an installed wheel.

    Returns:
        Each config's name → its path, by name.

    Examples:
        >>> "demo" in shipped_configs()
        True
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
    report.add_argument(
        "--processes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="processes that draw the plots (default: the usable cores, at most 4; 1: the report's own)",
    )
    report.set_defaults(run=_run_report)


def _run_report(arguments: argparse.Namespace) -> int:
    from spectral_monitor.report import ReportError, write_report

    try:
        write_report(
            arguments.logdir, arguments.out, processes=arguments.processes or _default_report_processes()
        )
    except ReportError as error:
        print(f"spectral-monitor report: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"spectral-monitor report: error: {_file_error(error, arguments.out)}", file=sys.stderr)
        return 2
    return 0


def _default_report_processes() -> int:
    """The report's default plot drawers: one per core this process may run on, at most 4 (each process
    costs its start and matplotlib's import, about half a second of CPU, and a share of fewer plots)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, usable))


def _file_error(error: OSError, out: Path | None) -> str:
    """What a failed read or write of ``report`` means to its user, and what to do about it."""
    where = f"{error.filename}: " if error.filename else ""
    advice = {
        errno.EROFS: "pass --out a folder you can write to",
        errno.EACCES: "pass --out a folder you can write to",
        errno.EPERM: "pass --out a folder you can write to",
        errno.EEXIST: "--out names the folder the report goes into, not a file",
        errno.ENOTDIR: "--out names the folder the report goes into, not a file",
        errno.ENOSPC: "free some space, or pass --out a folder on another disk",
    }.get(error.errno, "check the path and try again")
    target = "LOGDIR/report" if out is None else f"--out {out}"
    return f"could not write the report ({target}): {where}{error.strerror or error}; {advice}."


def _run_demo(arguments: argparse.Namespace) -> int:
    from pytorch_lightning.cli import LightningCLI

    from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

    config = arguments.config
    with contextlib.suppress(OSError, yaml.YAMLError):  # LightningCLI says what is wrong with those
        with open(config) as file:
            loaded = yaml.safe_load(file)
        if not isinstance(loaded, dict) or not loaded:
            got = "an empty file" if loaded is None else f"{type(loaded).__name__} {loaded!r}"
            print(
                f"spectral-monitor demo: error: {config}: a config is a mapping of trainer:, model: and "
                f"data: (as configs/demo.yaml), got {got}",
                file=sys.stderr,
            )
            return 2
    logger = {
        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(arguments.logdir), "name": config.stem},
    }
    cli_arguments = [
        f"--config={config}",
        f"--trainer.logger={json.dumps(logger)}",
        "--trainer.enable_progress_bar=true",
        # Rich's bar reads "Epoch 0/-2" when max_steps alone bounds the run; TQDM's names the epoch only.
        '--trainer.callbacks+={"class_path": "pytorch_lightning.callbacks.TQDMProgressBar"}',
    ]
    if arguments.max_steps is not None:
        cli_arguments.append(f"--trainer.max_steps={arguments.max_steps}")
    if arguments.seed is not None:
        seed = arguments.seed
        cli_arguments += [f"--seed_everything={seed}", f"--model.seed={seed}", f"--data.seed={seed}"]

    with _demo_console():
        # Subclass mode takes `model:` / `data:` as init arguments or as class_path + init_args.
        try:
            cli = LightningCLI(
                DemoTransformer,
                SyntheticDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=cli_arguments,
                run=False,
                parser_kwargs={"prog": "spectral-monitor demo", "exit_on_error": False},
            )
        except argparse.ArgumentError as error:  # the config does not parse: a key or a value's type
            print(f"spectral-monitor demo: error: {config}: {_config_problem(str(error))}", file=sys.stderr)
            return 2
        except (ValueError, TypeError) as error:  # a class of the config refused its arguments
            print(f"spectral-monitor demo: error: {config}: {_first_cause(error)}", file=sys.stderr)
            return 2
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    run = cli.trainer.logger.log_dir
    print(f"\nTensorBoard logs of this run: {run}")
    print("Next, open the dashboards (next to earlier runs), or read the verdict per diagnosis here:")
    print(f"  tensorboard --logdir {arguments.logdir}")
    print(f"  spectral-monitor report {run}")
    return 0


# Messages the demo causes itself and that tell its user nothing: LightningCLI's caution against passing
# `args` from a command that has arguments of its own (the demo builds `args` from them), and torch's
# deprecation of a pytree class that Lightning still uses.
_DEMO_OWN_WARNINGS = (
    (UserWarning, "LightningCLI's args parameter is intended"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)
# Where Lightning's rank-zero messages are logged, under each of its package names (imported or not yet).
_LIGHTNING_RANK_ZERO_LOGGERS = tuple(
    f"{package}.utilities.rank_zero"
    for package in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric")
)


class _NoTips(logging.Filter):
    """Drops Lightning's advertising tips ("💡 Tip: ... try installing ...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` without the source path and code line: the category and the message, on a
    line of its own under the progress bar."""
    from spectral_monitor.core.alerting import console_line_above_progress_bars

    stream = sys.stderr if file is None else file
    line = f"{category.__name__}: {message}"
    if not console_line_above_progress_bars(line, stream):
        print(line, file=stream)


@contextlib.contextmanager
def _demo_console() -> Iterator[None]:
    """While the demo trains: warnings as one line each, without those the demo itself causes, and
    without Lightning's tips; everything as before afterwards."""
    loggers = [logging.getLogger(name) for name in _LIGHTNING_RANK_ZERO_LOGGERS]
    no_tips = _NoTips()
    jsonargparse_switch = os.environ.get("JSONARGPARSE_DEPRECATION_WARNINGS")
    with warnings.catch_warnings():
        for category, message in _DEMO_OWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        warnings.showwarning = _one_line_warning
        # jsonargparse's own switch for the deprecations of its API that LightningCLI calls.
        os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"] = "off"
        for logger in loggers:
            logger.addFilter(no_tips)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(no_tips)
            if jsonargparse_switch is None:
                del os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"]
            else:
                os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"] = jsonargparse_switch


def _add_sweep_command(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="attention and token metrics of the demo model (or a checkpoint) against sequence length",
        description=(
            "Rank-collapse sweep: run the demo model (built from a config, or loaded from a checkpoint) on "
            "random tokens at each sequence length, print the attention and token metrics per layer against "
            "n, and write the table (sweep.md) and a figure with the random-attention baselines (sweep.png)."
        ),
    )
    source = sweep.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        type=_config_file,
        default=DEFAULT_CONFIG,
        help="build the model of this config (file or shipped name) at initialisation, with seq_len set to "
        "the longest length; default: %(default)s",
    )
    source.add_argument(
        "--checkpoint", type=Path, default=None, help="a DemoTransformer Lightning checkpoint (.ckpt) instead"
    )
    sweep.add_argument(
        "--lengths",
        type=_positive_int,
        nargs="+",
        default=[64, 128, 256, 512, 1024],
        help="sequence lengths, each >= 2 (default: %(default)s)",
    )
    sweep.add_argument(
        "--sequences",
        type=_positive_int,
        default=2,
        help="random sequences per length (default: %(default)s)",
    )
    sweep.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the random tokens")
    sweep.add_argument(
        "--out",
        type=Path,
        default=Path("sweep"),
        help="folder for sweep.md and sweep.png (default: %(default)s)",
    )
    sweep.set_defaults(run=_run_sweep)


def _run_sweep(arguments: argparse.Namespace) -> int:
    from spectral_monitor.demo import DemoTransformer
    from spectral_monitor.toolbox.sweep import rank_collapse_sweep, sweep_figure

    if min(arguments.lengths) < 2:
        raise SystemExit("spectral-monitor sweep: error: --lengths must all be >= 2")
    longest = max(arguments.lengths)
    if arguments.checkpoint is not None:
        if not arguments.checkpoint.is_file():
            raise SystemExit(
                f"spectral-monitor sweep: error: --checkpoint {arguments.checkpoint}: no such file"
            )
        try:
            model = DemoTransformer.load_from_checkpoint(arguments.checkpoint, map_location="cpu")
        except Exception as error:  # not a checkpoint, or not one of a DemoTransformer
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise SystemExit(
                f"spectral-monitor sweep: error: --checkpoint {arguments.checkpoint}: not a DemoTransformer "
                f"Lightning checkpoint ({type(error).__name__}: {cause})"
            ) from None
        if model.hparams.seq_len < longest:
            raise SystemExit(
                f"spectral-monitor sweep: error: the checkpoint's model has seq_len={model.hparams.seq_len}, "
                f"shorter than --lengths {longest}"
            )
        source = str(arguments.checkpoint)
    else:
        init_args = {**_model_arguments(arguments.config, DemoTransformer), "seq_len": longest}
        try:
            model = DemoTransformer(**init_args)
        except (ValueError, TypeError) as error:
            raise SystemExit(f"spectral-monitor sweep: error: {arguments.config}: model: {error}") from None
        source = f"{arguments.config.stem} at initialisation"
    result = rank_collapse_sweep(
        model, arguments.lengths, num_sequences=arguments.sequences, seed=arguments.seed
    )
    arguments.out.mkdir(parents=True, exist_ok=True)
    table = result.to_markdown()
    (arguments.out / "sweep.md").write_text(f"Rank-collapse sweep of {source}\n\n{table}\n")
    figure = sweep_figure(result, title=f"rank-collapse sweep: {source}")
    figure.savefig(arguments.out / "sweep.png")
    print(table)
    print(f"\nTable and figure written to {arguments.out}/sweep.md and {arguments.out}/sweep.png")
    return 0


# Lines of jsonargparse's error tree that only structure it, or that say a value is not the None of an
# Optional or not some other alternative of a Union: never the problem itself.
_STRUCTURE = re.compile(
    r"^(- )?(Does not validate against|Subtypes:|Errors:|Given value|Expected a <class 'NoneType'>|"
    r"Not a valid subclass|Subclass types expect|a class path|a dict |Problem with given class_path)"
)
_PARSER_KEY = re.compile(r'^(?:- )?Parser key "([^"]+)":\s*(.*)$')
_NOT_ACCEPTED = re.compile(r"(?:Option '([^']+)' is not accepted|does not accept option '([^']+)')")
_NOT_A_SUBCLASS = re.compile(r"^(- )?Not a valid subclass")


def _config_problem(message: str) -> str:
    """jsonargparse's error tree for a config that does not parse, on one line: the keys down to the first
    line that says what is wrong, and for an unknown key the known names closest to it."""
    path: list[tuple[int, str]] = []
    wrong_kind = None  # a value that is neither a class path nor a mapping: the problem if nothing deeper is
    for line in message.splitlines():
        indent, text = len(line) - len(line.lstrip()), line.strip()
        key = _PARSER_KEY.match(text)
        if key:
            path = [(depth, name) for depth, name in path if depth < indent] + [(indent, key[1])]
            text = key[2]
        keys = ".".join(name for depth, name in path if depth <= indent)
        if wrong_kind is None and _NOT_A_SUBCLASS.match(text):
            wrong_kind = f"{keys}: {text.removeprefix('- ')}: give a class path or a mapping of its arguments"
        if not text or _STRUCTURE.match(text):
            continue
        problem = f"{keys}: {text.removeprefix('- ')}" if keys else text.removeprefix("- ")
        unknown = _NOT_ACCEPTED.search(text)
        name = unknown and (unknown[1] or unknown[2])
        close = difflib.get_close_matches(name, _config_names(), n=1) if name else []
        return problem + (f" (did you mean {close[0]}?)" if close else "")
    return wrong_kind or " ".join(message.split())


def _config_names() -> list[str]:
    """The names a demo config's keys take: the monitor's options, the demo model's and data's arguments."""
    from pytorch_lightning import Trainer

    from spectral_monitor.core.options import keyword_names
    from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

    arguments = [
        name
        for owner in (DemoTransformer, SyntheticDataModule, Trainer)
        for name in inspect.signature(owner.__init__).parameters
        if name != "self"
    ]
    return [*keyword_names(), *arguments]


def _first_cause(error: BaseException) -> str:
    """The message of the exception that started ``error``'s chain, on one line: where a class of the config
    refused an argument, naming it, under the layers of jsonargparse that re-raised it."""
    while error.__cause__ is not None:
        error = error.__cause__
    return " ".join(str(error).split())


def _model_arguments(config: Path, model_class: type) -> dict[str, Any]:
    """The ``model:`` arguments of the LightningCLI config ``config`` (init arguments, or class_path +
    init_args), each an argument of ``model_class``; else SystemExit naming the key and what is allowed."""

    def refuse(problem: str) -> NoReturn:
        raise SystemExit(f"spectral-monitor sweep: error: {config}: {problem}")

    try:
        with open(config) as file:
            loaded = yaml.safe_load(file)
    except yaml.YAMLError as error:  # a syntax error, or a tag such as !!python/object that safe_load refuses
        refuse(f"not a YAML file the sweep reads ({' '.join(str(error).split())})")
    if not isinstance(loaded, dict):
        refuse(f"must be a mapping with a model: entry (a LightningCLI config), got {type(loaded).__name__}")
    model = loaded.get("model", {})
    if not isinstance(model, dict):
        refuse(f"model must be a mapping of {model_class.__name__}'s arguments, got {model!r}")
    init_args = model.get("init_args", {key: value for key, value in model.items() if key != "class_path"})
    if not isinstance(init_args, dict):
        refuse(f"model.init_args must be a mapping of {model_class.__name__}'s arguments, got {init_args!r}")
    allowed = [name for name in inspect.signature(model_class).parameters if name != "self"]
    unknown = sorted(str(key) for key in init_args if key not in allowed)
    if unknown:
        refuse(
            f"model.init_args: {', '.join(unknown)} not among the arguments of {model_class.__name__}, which "
            f"are {', '.join(allowed)}"
        )
    return init_args


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
