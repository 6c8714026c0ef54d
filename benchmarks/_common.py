"""Timing, peak-memory and machine-description helpers shared by the benchmarks.

Every case runs in a fresh process (``measure_in_fresh_process``), which reports the median wall time of its
repeats and the peak growth of its resident set over what its inputs already occupy.

Why resident-set size and not an allocator counter: ``tracemalloc`` sees only Python objects, not torch's
CPU buffers, and torch exposes no CPU allocator statistics. Torch CPU tensors come from glibc ``malloc``, so
the kernel's high-water mark of resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``) is
the real peak, provided memory freed earlier is not silently reused: hence a fresh process per case, and,
for the one call that measures memory, a fixed mmap threshold (every buffer over 128 KiB is mapped on
allocation and unmapped on free) after handing freed heap pages back with ``malloc_trim``. The timed calls
run before that switch, with glibc's default (adaptive) threshold: mapping every buffer costs page faults,
which made ``svdvals`` 2–3× slower when measured. Linux/glibc only; elsewhere the peak is "unavailable".
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# mallopt parameters (malloc.h). glibc's default mmap threshold, 128 KiB, grows after each free of a large
# block, after which blocks up to 32 MiB come from (and stay in) the heap, invisible to a peak measurement.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
FIXED_MMAP_THRESHOLD = 128 * 1024


class CaseSkipped(Exception):
    """Raised by a case that cannot run here (e.g. a feature not implemented yet); carries the reason."""


@dataclass
class CaseMeasurement:
    """What one case cost: the wall time of each timed repeat, the peak extra memory, and its output."""

    seconds: list[float]
    peak_bytes: int | None
    output: Any

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


def describe_machine() -> str:
    """One Markdown paragraph: CPU model, cores and load, torch version and threads, Python, OS.

    The load average is there because timings on a shared machine mean little: with other work on the
    cores, torch's intra-op threads wait for each other at every small operation.
    """
    usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f"load average {os.getloadavg()[0]:.1f} at start" if hasattr(os, "getloadavg") else "load unknown"
    return (
        f"CPU: {_cpu_model()}; {os.cpu_count()} logical cores, {usable_cores} usable, {load}; "
        f"torch {torch.__version__} with {torch.get_num_threads()} intra-op threads; "
        f"Python {platform.python_version()}; {platform.system()} {platform.release()}"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure_in_fresh_process(
    build: Callable[[], Any], run: Callable[[Any], Any], *, repeats: int, threads: int
) -> CaseMeasurement:
    """``run(build())`` in a new interpreter: a warm-up call, ``repeats`` timed calls, one memory call.

    ``build`` makes the inputs (not measured); ``run`` must return something picklable. The warm-up takes
    one-time costs (thread-pool start, lazy initialisation) out of the timings; each timed call still starts
    cold algorithmically, since ``run`` keeps no state between calls. Raises :class:`CaseSkipped` if the
    case raised it (or ``NotImplementedError``) in the child.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_here, args=(build, run, repeats, threads, sender))
    process.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        status, payload = "failed", "the measuring process died without a result (out of memory?)"
    process.join()
    if status == "skipped":
        raise CaseSkipped(payload)
    if status == "failed":
        raise RuntimeError(payload)
    return payload


def _measure_here(
    build: Callable[[], Any], run: Callable[[Any], Any], repeats: int, threads: int, sender: Any
) -> None:
    try:
        torch.set_num_threads(threads)
        inputs = build()
        output = run(inputs)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            output = run(inputs)
            seconds.append(time.perf_counter() - start)
        del output
        peak, output = _peak_bytes_of(run, inputs)
        sender.send(("ok", CaseMeasurement(seconds=seconds, peak_bytes=peak, output=output)))
    except (CaseSkipped, NotImplementedError) as reason:
        sender.send(("skipped", str(reason) or type(reason).__name__))
    except Exception as error:  # reported by the parent, which owns the benchmark's output
        sender.send(("failed", f"{type(error).__name__}: {error}"))
    finally:
        sender.close()


def _peak_bytes_of(run: Callable[[Any], Any], inputs: Any) -> tuple[int | None, Any]:
    """One more ``run(inputs)``: how far it raises the resident set (None if unmeasurable), and its output."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fixed = libc.mallopt(M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, 0)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        fixed = False
    _touch(inputs)
    baseline = _resident_bytes()
    measurable = bool(fixed) and baseline is not None and _reset_peak_resident()
    output = run(inputs)
    return (_peak_resident_bytes() - baseline if measurable else None), output


def _touch(inputs: Any) -> None:
    """Read every tensor of ``inputs`` once, so its pages are resident before the baseline is taken: a
    kernel that reclaims idle memory (DAMON runs on this project's VMs) can page out inputs that sat unused
    through the timed calls, and faulting them back in counted as the case's own memory (+1.1 GiB, the
    size of the input, for one case at n = 2048 whose components peaked at 73 MiB)."""
    if isinstance(inputs, torch.Tensor):
        inputs.sum()
    elif isinstance(inputs, (tuple, list)):
        for item in inputs:
            _touch(item)
    elif hasattr(inputs, "__dict__"):
        for item in vars(inputs).values():
            _touch(item)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _resident_bytes() -> int | None:
    return _status_bytes("VmRSS")


def _peak_resident_bytes() -> int:
    return _status_bytes("VmHWM") or 0


def _reset_peak_resident() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
