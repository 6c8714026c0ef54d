"""Names a package exports but imports on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for the names of ``homes``.

    Args:
        package: the package's ``__name__``.
        homes: each exported name and the module that defines it.

    Returns:
        ``(__getattr__, __dir__)``: a name is imported from its home on first use and kept in the package's
        namespace from then on; ``dir(package)`` lists the names before they are imported.

    Raises:
        AttributeError: (from ``__getattr__``) a name that is neither in the package nor in ``homes``.

    Examples:
        >>> attribute, _ = lazy_exports("spectral_monitor", {"Measurement": "spectral_monitor.records"})
        >>> attribute("Measurement").__name__
        'Measurement'
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *homes])

    return __getattr__, __dir__
