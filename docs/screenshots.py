"""Screenshots for the docs, taken with headless Chromium: a real TensorBoard and the built docs site.

``dashboard``: runs ``spectral-monitor demo --config logit_growth`` (attention logits grow until the
entropy of a layer collapses) and the default demo (healthy) into one temporary folder, or reads those
runs from ``--runs``, serves them with ``tensorboard --logdir`` on 127.0.0.1, and saves the monitor's own tab
(``spectral_monitor``) on each run and within TensorBoard's page. ``tensorboard``: runs the default demo
and saves the Scalars and Custom Scalars views. ``docs``: builds this site with ``mkdocs build`` into a
temporary folder, serves it on 127.0.0.1 and saves its getting started page. All are saved as palette PNGs
under ``docs/img/``. Needs Chromium (``apt-get install -y chromium``), the ``docs`` extra and free ports;
nothing leaves the machine.

    python docs/screenshots.py [dashboard] [tensorboard] [docs] [--max-steps 300] [--runs DIR]
        [--chromium chromium]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "img"
VIEWS = {
    "tensorboard_custom_scalars.png": "#custom_scalars",
    "tensorboard_scalars.png": "#scalars&tagFilter=attention%2Fentropy%2F",
}
DOCS_PAGE = ("docs_site.png", "getting-started/")
DASHBOARD_RUNS = {"logit_growth": "dashboard_collapsing.png", "demo": "dashboard_healthy.png"}
"""The demo configs run for the tab's screenshots, and the screenshot of each run."""
DASHBOARD_IN_TENSORBOARD = "dashboard_tab.png"
COLOURS = 128
"""Palette size of the saved PNGs: TensorBoard's and the site theme's flat colours survive it and the files
stay small."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing answered at {url} within {timeout_s:.0f} s")


@contextmanager
def serving(command: list[str], port: int) -> Iterator[str]:
    """Runs ``command`` (a server on 127.0.0.1:``port``) until the block ends; yields its base URL."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/"
        wait_until_serving(base)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def screenshot(chromium: str, url: str, out: Path, profile: Path, height: int = 900) -> None:
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size=1400,{height}",
            f"--screenshot={out}",
            "--virtual-time-budget=20000",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # Fast octree keeps the small areas of a colour (a legend swatch, a thin line) that median cut merges.
    image = Image.open(out).convert("RGB")
    image.quantize(COLOURS, method=Image.Quantize.FASTOCTREE).save(out, optimize=True)


def save(chromium: str, url: str, name: str, scratch: str, height: int = 900) -> None:
    """One screenshot of ``url`` in a fresh Chromium profile, saved as ``docs/img/<name>``."""
    profile = Path(tempfile.mkdtemp(dir=scratch))
    screenshot(chromium, url, IMAGES / name, profile, height)
    print(f"{IMAGES / name}: {(IMAGES / name).stat().st_size // 1024} KiB")


def tensorboard_views(chromium: str, max_steps: int, scratch: str) -> None:
    logdir = Path(scratch) / "runs"
    demo = [sys.executable, "-m", "spectral_monitor.cli", "demo", "--logdir", str(logdir)]
    subprocess.run([*demo, "--max-steps", str(max_steps)], check=True)
    port = free_port()
    tensorboard = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    with serving([*tensorboard, "--port", str(port)], port) as base:
        for name, view in VIEWS.items():
            save(chromium, base + view, name, scratch)


def dashboard_views(chromium: str, max_steps: int, scratch: str, runs: Path | None) -> None:
    """The tab on each run of ``DASHBOARD_RUNS``, demo runs written anew unless ``runs`` holds them already
    (``runs/<config>/version_0``)."""
    logdir = Path(scratch) / "dashboard_runs"
    for config in DASHBOARD_RUNS:
        if runs is not None:
            shutil.copytree(runs / config, logdir / config)
            continue
        demo = [
            sys.executable,
            "-m",
            "spectral_monitor.cli",
            "demo",
            "--config",
            config,
            "--logdir",
            str(logdir),
        ]
        subprocess.run([*demo, "--max-steps", str(max_steps)], check=True)
    port = free_port()
    tensorboard = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    with serving([*tensorboard, "--port", str(port)], port) as base:
        for config, name in DASHBOARD_RUNS.items():
            query = urllib.parse.urlencode({"name": "spectral_monitor", "run": f"{config}/version_0"})
            save(chromium, f"{base}data/plugin_entry.html?{query}", name, scratch, height=1500)
        save(chromium, base + "#spectral_monitor", DASHBOARD_IN_TENSORBOARD, scratch)


def docs_site(chromium: str, scratch: str) -> None:
    site = Path(scratch) / "site"
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"},
    )
    port = free_port()
    server = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site)]
    with serving(server, port) as base:
        name, page = DOCS_PAGE
        save(chromium, base + page, name, scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what",
        nargs="*",
        choices=["dashboard", "tensorboard", "docs"],
        help="which screenshots (default: all)",
    )
    parser.add_argument("--max-steps", type=int, default=300, help="steps of each demo run")
    parser.add_argument(
        "--runs", type=Path, default=None, help="a folder already holding the dashboard's demo runs"
    )
    parser.add_argument("--chromium", default="chromium", help="the Chromium executable")
    arguments = parser.parse_args()
    what = set(arguments.what or ["dashboard", "tensorboard", "docs"])
    IMAGES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        if "dashboard" in what:
            dashboard_views(arguments.chromium, arguments.max_steps, scratch, arguments.runs)
        if "tensorboard" in what:
            tensorboard_views(arguments.chromium, arguments.max_steps, scratch)
        if "docs" in what:
            docs_site(arguments.chromium, scratch)


if __name__ == "__main__":
    main()
