"""The documentation builds without a warning, and the README's commands and example are the real ones.

``mkdocs build --strict`` turns every broken link, missing page, unresolved cross-reference or docstring
that mkdocstrings cannot render into a failure. The README's example is run as written, in a fresh
process, and its event file is read back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from events import read_back

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def fenced_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.S | re.M)


def test_mkdocs_builds_strict_without_a_warning(tmp_path: Path) -> None:
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    output = build.stdout + build.stderr
    assert build.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "api" / "index.html").read_text().count('id="spectral_monitor.SpectralMonitor"') == 1


def test_readme_starts_with_the_demo_command_then_the_ci_test_command() -> None:
    first, second = fenced_blocks(README.read_text(), "bash")[:2]
    assert first.strip().endswith("spectral-monitor demo"), first
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert second.strip() in ci_script.splitlines(), second


@pytest.mark.slow
def test_readme_example_trains_and_writes_attention_spectra(tmp_path: Path) -> None:
    (example,) = [block for block in fenced_blocks(README.read_text(), "python") if "trainer.fit" in block]
    assert len(example.strip().splitlines()) <= 10, example
    (tmp_path / "example.py").write_text(example)
    run = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (run_directory,) = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    tags = read_back(run_directory).Tags()["scalars"]
    for family in ("attention/entropy/", "tokens/cosine_similarity/", "weights/spectral_norm/"):
        assert any(tag.startswith(family) for tag in tags), (family, sorted(tags)[:20])


RUN_EXAMPLES = """
import json, os, sys, tempfile, traceback
import torch

torch.set_num_threads(1)
failures = []
for name, code in json.loads(sys.stdin.read()):
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except Exception:
            failures.append(name + ":\\n" + traceback.format_exc())
        finally:
            os.chdir("/")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


@pytest.mark.slow
def test_every_python_example_in_the_docs_runs_as_written() -> None:
    examples = [
        (f"{page.name} example {index}", code)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for index, code in enumerate(fenced_blocks(page.read_text(), "python"))
    ]
    assert len(examples) >= 10, [name for name, _ in examples]
    run = subprocess.run(
        [sys.executable, "-c", RUN_EXAMPLES],
        input=json.dumps(examples),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"},
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
