"""What a logging step costs in the setups of docs/scale.md's "Verified setups": in the plain-loop
``Monitor``, one process, Gemma 2 with softcapping, GPT-NeoX and Phi-3 with fused projections, and the demo
model given compiled (``Monitor(torch.compile(model))``) or run through a compiled forward
(``Monitor(model)``, the loop calling ``torch.compile(model)``), both with the ``aot_eager`` backend; the
Hugging Face Trainer under two processes, and the plain loop around DDP and FSDP2 under two processes
(``torchrun --nproc_per_node 2``, gloo on CPUs; the runs of ``tests/scale/test_scale_loops.py``).

Every step is a logging step (``every_n_steps=1``; figures off, the preflight off). The time spent inside
the monitor (``MonitorSession.begin_step``, ``end_forward`` and ``end_step``, which also run on every rank)
is measured in the same run as the rest of each step (forward, backward, optimizer step, the Trainer's own
work), so the ratio of the two is immune to the machine's speed changing between runs; between logging
steps the monitor costs a comparison. The first two steps (cold starts, the first figure-free layout) are
left out; each round reports the median over the remaining steps, and the table the median and range over
the rounds (rank 0's timing under two processes).

    python benchmarks/bench_scale_setups.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import describe_machine  # noqa: E402

STEPS = 12
SKIPPED = 2
OPTIONS: dict[str, Any] = {"every_n_steps": 1, "figures_every_n_logs": 0, "preflight": False}
SINGLE = ("gemma2_softcap", "gpt_neox", "phi3", "compiled_model", "compiled_forward")
DISTRIBUTED = ("trainer_2proc", "loop_ddp_2proc", "loop_fsdp2_2proc")
LABELS = {
    "gemma2_softcap": "Gemma 2, softcapped eager attention (plain loop)",
    "gpt_neox": "GPT-NeoX, fused interleaved query_key_value (plain loop)",
    "phi3": "Phi-3, fused qkv_proj with grouped keys (plain loop)",
    "compiled_model": "demo model, Monitor(torch.compile(model)) (plain loop)",
    "compiled_forward": "demo model, Monitor(model), forward through torch.compile(model) (plain loop)",
    "trainer_2proc": "Trainer, 2 processes (GPT-2)",
    "loop_ddp_2proc": "plain loop, DDP, 2 processes (demo model)",
    "loop_fsdp2_2proc": "plain loop, FSDP2, 2 processes (demo model)",
}


class MonitorClock:
    """Accumulates the wall time spent inside the session's per-step methods."""

    def __init__(self) -> None:
        from spectral_monitor.core import MonitorSession

        self.seconds = 0.0
        for name in ("begin_step", "end_forward", "end_step"):
            setattr(MonitorSession, name, self._timed(getattr(MonitorSession, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def hugging_face_model(name: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128}
    if name == "gemma2_softcap":
        config = transformers.Gemma2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0
        )
        return transformers.Gemma2ForCausalLM(config)
    if name == "gpt_neox":
        config = transformers.GPTNeoXConfig(**common, num_attention_heads=4, attn_implementation="sdpa")
        return transformers.GPTNeoXForCausalLM(config)
    config = transformers.Phi3Config(
        **common, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, attn_implementation="sdpa"
    )
    return transformers.Phi3ForCausalLM(config)


def single_process(name: str) -> list[tuple[float, float]]:
    """(monitor seconds, rest of the step in seconds) of each step of a plain loop on a tiny model."""
    from spectral_monitor import Monitor

    clock = MonitorClock()
    ids = torch.randint(1, 128, (STEPS, 4, 64), generator=torch.Generator().manual_seed(0))
    if name.startswith("compiled"):
        from spectral_monitor.demo import DemoTransformer

        torch._dynamo.reset()
        torch.manual_seed(0)
        model = DemoTransformer(vocab_size=128, d_model=64, n_layers=2, n_heads=4, seq_len=64)
        trained = torch.compile(model, backend="aot_eager")
        given = trained if name == "compiled_model" else model

        def loss_of(tokens: torch.Tensor) -> torch.Tensor:
            logits = trained(tokens)
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    else:
        model = given = hugging_face_model(name).train()

        def loss_of(tokens: torch.Tensor) -> torch.Tensor:
            return model(input_ids=tokens, labels=tokens).loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timings = []
    with tempfile.TemporaryDirectory() as logdir, Monitor(given, logdir, **OPTIONS) as monitor:
        for step in range(STEPS):
            start = time.perf_counter()
            with monitor.step(step, batch=ids[step]):
                loss = loss_of(ids[step])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = time.perf_counter() - start
            spent = clock.take()
            timings.append((spent, total - spent))
    return timings


def distributed_rank(name: str, output: Path) -> None:
    """One rank of a two-process run; rank 0 writes its timings to OUTPUT/timings.json."""
    from helpers import distributed_loops

    torch.set_num_threads(1)
    clock = MonitorClock()
    rank = int(os.environ["RANK"])
    distributed_loops.STEPS = STEPS
    timings: list[tuple[float, float]] = []
    if name == "trainer_2proc":
        import transformers

        class StepClock(transformers.TrainerCallback):
            def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
                clock.take()
                self.start = time.perf_counter()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                total = time.perf_counter() - self.start
                spent = clock.take()
                timings.append((spent, total - spent))

        distributed_loops.TRAINER_OPTIONS.update(OPTIONS)
        original = transformers.Trainer.__init__

        def with_clock(self: Any, *args: Any, callbacks: list[Any], **kwargs: Any) -> None:
            original(self, *args, callbacks=[*callbacks, StepClock()], **kwargs)

        transformers.Trainer.__init__ = with_clock
        distributed_loops.trainer_run(output, distributed_loops.BATCH)
    else:
        import torch.distributed as dist

        from spectral_monitor import Monitor

        dist.init_process_group("gloo", timeout=distributed_loops.TIMEOUT)
        model = distributed_loops.demo_model()
        if name == "loop_fsdp2_2proc":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            trained = fully_shard(model)
        else:
            trained = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        batches = distributed_loops.global_batches()
        with Monitor(trained, output / "tb", **{**distributed_loops.LOOP_OPTIONS, **OPTIONS}) as monitor:
            for step in range(STEPS):
                start = time.perf_counter()
                tokens = batches[2 * step + rank]
                with monitor.step(step, batch=tokens):
                    loss = distributed_loops.demo_loss(trained, tokens)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total = time.perf_counter() - start
                spent = clock.take()
                timings.append((spent, total - spent))
        dist.destroy_process_group()
    if rank == 0:
        (output / "timings.json").write_text(json.dumps(timings))


def distributed(name: str) -> list[tuple[float, float]]:
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(
            [*command, __file__, "--rank-of", name, directory],
            env=environment,
            check=True,
            capture_output=True,
            timeout=600,
        )
        return [tuple(pair) for pair in json.loads((Path(directory) / "timings.json").read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setups", nargs="+", default=[*SINGLE, *DISTRIBUTED])
    parser.add_argument("--rank-of", nargs=2, metavar=("SETUP", "OUTPUT"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.rank_of:
        distributed_rank(arguments.rank_of[0], Path(arguments.rank_of[1]))
        return
    torch.set_num_threads(1)
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in arguments.setups}
    for _ in range(arguments.rounds):  # interleaved: each round runs every setup once
        for name in arguments.setups:
            timings = (single_process(name) if name in SINGLE else distributed(name))[SKIPPED:]
            monitor_ms = statistics.median(spent for spent, _ in timings) * 1e3
            step_ms = statistics.median(rest for _, rest in timings) * 1e3
            rounds[name].append((monitor_ms, step_ms))
    print(describe_machine())
    print()
    print("| setup | monitor per logging step (ms) | step without it (ms) | logging step / step without it |")
    print("|---|---:|---:|---:|")
    for name, results in rounds.items():
        monitor = [ms for ms, _ in results]
        step = [ms for _, ms in results]
        ratios = [1 + ms / rest for ms, rest in results]
        print(
            f"| {LABELS[name]} | {statistics.median(monitor):.1f} ({min(monitor):.1f}–{max(monitor):.1f}) "
            f"| {statistics.median(step):.1f} ({min(step):.1f}–{max(step):.1f}) "
            f"| {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
