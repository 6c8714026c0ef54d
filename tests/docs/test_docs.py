"""The documentation builds without a warning, the reference covers the public API and nothing else, and the
README's commands are the real ones.

``mkdocs build --strict`` turns every broken link, missing page, unresolved cross-reference or docstring
that mkdocstrings cannot render into a failure; the site is built once per module and the tests below read
what it wrote. Every example of the README and the docs is run by ``test_docs_examples.py``.
"""

from __future__ import annotations

import ast
import html
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import markdown
import pytest

import spectral_monitor

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
# The page of the package root: its names, each linked to the page of the module it lives in.
ROOT_PAGE = DOCS / "api.md"
DOC_HEADING = re.compile(r'<h[1-6] id="(spectral_monitor[^"]*)"[^>]*class="doc doc-heading"')
IMPORT = re.compile(r"^\s*(?:from (spectral_monitor[\w.]*) import|import (spectral_monitor[\w.]*))", re.M)
GUIDE_FUNCTIONS = {
    "toolbox.sweep": "rank_collapse_sweep",
    "toolbox.preflight": "architecture_preflight",
    "toolbox.weight_spectra": "weight_spectra",
    "probes.curvature": "measure_curvature",
    "probes.jacobian": "block_jacobian_norms",
    "probes.ntk": "empirical_ntk",
}


def fenced_blocks(markdown_text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown_text, flags=re.S | re.M)


def reference_page(module: str) -> Path:
    return (
        ROOT_PAGE
        if module == "spectral_monitor"
        else REFERENCE / f"{module.removeprefix('spectral_monitor.')}.md"
    )


def built_page(site: Path, page: Path) -> Path:
    return site / page.relative_to(DOCS).with_suffix("") / "index.html"


def module_of_page(page: Path) -> str:
    return re.match(r"::: (\S+)", page.read_text()).group(1)


def declared_all(module: str) -> list[str] | None:
    """The module's ``__all__`` as written (read from the source: the package root builds it lazily)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def public_modules() -> set[str]:
    """The root, every subpackage with an ``__all__``, every module a guide imports from, and the module each
    name of ``from spectral_monitor import …`` lives in."""
    modules = {"spectral_monitor"}
    for info in pkgutil.iter_modules(spectral_monitor.__path__, "spectral_monitor."):
        if info.ispkg and declared_all(info.name) is not None:
            modules.add(info.name)
    for page in (README, *DOCS.glob("*.md")):
        for block in fenced_blocks(page.read_text(), "python"):
            modules.update(a or b for a, b in IMPORT.findall(block))
    modules.update(spectral_monitor._HOMES.values())
    return modules


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("site")
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
            str(directory),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    output = build.stdout + build.stderr
    assert build.returncode == 0, output
    assert "WARNING -" not in output, output
    return directory


def test_mkdocs_builds_strict_without_a_warning(site: Path) -> None:
    assert (site / "index.html").exists()


def test_every_public_module_has_a_reference_page_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for module in sorted(public_modules()):
        page = reference_page(module)
        assert page.exists(), f"{module} has no reference page ({page.relative_to(ROOT)})"
        assert module_of_page(page) == module, page
        assert f" {page.relative_to(DOCS)}\n" in nav, f"{page.relative_to(DOCS)} is not in the nav"


def test_every_name_of_the_package_root_links_to_its_reference_entry() -> None:
    text = ROOT_PAGE.read_text()
    for name in spectral_monitor.__all__:
        # An autorefs link: the strict build fails if the target is not documented anywhere.
        assert f"[`{name}`][{spectral_monitor._HOMES[name]}.{name}]" in text, name


def test_reference_pages_list_only_public_names(site: Path) -> None:
    pages = sorted(REFERENCE.glob("*.md"))
    assert pages
    for page in pages:
        module = module_of_page(page)
        exported = declared_all(module)
        documented = DOC_HEADING.findall(built_page(site, page).read_text())
        assert documented[0] == module, page
        for identifier in documented[1:]:
            assert identifier.startswith(module + "."), (page, identifier)
            path = identifier.removeprefix(module + ".").split(".")
            assert not any(part.startswith("_") for part in path), (page, identifier)
            if exported is not None:
                assert path[0] in exported, f"{page.name} documents {identifier}, which is not in __all__"


def test_every_exported_name_is_documented(site: Path) -> None:
    for page in sorted(REFERENCE.glob("*.md")):
        module = module_of_page(page)
        members = re.findall(r"^\s+- (\w+)$", page.read_text(), flags=re.M) or declared_all(module) or []
        documented = set(DOC_HEADING.findall(built_page(site, page).read_text()))
        for name in members:
            assert f"{module}.{name}" in documented, f"{module}.{name} is missing from {page.name}"
    for module, function in GUIDE_FUNCTIONS.items():
        assert (
            f'id="spectral_monitor.{module}.{function}"'
            in built_page(site, REFERENCE / f"{module}.md").read_text()
        )


def test_signatures_are_shown_without_starred_bases(site: Path) -> None:
    page = built_page(site, REFERENCE / "lightning.md").read_text()
    signature = re.search(r'<div class="doc-signature.*?</div>', page, flags=re.S)
    assert signature is not None and "options: MonitorOptions" in html.unescape(
        re.sub(r"<[^>]+>", "", signature.group(0))
    )
    for built in site.glob("reference/*/index.html"):
        assert "Bases: <code>*" not in built.read_text(), built


def test_the_site_shows_the_package_version(site: Path) -> None:
    version = spectral_monitor.__version__
    assert importlib.metadata.version("spectral-monitor") == version
    assert f"spectral-monitor {version}" in (site / "index.html").read_text()
    assert re.search(rf"^## {re.escape(version)}$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert f'<h2 id="{version.replace(".", "")}">{version}' in (site / "changelog" / "index.html").read_text()


def test_maths_is_rendered_as_mathml(site: Path) -> None:
    page = (site / "numerics" / "index.html").read_text()
    assert page.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">') >= 2
    text = re.sub(r"<(code|pre)[^>]*>.*?</\1>", "", page, flags=re.S)
    assert "$$" not in text and "\\frac" not in text


def test_the_maths_extension_leaves_code_and_prices_alone() -> None:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    def render(text: str) -> str:
        return markdown.markdown(text, extensions=[hooks.MathMLExtension()])

    assert (
        '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline"><mrow><msub><mi>&#x003C3;'
        in render(r"a $\sigma_1$ b")
    )
    assert "<code>$x$</code>" in render("`$x$`")
    assert render("from $5 to $6") == "<p>from $5 to $6</p>"
    assert 'display="block"' in render(r"$$\frac{a}{b}$$")


def test_readme_starts_with_the_demo_command_then_the_ci_test_command() -> None:
    first, second = fenced_blocks(README.read_text(), "bash")[:2]
    assert first.strip().endswith("spectral-monitor demo"), first
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert second.strip() in ci_script.splitlines(), second
