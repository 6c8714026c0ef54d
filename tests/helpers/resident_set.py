"""Peak memory of a piece of work, measured in a fresh process as the growth of its resident set.

tracemalloc does not see torch's CPU buffers, so a probe script runs in its own interpreter. glibc is told
to map every buffer over 128 KiB on its own and to return it on free, so the high-water mark of the
resident set (reset through ``/proc/self/clear_refs``) is the peak of what was allocated, not of what the
allocator kept. A probe prints one JSON line last; ``run_probe`` returns it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]

needs_resident_set_counters = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident-set counters"
)

PROBE_PRELUDE = textwrap.dedent(
    """
    import ctypes, json, sys, warnings
    import torch

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def map_large_buffers_alone():
        libc.mallopt(-3, 128 * 1024) and libc.mallopt(-1, 0)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD

    def reset_peak():
        \"\"\"Returns freed memory, then resets VmHWM to the current resident set; gives that baseline.\"\"\"
        libc.malloc_trim(0)
        baseline = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")
        return baseline

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    """
)
"""What every probe starts with: ``status(field)`` in bytes, ``map_large_buffers_alone()``,
``reset_peak()``."""


def run_probe(script: str, *arguments: object) -> dict:
    """Runs ``PROBE_PRELUDE`` + ``script`` with ``arguments`` as ``sys.argv[1:]``; its last line, parsed."""
    completed = subprocess.run(
        [sys.executable, "-c", PROBE_PRELUDE + textwrap.dedent(script), *map(str, arguments)],
        capture_output=True,
        text=True,
        cwd=REPOSITORY,
        env={"PYTHONPATH": str(REPOSITORY), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
