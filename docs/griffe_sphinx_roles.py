"""Griffe extensions of the API reference: docstrings' reST markup read as Markdown, and only real bases.

The package's docstrings cross-reference with Sphinx roles (``:class:`~spectral_monitor.alerts.Rule```) and
open literal blocks with ``::``. mkdocstrings renders Markdown, where both would show as raw text, so each
role becomes a code span of the name it shows (the last component with ``~``) and ``::`` a colon.

A class whose bases are a starred tuple (``class SpectralMonitor(*CALLBACK_BASES)``, the Lightning callback
of both namespaces) would show that expression as its base; such bases are dropped, and the docstring says
what the class derives from.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):`(~?)([^`]+)`")
LITERAL_BLOCK_OPENER = re.compile(r"(\S)::$", flags=re.M)


def _markdown(docstring: str) -> str:
    def role(match: re.Match[str]) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short else target}`"

    return LITERAL_BLOCK_OPENER.sub(r"\1:", ROLE.sub(role, docstring))


class SphinxRolesAsMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        cls.bases = [base for base in cls.bases if not str(base).startswith("*")]
