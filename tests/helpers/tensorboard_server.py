"""A real TensorBoard server as a child process on loopback, so that it and the Rust data server it may start
stop with the test, and polling that fails the test with what the server said."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT_S = 20.0
LOAD_TIMEOUT_S = 15.0


class TensorBoardServer:
    """HTTP access to a TensorBoard server on 127.0.0.1."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> bytes:
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()

    def get_json(self, path: str, **params: Any) -> Any:
        return json.loads(self.get(path, **params))


@contextmanager
def tensorboard_server(logdir: Path, load_fast: str, output: Path) -> Iterator[TensorBoardServer]:
    command = [
        sys.executable,
        "-m",
        "tensorboard.main",
        f"--logdir={logdir}",
        "--host=127.0.0.1",
        "--port=0",
        "--reload_interval=1",
        f"--load_fast={load_fast}",
    ]
    with output.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    try:
        port = int(
            poll(
                lambda: _served_port(output.read_text()),
                STARTUP_TIMEOUT_S,
                lambda: f"TensorBoard did not report its URL; it said:\n{output.read_text()}",
                process=process,
            )
        )
        yield TensorBoardServer(port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _served_port(server_output: str) -> str | None:
    match = re.search(r"TensorBoard \S+ at http://127\.0\.0\.1:(\d+)/", server_output)
    return match.group(1) if match else None


def poll(
    read: Callable[[], Any],
    timeout_s: float,
    describe_failure: Callable[[], str],
    process: subprocess.Popen | None = None,
) -> Any:
    """The first truthy value of ``read()``, tried every 0.2 s; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"TensorBoard exited with code {process.returncode}. {describe_failure()}")
        value = read()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"gave up after {timeout_s} s: {describe_failure()}")
