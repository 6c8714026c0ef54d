"""Benchmark: what the default ``SpectralMonitor`` costs a training run, against the same run without it.

The demo model and task of ``configs/demo.yaml`` are trained for ``--steps`` steps in fresh processes, with
and without ``SpectralMonitor()`` (every default, cadence included: every 50 steps; ``--every N`` changes
only the cadence), in interleaved pairs (off, on, on, off, ...) so drift of the machine hits both alike.
Each worker reports its ``fit`` wall time, the wall time of every step (from one batch start to the next,
so the monitor's work in any hook is inside), the time spent inside the monitor's own hooks, and its peak
resident memory. The table gives medians over pairs and the ratios on vs off: the whole run, logging
steps, and non-logging steps (which should cost ~nothing). The time inside the hooks is the monitor's
direct cost; on a shared 2-core machine whole runs of the same configuration differ by 10-20% from one
process to the next, far more than the few percent measured, so it is the steadier figure. It is also
split into what a run pays once (setup and the first logging step, where every figure is drawn new) and
the rest, which grows with the run's length: the share a long run converges to.

    python benchmarks/bench_overhead.py --steps 300 --pairs 2

``--interleaved`` measures in one process instead, where the drift between processes cannot enter: one fit,
its steps in alternating blocks of ``2 * every_n_steps`` without and with the monitor (its per-step hooks
skip the "off" blocks, so each "on" block holds two logging steps at the default cadence, and a figure step
every tenth logging step as in a real run). The whole step is timed, the armed forward and backward
included, which the hook time leaves out. The first pair of blocks, where the first logging step draws every
figure new, is left out of the ratio and reported as the once-per-run cost.

    python benchmarks/bench_overhead.py --interleaved --steps 4000
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import describe_machine, markdown_table

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "demo.yaml"


def worker(monitor: bool, steps: int, every: int | None) -> dict[str, object]:
    import pytorch_lightning as pl
    import yaml

    from spectral_monitor import SpectralMonitor
    from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

    config = yaml.safe_load(CONFIG.read_text())
    arguments = {} if every is None else {"every_n_steps": every}
    every = SpectralMonitor(**arguments).every_n_steps

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    # Seconds inside the hooks by step: -1 before the first batch (setup), else the batch's index.
    hook_seconds: dict[int, float] = {}
    if monitor:
        callbacks.append(
            timed_hooks(SpectralMonitor(**arguments), hook_seconds, lambda: len(clock.starts) - 1)
        )
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        logger=pl.loggers.TensorBoardLogger(
            f"/tmp/spectral_monitor_bench_overhead/{'on' if monitor else 'off'}"
        ),
    )
    model = DemoTransformer(**config["model"]["init_args"])
    data = SyntheticDataModule(**config["data"]["init_args"])
    start = time.perf_counter()
    trainer.fit(model, data)
    fit_seconds = time.perf_counter() - start
    durations = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    logging = [d for step, d in enumerate(durations) if step == 0 or (step + 1) % every == 0]
    quiet = [d for step, d in enumerate(durations) if not (step == 0 or (step + 1) % every == 0)]
    return {
        "fit_seconds": fit_seconds,
        "logging_step_ms": 1000 * statistics.median(logging),
        "quiet_step_ms": 1000 * statistics.median(quiet),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "hook_seconds": sum(hook_seconds.values()),
        # What a run pays once (setup, and the first logging step: every figure drawn new, the cold weight
        # solves), and the rest, which grows with the run's length.
        "one_time_hook_seconds": hook_seconds.get(-1, 0.0) + hook_seconds.get(0, 0.0),
    }


HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_train_batch_end",
    "teardown",
)


def timed_hooks(callback, seconds: dict[int, float], step: Callable[[], int]):
    """``callback`` with each of its ``HOOKS`` adding its wall time to ``seconds[step()]``."""
    for name in HOOKS:
        hook = getattr(callback, name)

        def timed(*args, hook=hook, **kwargs):
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                key = step()
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start

        setattr(callback, name, timed)
    return callback


PER_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_train_batch_end")


def interleaved(steps: int, every: int | None) -> None:
    """One fit with the monitor on in every other block of ``2 * every`` steps; prints the ratio table."""
    import pytorch_lightning as pl
    import yaml

    from spectral_monitor import SpectralMonitor
    from spectral_monitor.demo import DemoTransformer, SyntheticDataModule

    config = yaml.safe_load(CONFIG.read_text())
    monitor = SpectralMonitor(**({} if every is None else {"every_n_steps": every}))
    block = 2 * monitor.every_n_steps
    if steps < 4 * block:
        raise SystemExit(f"--steps must be at least {4 * block} (two pairs of blocks of {block})")

    starts: list[float] = []
    step = {"now": 0}

    class StepClock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            starts.append(time.perf_counter())
            step["now"] = trainer.global_step

        def on_train_end(self, *args: object) -> None:
            starts.append(time.perf_counter())

    def monitored(index: int) -> bool:
        return (index // block) % 2 == 1

    hook_seconds: dict[int, float] = {}  # by step; -1 before the first (setup, on_fit_start)
    timed_hooks(monitor, hook_seconds, lambda: len(starts) - 1)
    for name in PER_STEP_HOOKS:
        hook = getattr(monitor, name)

        def gated(*args, hook=hook, **kwargs):
            return hook(*args, **kwargs) if monitored(step["now"]) else None

        setattr(monitor, name, gated)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=monitor.every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepClock(), monitor],
        logger=pl.loggers.TensorBoardLogger("/tmp/spectral_monitor_bench_overhead/interleaved"),
    )
    trainer.fit(
        DemoTransformer(**config["model"]["init_args"]), SyntheticDataModule(**config["data"]["init_args"])
    )
    durations = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    pairs = len(durations) // (2 * block)
    kept = range(2 * block, 2 * block * pairs)  # whole pairs after the first
    off = sum(durations[i] for i in kept if not monitored(i))
    on = sum(durations[i] for i in kept if monitored(i))
    first_off = sum(durations[:block])
    first_on = sum(durations[block : 2 * block])

    def is_logging(index: int) -> bool:
        return (index + 1) % monitor.every_n_steps == 0

    logging_steps = sum(1 for i in kept if monitored(i) and is_logging(i))

    def median_ms(on_blocks: bool, logging: bool) -> float:
        chosen = [durations[i] for i in kept if monitored(i) == on_blocks and is_logging(i) == logging]
        return 1000 * statistics.median(chosen)

    print(describe_machine())
    print(
        f"\ndemo model ({CONFIG.name}), {steps} steps in one process, monitor every "
        f"{monitor.every_n_steps} steps, on in every other block of {block} steps; "
        f"{pairs - 1} pairs of blocks compared, the first pair apart\n"
    )
    rows = [
        ["training time of the compared blocks (s)", f"{off:.2f}", f"{on:.2f}", f"{on / off:.4f}"],
        [
            "the first pair of blocks (s)",
            f"{first_off:.2f}",
            f"{first_on:.2f}",
            f"{first_on / first_off:.4f}",
        ],
        *(
            [
                label,
                f"{median_ms(False, logging):.2f}",
                f"{median_ms(True, logging):.2f}",
                f"{median_ms(True, logging) / median_ms(False, logging):.4f}",
            ]
            for label, logging in [
                ("logging step of the compared blocks (ms, median)", True),
                ("non-logging step of the compared blocks (ms, median)", False),
            ]
        ),
    ]
    print(markdown_table(["measure", "without monitor", "with monitor", "ratio"], rows))
    print(
        f"\nextra per logging step in the compared blocks: {1000 * (on - off) / logging_steps:.1f} ms "
        f"({logging_steps} logging steps), of which in the hooks "
        f"{1000 * sum(hook_seconds.get(i, 0.0) for i in kept) / logging_steps:.1f} ms; once per run: "
        f"{hook_seconds.get(-1, 0.0):.2f} s of setup and "
        f"{first_on - first_off - (on - off) / (pairs - 1):.2f} s in the first pair over the others' rate"
    )


def run_worker(monitor: bool, steps: int, every: int | None) -> dict[str, float]:
    cadence = [] if every is None else ["--every", str(every)]
    output = subprocess.run(
        [sys.executable, __file__, "--worker", "on" if monitor else "off", "--steps", str(steps), *cadence],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=None, help="every_n_steps (default: the monitor's)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--interleaved", action="store_true", help="one process, alternating blocks (module docstring)"
    )
    args = parser.parse_args()
    if args.interleaved:
        interleaved(args.steps, args.every)
        return
    if args.worker:
        print(json.dumps(worker(args.worker == "on", args.steps, args.every)))
        return

    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for monitor in order:
            results[monitor].append(run_worker(monitor, args.steps, args.every))
            print(
                f"pair {pair} monitor={'on' if monitor else 'off'}: {results[monitor][-1]}", file=sys.stderr
            )

    def median(monitor: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[monitor])

    rows = []
    for key, label in [
        ("fit_seconds", "fit wall time (s)"),
        ("logging_step_ms", "logging step (ms, median)"),
        ("quiet_step_ms", "non-logging step (ms, median)"),
        ("peak_rss_mb", "peak RSS (MB)"),
    ]:
        off, on = median(False, key), median(True, key)
        rows.append([label, f"{off:.2f}", f"{on:.2f}", f"{on / off:.3f}"])
    print(describe_machine())
    print(
        f"\ndemo model ({CONFIG.name}), {args.steps} steps, monitor every "
        f"{args.every or 'default (50)'} steps, "
        f"{args.pairs} interleaved pairs of fresh processes\n"
    )
    print(markdown_table(["measure", "without monitor", "with monitor", "ratio"], rows))
    hooks, plain_fit = median(True, "hook_seconds"), median(False, "fit_seconds")
    one_time = median(True, "one_time_hook_seconds")
    recurring = statistics.median(r["hook_seconds"] - r["one_time_hook_seconds"] for r in results[True])
    share = 100 * hooks / plain_fit
    print(f"\ntime inside the monitor's hooks: {hooks:.2f} s, {share:.1f}% of the fit without it")
    print(
        f"of which once per run (setup and the first logging step): {one_time:.2f} s; "
        f"the rest: {recurring:.2f} s, {100 * recurring / plain_fit:.1f}% of the fit without it"
    )


if __name__ == "__main__":
    main()
