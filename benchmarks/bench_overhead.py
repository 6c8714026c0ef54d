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

``--external`` measures models written elsewhere instead (``_external_models.py``: a Hugging Face GPT-2 built
from its config and a nanoGPT-style model with ``F.scaled_dot_product_attention(is_causal=True)``, and with
``--models encoder`` a bidirectional masked-token model on ``nn.TransformerEncoder``), in the
plain-loop ``Monitor`` with each ``--presets`` preset (default ``standard``), batch 2, both sequences sampled,
at each context length and layer count given, freshly initialised and after ``--train-steps`` steps of
training. In one process, round by round: a plain training step, a logging step (the same training step with
the monitor measuring it), and the hand-written alternative on the same batch (an eager forward returning the
attention probabilities, then each head's entropy and float64 ``torch.linalg.svdvals``; only up to
``--alternative-max-context`` tokens: at 4096 its float64 SVDs take minutes a layer). The first logging step,
where every figure is drawn new, is reported apart. Medians over ``--rounds`` rounds, with their spread.
``--cycle N`` runs N more logging steps after the rounds, each after a plain step, and adds the mean
logging/plain ratio over every logging step after the first and the largest one: the median leaves out the
steps that also draw the figures (every 10th logging step by default) and, in ``full``, write the weight
spectra.

    python benchmarks/bench_overhead.py --external --contexts 256 512 1024 --rounds 3 --device cpu
    python benchmarks/bench_overhead.py --external --models encoder --contexts 512 768 1024 --rounds 3
    python benchmarks/bench_overhead.py --external --contexts 4096 --rounds 1 --train-steps 10 \
        --presets light standard
    python benchmarks/bench_overhead.py --external --contexts 256 --rounds 3 --cycle 17 --train-steps 10 \
        --presets standard full

``--report N`` times ``spectral-monitor report`` on a run of N logging steps: every scalar the ``standard``
preset writes on a logging step of the external GPT-2 (6 layers), recorded from one real logging step and
written N times by the monitor's own event writer, each metric moving through a cycle of readings; then the
command in a fresh process (wall and CPU seconds), and ``import spectral_monitor.report`` alone.

    python benchmarks/bench_overhead.py --report 2000
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


def external(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    every = args.every or 50
    print(describe_machine())
    print(
        f"\nbatch 2 (both sequences sampled), device {args.device}, {args.rounds} rounds, "
        f"{args.train_steps} training steps before the trained rows; medians (min–max over rounds)\n"
    )
    rows = []
    for preset in args.presets:
        for name in args.models:
            for layers in args.layers:
                for context in args.contexts:
                    run = _ExternalRun(name, context, layers, preset, args)
                    for state, steps in (("fresh", 0), ("trained", args.train_steps)):
                        for _ in range(steps):
                            run.train_step(logging=False)
                        cells = run.measured(args.rounds, every, context <= args.alternative_max_context)
                        if args.cycle:
                            cells += run.cycle(args.cycle)
                        rows.append([preset, name, str(layers), str(context), state, *cells])
                        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
                    run.monitor.close()
    print(
        markdown_table(
            [
                "preset",
                "model",
                "layers",
                "n",
                "weights",
                "training step (s)",
                "logging step (s)",
                "logging / training step",
                "hand-written (s)",
                "monitor's extra / hand-written",
                f"amortised at every {every}",
                *(
                    [f"mean of the {args.rounds + args.cycle} logging steps after the first", "largest"]
                    if args.cycle
                    else []
                ),
            ],
            rows,
        )
    )


class _ExternalRun:
    """One external model in training with the plain-loop monitor, and the timings ``external`` reports."""

    def __init__(self, name: str, context: int, layers: int, preset: str, args: argparse.Namespace) -> None:
        import tempfile

        import torch
        from _external_models import model_and_loss, token_batch

        from spectral_monitor.integrations.loop import Monitor

        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.model, self.loss_of = model_and_loss(name, context, layers)
        self.model.to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.tokens = token_batch(2, context, device=args.device)
        self.monitor = Monitor(
            self.model,
            logdir=tempfile.mkdtemp(),
            every_n_steps=1,
            optimizer=self.optimizer,
            preset=preset,
            loss_fn=self.loss_of,  # full's curvature probe needs it; the other presets leave it unused
        )
        self.steps = 0
        self.logging_ratios: list[float] = []

    def clock(self) -> float:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def train_step(self, *, logging: bool) -> float:
        """Seconds of one training step, measured by the monitor or not."""
        start = self.clock()
        if logging:
            with self.monitor.step(self.steps, batch=self.tokens):
                loss = self.loss_of(self.model, self.tokens)
        else:
            loss = self.loss_of(self.model, self.tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return self.clock() - start

    def hand_written(self) -> float:
        """Seconds of the alternative: eager attention probabilities, each head's entropy and float64 σ."""
        import torch
        from _external_models import eager_attention_probabilities

        start = self.clock()
        for probs in eager_attention_probabilities(self.model, self.tokens):
            matrices = probs.double()
            (-torch.special.xlogy(matrices, matrices).sum(dim=-1)).mean(dim=-1)
            torch.linalg.svdvals(matrices)
        return self.clock() - start

    def measured(self, rounds: int, every: int, alternative: bool) -> list[str]:
        """The table's timing cells: ``rounds`` rounds of a plain step, a logging step and, where
        ``alternative``, the hand-written alternative."""
        self.train_step(logging=False)  # warm-up
        first = self.train_step(logging=True)
        plain, logged, alternatives = [], [], []
        for _ in range(rounds):
            plain.append(self.train_step(logging=False))
            logged.append(self.train_step(logging=True))
            if alternative:
                alternatives.append(self.hand_written())
        self.logging_ratios = [log / off for log, off in zip(logged, plain, strict=True)]
        extra = [log - off for log, off in zip(logged, plain, strict=True)]
        amortised = 100 * statistics.median(extra) / (every * statistics.median(plain))
        return [
            f"{statistics.median(plain):.2f}",
            f"{statistics.median(logged):.2f} (first {first:.1f})",
            _spread([log / off for log, off in zip(logged, plain, strict=True)], "×"),
            f"{statistics.median(alternatives):.2f}" if alternatives else "not timed",
            _spread([more / alt for more, alt in zip(extra, alternatives, strict=True)], "×")
            if alternatives
            else "not timed",
            f"{amortised:.1f}%",
        ]

    def cycle(self, logging_steps: int) -> list[str]:
        """The cycle cells: ``logging_steps`` more logging steps, each after a plain one, then the mean
        logging/plain ratio over them and the rounds' (every logging step after the first) and the largest."""
        for _ in range(logging_steps):
            plain = self.train_step(logging=False)
            self.logging_ratios.append(self.train_step(logging=True) / plain)
        return [f"{statistics.mean(self.logging_ratios):.2f}×", f"{max(self.logging_ratios):.2f}×"]


def report_time(logging_steps: int) -> None:
    import tempfile

    from tensorboard.compat.proto.summary_pb2 import Summary

    from spectral_monitor.sinks.tfrecord import EventFile

    logged = _one_logging_step()
    logdir = Path(tempfile.mkdtemp())
    events = EventFile(str(logdir / "run"))
    start = time.perf_counter()
    for step in range(logging_steps):
        # Each metric moving through a cycle of 7 readings; the alert counters as the monitor left them.
        values = [
            Summary.Value(
                tag=tag,
                simple_value=value
                if tag.startswith("alerts/")
                else value * (1 + ((step + len(tag)) % 7) / 7),
            )
            for tag, value in logged
        ]
        events.add_summary(Summary(value=values), step=step * 50)
    events.close()
    written = time.perf_counter() - start
    scalars = logging_steps * len(logged)

    def timed(command: list[str]) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, cwd=REPO)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return time.perf_counter() - start, cpu

    report_wall, report_cpu = timed([sys.executable, "-m", "spectral_monitor.cli", "report", str(logdir)])
    import_wall, import_cpu = timed([sys.executable, "-c", "import spectral_monitor.report"])
    print(describe_machine())
    print(f"\n{logging_steps} logging steps, {scalars} scalars written in {written:.1f} s\n")
    print(
        markdown_table(
            ["command", "wall (s)", "CPU (s)"],
            [
                ["spectral-monitor report", f"{report_wall:.1f}", f"{report_cpu:.1f}"],
                ["import spectral_monitor.report", f"{import_wall:.2f}", f"{import_cpu:.2f}"],
            ],
        )
    )


def _one_logging_step() -> list[tuple[str, float]]:
    """(tag, value) of every scalar the ``standard`` preset writes on a logging step of the external GPT-2
    (6 layers, 64 tokens, the plain-loop monitor), read back from its event file."""
    import tempfile

    import torch
    from _external_models import model_and_loss, token_batch

    from spectral_monitor.eventfiles import read_event_file
    from spectral_monitor.integrations.loop import Monitor

    torch.manual_seed(0)
    model, loss_of = model_and_loss("gpt2", 64, 6)
    tokens = token_batch(2, 64)
    logdir = Path(tempfile.mkdtemp())
    monitor = Monitor(model, logdir=str(logdir), every_n_steps=1, preset="standard")
    with monitor.step(0, batch=tokens):
        loss_of(model, tokens).backward()
    monitor.close()
    return [
        (value.tag, value.simple_value)
        for file in logdir.rglob("*tfevents*")
        for event in read_event_file(file).events
        if event.step == 0
        for value in event.summary.value
        if value.HasField("simple_value")
    ]


def _spread(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}–{max(values):.2f})"


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
    parser.add_argument("--external", action="store_true", help="GPT-2 and nanoGPT (module docstring)")
    parser.add_argument(
        "--models", nargs="+", default=["gpt2", "nanogpt"], choices=["gpt2", "nanogpt", "encoder"]
    )
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 512, 1024])
    parser.add_argument("--layers", nargs="+", type=int, default=[6])
    parser.add_argument("--presets", nargs="+", default=["standard"], choices=["light", "standard", "full"])
    parser.add_argument("--alternative-max-context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycle", type=int, default=0, metavar="N", help="N more logging steps (docstring)")
    parser.add_argument("--train-steps", type=int, default=30, help="steps before the 'trained' rows")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--report", type=int, default=None, metavar="N", help="time the report (docstring)")
    args = parser.parse_args()
    if args.report:
        report_time(args.report)
        return
    if args.external:
        external(args)
        return
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
