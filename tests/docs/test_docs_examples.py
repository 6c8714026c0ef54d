"""Every Python and shell example of README.md and docs/*.md runs as written: one test per block.

A block is the code of a ```python, ```bash, ```sh or ```shell fence (output samples go in ```text). HTML
comments on the lines right above its fence say how to run it (docs/contributing.md, "Examples in the
docs"):

    <!-- example: skip: REASON -->        not run (a server, an install, the test suite itself), for REASON
    <!-- example: replace OLD => NEW -->  run with OLD replaced by NEW, e.g. fewer steps; OLD must occur
    <!-- example: setup: COMMAND -->      run the shell COMMAND first, in the same folder

Each block runs in a fresh process (Python blocks as a script, shell blocks with ``bash -e``) in a scratch
folder that links the checkout's top-level files, so ``configs/demo.yaml`` or ``tests/...`` resolve as
they do from the repository root, while what an example writes (``runs/``, ``sweep/``) stays out of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUNNABLE = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
CHECKOUT_ENTRIES = (
    "README.md",
    "CHANGELOG.md",
    "LICENSE",
    "pyproject.toml",
    "mkdocs.yml",
    "configs",
    "docs",
    "tests",
    "benchmarks",
    "spectral_monitor",
)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
MARKER = re.compile(r"^<!-- example: (?P<action>skip|replace|setup):? (?P<argument>.*?) -->[ \t]*$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Example:
    """One runnable block of a page, with the markers above its fence."""

    page: str
    line: int
    language: str
    code: str
    skip: str | None = None
    replacements: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def runnable_code(self) -> str:
        """The code with every replacement applied; each OLD must occur, so a marker cannot go stale."""
        code = self.code
        for old, new in self.replacements:
            assert old in code, f"{self.name}: the marker replaces {old!r}, which the block does not contain"
            code = code.replace(old, new)
        return code


def page_examples(page: Path, name: str) -> list[Example]:
    """The runnable blocks of ``page`` (called ``name`` in test names), in order, each with its markers.

    Raises:
        ValueError: a marker that is malformed, a skip without a reason, or a replace without ``=>``.
    """
    text = page.read_text()
    lines = text.splitlines()
    examples = []
    for fence in FENCE.finditer(text):
        language = RUNNABLE.get(fence.group(1))
        if language is None:
            continue
        line = text.count("\n", 0, fence.start()) + 1
        skip, replacements, setup = None, [], []
        above = line - 2
        while above >= 0 and lines[above].startswith("<!-- example"):
            marker = MARKER.match(lines[above])
            if marker is None or not marker["argument"].strip():
                raise ValueError(f"{name}:{above + 1}: malformed example marker {lines[above]!r}")
            action, argument = marker["action"], marker["argument"].strip()
            if action == "skip":
                skip = argument
            elif action == "setup":
                setup.insert(0, argument)
            else:
                old, arrow, new = argument.partition(" => ")
                if not arrow:
                    raise ValueError(f"{name}:{above + 1}: a replace marker reads 'replace OLD => NEW'")
                replacements.insert(0, (old, new))
            above -= 1
        examples.append(
            Example(name, line, language, fence.group(2), skip, tuple(replacements), tuple(setup))
        )
    return examples


EXAMPLES = [example for page in PAGES for example in page_examples(page, str(page.relative_to(ROOT)))]


def scratch_checkout(folder: Path) -> Path:
    """``folder`` with links to the checkout's top-level files: relative paths resolve as from the root."""
    for entry in CHECKOUT_ENTRIES:
        if (ROOT / entry).exists():
            (folder / entry).symlink_to(ROOT / entry)
    return folder


def run_in(folder: Path, command: list[str]) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "NO_MKDOCS_2_WARNING": "1",
    }
    return subprocess.run(
        command, cwd=folder, capture_output=True, text=True, env=environment, timeout=TIMEOUT_S
    )


def test_the_examples_are_found_and_every_skip_says_why() -> None:
    assert len({example.page for example in EXAMPLES}) >= 10
    assert any(example.page == "README.md" and "trainer.fit" in example.code for example in EXAMPLES)
    assert all(example.skip is None or len(example.skip.split()) >= 3 for example in EXAMPLES)


def test_markers_are_read_from_the_lines_above_a_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- example: setup: touch ready -->\n<!-- example: replace steps=50 => steps=2 -->\n"
        "```python\nrun(steps=50)\n```\n\n<!-- example: skip: starts a server -->\n```bash\nserve\n```\n\n"
        "```text\noutput\n```\n"
    )
    first, second = page_examples(page, "page.md")
    assert (first.line, first.setup, first.runnable_code()) == (5, ("touch ready",), "run(steps=2)\n")
    assert (second.language, second.skip) == ("shell", "starts a server")
    page.write_text("<!-- example: skip -->\n```bash\nserve\n```\n")
    with pytest.raises(ValueError, match="malformed"):
        page_examples(page, "page.md")


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_the_example_runs_as_written(example: Example, tmp_path: Path) -> None:
    if example.skip is not None:
        pytest.skip(f"{example.name}: {example.skip}")
    folder = scratch_checkout(tmp_path)
    for command in example.setup:
        setup = run_in(folder, ["bash", "-e", "-o", "pipefail", "-c", command])
        assert setup.returncode == 0, f"setup {command!r}:\n{setup.stdout[-3000:]}\n{setup.stderr[-5000:]}"
    code = example.runnable_code()
    if example.language == "python":
        (folder / "example.py").write_text(code)
        command = [sys.executable, "example.py"]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    result = run_in(folder, command)
    assert result.returncode == 0, (
        f"{example.name}:\n{code}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
