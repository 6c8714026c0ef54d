"""The TensorBoard loaders every server test runs under: the Python one and the Rust data server (what
``--load_fast=auto`` picks when it is installed)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["false", "true"], ids=["python_loader", "rust_data_server"])
def load_fast(request: pytest.FixtureRequest) -> str:
    if request.param == "true":
        data_server = pytest.importorskip("tensorboard_data_server")
        if data_server.server_binary() is None:
            pytest.skip("the Rust data server has no binary for this platform")
    return request.param
