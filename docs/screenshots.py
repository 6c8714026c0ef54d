"""Screenshots of a real TensorBoard for the docs: a demo run, TensorBoard on it, headless Chromium.

Runs ``spectral-monitor demo`` into a temporary folder, serves it with ``tensorboard --logdir`` on
127.0.0.1, and saves the Scalars and Custom Scalars views as palette PNGs under ``docs/img/``. Needs
Chromium (``apt-get install -y chromium``) and a free port; nothing leaves the machine.

    python docs/screenshots.py [--max-steps 300] [--chromium chromium]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from PIL import Image

IMAGES = Path(__file__).resolve().parent / "img"
VIEWS = {
    "tensorboard_custom_scalars.png": "#custom_scalars",
    "tensorboard_scalars.png": "#scalars&tagFilter=attention%2Fentropy%2F",
}
COLOURS = 128
"""Palette size of the saved PNGs: TensorBoard's flat colours survive it and the files stay small."""


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
    raise TimeoutError(f"TensorBoard did not answer at {url} within {timeout_s:.0f} s")


def screenshot(chromium: str, url: str, out: Path, profile: Path) -> None:
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
            "--window-size=1400,900",
            f"--screenshot={out}",
            "--virtual-time-budget=15000",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    Image.open(out).convert("RGB").quantize(COLOURS).save(out, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300, help="steps of the demo run")
    parser.add_argument("--chromium", default="chromium", help="the Chromium executable")
    arguments = parser.parse_args()
    IMAGES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        logdir = Path(scratch) / "runs"
        demo = [sys.executable, "-m", "spectral_monitor.cli", "demo", "--logdir", str(logdir)]
        subprocess.run([*demo, "--max-steps", str(arguments.max_steps)], check=True)
        port = free_port()
        tensorboard = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
            + ["--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}/"
            wait_until_serving(base)
            for name, view in VIEWS.items():
                profile = Path(tempfile.mkdtemp(dir=scratch))
                screenshot(arguments.chromium, base + view, IMAGES / name, profile)
                print(f"{IMAGES / name}: {(IMAGES / name).stat().st_size // 1024} KiB")
        finally:
            tensorboard.terminate()
            tensorboard.wait(timeout=30)


if __name__ == "__main__":
    main()
