"""MkDocs hooks of the documentation site: the package version in the footer, and TeX maths as MathML.

The version is read from ``spectral_monitor.__version__``, the one place it is written (``pyproject.toml``
reads it from there too). Maths is written ``$...$`` (inline) or ``$$...$$`` (display) and converted to
MathML while the page is built, by ``latex2mathml``: browsers render MathML natively, so the site needs no
script and no network.
"""

from __future__ import annotations

import re
from typing import Any

from latex2mathml.converter import convert
from markdown import Extension, Markdown
from markdown.inlinepatterns import InlineProcessor

import spectral_monitor

# After code spans (190), so a `$` in code stays code, and before backslash escapes (180), so the TeX's
# backslashes reach the converter.
MATH_PRIORITY = 185
DISPLAY_MATH = r"(?<![\\$])\$\$(?P<tex>.+?)\$\$"
# No space inside the dollars and no word character outside them, so "$5 and $6" stays text.
INLINE_MATH = r"(?<![\\$\w])\$(?=\S)(?P<tex>[^$\n]+?)(?<=\S)\$(?![\w$])"


class _MathProcessor(InlineProcessor):
    def __init__(self, pattern: str, md: Markdown, display: str) -> None:
        super().__init__(pattern, md)
        self.display = display

    def handleMatch(self, m: re.Match[str], data: str) -> tuple[str, int, int]:  # noqa: N802 (Markdown's API)
        mathml = convert(m.group("tex").strip(), display=self.display)
        return self.md.htmlStash.store(mathml), m.start(0), m.end(0)


class MathMLExtension(Extension):
    """``$...$`` and ``$$...$$`` as MathML."""

    def extendMarkdown(self, md: Markdown) -> None:  # noqa: N802 (Markdown's API)
        md.inlinePatterns.register(
            _MathProcessor(DISPLAY_MATH, md, "block"), "display_math", MATH_PRIORITY + 1
        )
        md.inlinePatterns.register(_MathProcessor(INLINE_MATH, md, "inline"), "inline_math", MATH_PRIORITY)


def on_config(config: Any) -> Any:
    config["copyright"] = f"spectral-monitor {spectral_monitor.__version__}"
    config["markdown_extensions"].append(MathMLExtension())
    return config
