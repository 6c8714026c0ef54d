"""The documentation builds without a warning, and the README's commands are the real ones.

``mkdocs build --strict`` turns every broken link, missing page, unresolved cross-reference or docstring
that mkdocstrings cannot render into a failure. Every example of the README and the docs is run by
``test_docs_examples.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
