"""The examples in the docstrings run as written, and the docstrings listed below say the whole contract.

Every module of the package whose source holds a ``>>>`` example is doctested, one test per module.
``COMPLETE_DOCSTRINGS`` lists the modules whose every public function has ``Args:``, ``Returns:`` and
``Examples:`` sections (and ``Raises:`` where it raises), and whose every public class has an ``Example:``: a
module joins the list once its docstrings are written so, and stays held to it.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest

import spectral_monitor

PACKAGE = Path(spectral_monitor.__file__).parent
COMPLETE_DOCSTRINGS = (
    "spectral_monitor.metrics.baselines",
    "spectral_monitor.metrics.heads",
    "spectral_monitor.metrics.masks",
    "spectral_monitor.metrics.tokens",
    "spectral_monitor.metrics.weights",
    "spectral_monitor.probes.attention_families",
    "spectral_monitor.probes.attention_weights",
    "spectral_monitor.probes.jacobian",
    "spectral_monitor.probes.ntk",
    "spectral_monitor.records",
    "spectral_monitor.toolbox.compression",
    "spectral_monitor.toolbox.length_scaling",
    "spectral_monitor.toolbox.preflight",
    "spectral_monitor.toolbox.sweep",
)


def modules_with_examples() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(spectral_monitor.__path__, "spectral_monitor.")
        if ">>> " in Path(importlib.util.find_spec(info.name).origin).read_text()
    ]
    return sorted(names)


def test_the_doctested_modules_are_found() -> None:
    assert set(COMPLETE_DOCSTRINGS) <= set(modules_with_examples())


@pytest.mark.parametrize("module_name", modules_with_examples())
def test_the_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed"


def raises(function: object) -> bool:
    source = inspect.getsource(function)
    return any(isinstance(node, ast.Raise) for node in ast.walk(ast.parse(source.lstrip())))


@pytest.mark.parametrize("module_name", COMPLETE_DOCSTRINGS)
def test_public_names_have_complete_docstrings(module_name: str) -> None:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name
    ]
    for name in names:
        value = getattr(module, name)
        docstring = inspect.getdoc(value) or ""
        if inspect.isclass(value):
            assert "Examples:" in docstring, f"{module_name}.{name} has no example"
        elif inspect.isfunction(value):
            for section in ("Args:", "Returns:", "Examples:"):
                assert section in docstring, f"{module_name}.{name} has no {section} section"
            if raises(inspect.unwrap(value)):
                assert "Raises:" in docstring, f"{module_name}.{name} raises but has no Raises: section"
