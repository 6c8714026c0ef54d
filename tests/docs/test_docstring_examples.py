"""The examples in the docstrings run as written, and every public name's docstring says the whole contract.

Every module of the package whose source holds a ``>>>`` example is doctested, one test per module, and
every module that defines a public class or function holds one. In every public module (no part of its
name starts with ``_``), the public names (``__all__``, or what the module defines) say their whole
contract in Google-style sections: a function names every argument under ``Args:``, has
``Returns:`` where it returns a value (``Yields:`` where it yields), ``Raises:`` naming each exception class
it raises, and ``Examples:`` with a doctest, or a code block where a doctest cannot be cheap; a class has
``Examples:``, names each ``__init__`` argument under ``Args:`` or ``Attributes:`` (with ``Raises:`` where
``__init__`` raises), and each public method it defines is held to a function's sections but the example.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import spectral_monitor

PACKAGE = Path(spectral_monitor.__file__).parent


def public_modules() -> list[str]:
    """The package and each of its modules that no ``_``-prefixed part of its name keeps private."""
    found = [info.name for info in pkgutil.walk_packages(spectral_monitor.__path__, "spectral_monitor.")]
    return ["spectral_monitor"] + sorted(
        name for name in found if not any(part.startswith("_") for part in name.split("."))
    )


def modules_with_examples() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(spectral_monitor.__path__, "spectral_monitor.")
        if ">>> " in Path(importlib.util.find_spec(info.name).origin).read_text()
    ]
    return sorted(names)


def defines_public_names(module_name: str) -> bool:
    """Whether a module defines a public class or function of its own, rather than only re-exporting."""
    module = importlib.import_module(module_name)
    return any(
        getattr(getattr(module, name), "__module__", None) == module_name
        and (inspect.isclass(getattr(module, name)) or inspect.isfunction(getattr(module, name)))
        for name in public_names(module)
    )


def test_every_module_that_defines_public_names_is_doctested() -> None:
    defining = {name for name in public_modules() if defines_public_names(name)}
    assert len(defining) > 50
    assert not defining - set(modules_with_examples())


@pytest.mark.parametrize("module_name", modules_with_examples())
def test_the_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed"


SECTION_HEADER = re.compile(r"(?P<name>[A-Z][a-z]+(?: [A-Z]?[a-z]+)?):[ \t]*")
ENTRY = re.compile(r"(?P<stars>\*{0,2})(?P<name>\w+)(?: \([^)]*\))?:")
NO_VALUE = {"None", "NoReturn", "Never", "typing.NoReturn", "typing.Never"}


def sections(docstring: str) -> dict[str, list[str]]:
    """A docstring's Google-style sections: each header line (``Args:``) → the indented lines under it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in docstring.splitlines():
        header = SECTION_HEADER.fullmatch(line)
        if header:
            current = found.setdefault(header["name"], [])
        elif current is not None and (not line.strip() or line[0].isspace()):
            current.append(line)
        else:
            current = None
    return found


def entry_names(lines: list[str]) -> set[str]:
    """The names a section's entries document (``name:`` or ``name (type):`` at the section's indentation)."""
    indented = [line for line in lines if line.strip()]
    if not indented:
        return set()
    indent = min(len(line) - len(line.lstrip()) for line in indented)
    entries = (ENTRY.match(line[indent:]) for line in indented if len(line) - len(line.lstrip()) == indent)
    return {entry["name"] for entry in entries if entry}


def own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body, not those of the functions or classes defined inside it."""
    nodes, pending = [], list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return nodes


def function_tree(function: object) -> ast.AST:
    return ast.parse(inspect.cleandoc("\n" + inspect.getsource(function))).body[0]


def raised_names(function: object) -> set[str]:
    """What ``function`` raises: exception class names, ``""`` for a re-raise or a raised variable."""
    names = set()
    for node in ast.walk(function_tree(function)):
        if isinstance(node, ast.Raise):
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = ast.unparse(raised).rsplit(".", 1)[-1] if raised is not None else ""
            names.add(name if name[:1].isupper() else "")
    return names


def gives_a_value(function: object) -> bool:
    """Whether ``function`` returns something: by its annotation, or a ``return`` with a value."""
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        return str(annotation) not in NO_VALUE and annotation is not None
    return any(
        isinstance(node, ast.Return)
        and node.value is not None
        and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        for node in own_nodes(function_tree(function))
    )


def parameter_names(function: object, *, bound: bool) -> list[str]:
    parameters = list(inspect.signature(function).parameters)
    return parameters[1:] if bound and parameters else parameters


def function_gaps(name: str, function: object, *, bound: bool = False, example: bool = True) -> list[str]:
    """What the docstring of a function (or a method, ``bound``) leaves out of its contract."""
    function = inspect.unwrap(function)
    docstring = inspect.getdoc(function) or ""
    if not docstring:
        return [f"{name} has no docstring"]
    found = sections(docstring)
    gaps = []
    parameters = parameter_names(function, bound=bound)
    documented = entry_names(found.get("Args", []))
    gaps += [
        f"{name} does not document its argument {parameter!r} under Args:"
        for parameter in parameters
        if parameter not in documented
    ]
    if inspect.isgeneratorfunction(function):
        if "Yields" not in found:
            gaps.append(f"{name} yields but has no Yields: section")
    elif gives_a_value(function) and "Returns" not in found:
        gaps.append(f"{name} returns a value but has no Returns: section")
    raised = raised_names(function)
    if raised and "Raises" not in found:
        gaps.append(f"{name} raises but has no Raises: section")
    elif raised:
        listed = entry_names(found["Raises"])
        gaps += [
            f"{name} raises {error} but its Raises: section does not name it"
            for error in sorted(raised - {""})
            if error not in listed
        ]
    if example:
        gaps += example_gaps(name, found)
    return gaps


def example_gaps(name: str, found: dict[str, list[str]]) -> list[str]:
    """An ``Examples:`` section with a doctest or, where one cannot be cheap, a fenced code block."""
    if "Examples" not in found:
        return [f"{name} has no Examples: section"]
    body = "\n".join(found["Examples"])
    if ">>> " not in body and "```" not in body:
        return [f"{name}'s Examples: section holds neither a doctest nor a code block"]
    return []


def class_gaps(name: str, cls: type) -> list[str]:
    """What a class's docstring leaves out: an example, each ``__init__`` argument (under Args: or
    Attributes:), and the contract of each public method it defines."""
    docstring = inspect.getdoc(cls) or ""
    if not docstring:
        return [f"{name} has no docstring"]
    found = sections(docstring)
    gaps = example_gaps(name, found)
    init = vars(cls).get("__init__")
    if inspect.isfunction(init) and init.__module__ == cls.__module__:  # not a Protocol's placeholder
        documented = entry_names(found.get("Args", [])) | entry_names(found.get("Attributes", []))
        gaps += [
            f"{name} does not document its argument {parameter!r} under Args: or Attributes:"
            for parameter in parameter_names(init, bound=True)
            if parameter not in documented
        ]
        written = init.__code__.co_filename != "<string>"  # a dataclass's generated __init__ has no source
        raised = raised_names(init) if written else set()
        if raised and "Raises" not in found:
            gaps.append(f"{name} raises in __init__ but has no Raises: section")
    for member_name, member in vars(cls).items():
        if member_name.startswith("_"):
            continue
        qualified = f"{name}.{member_name}"
        if isinstance(member, property):
            if not inspect.getdoc(member):
                gaps.append(f"{qualified} has no docstring")
        elif isinstance(member, (staticmethod, classmethod)):
            gaps += function_gaps(
                qualified, member.__func__, bound=isinstance(member, classmethod), example=False
            )
        elif inspect.isfunction(member):
            gaps += function_gaps(qualified, member, bound=True, example=False)
    return gaps


def public_names(module: object) -> list[str]:
    return getattr(module, "__all__", None) or [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def docstring_gaps(module: object) -> list[str]:
    """Every gap in the docstrings of a module's public names."""
    gaps = []
    for name in public_names(module):
        value = getattr(module, name)
        qualified = f"{module.__name__}.{name}"
        if inspect.isclass(value):
            gaps += class_gaps(qualified, value)
        elif inspect.isfunction(value):
            gaps += function_gaps(qualified, value)
    return gaps


@pytest.mark.parametrize("module_name", public_modules())
def test_public_names_have_complete_docstrings(module_name: str) -> None:
    gaps = docstring_gaps(importlib.import_module(module_name))
    assert not gaps, "\n".join(gaps)


def scaled(value: float, factor: float = 2.0) -> float:
    """A sample whose docstring says the whole contract.

    Args:
        value: What to scale.
        factor (float): By how much.

    Returns:
        ``value * factor``.

    Raises:
        ValueError: If ``factor`` is negative.

    Examples:
        >>> scaled(1.0)
        2.0
    """
    if factor < 0:
        raise ValueError("factor must be at least 0")
    return value * factor


def without_returns(value: float) -> float:
    """A sample that returns a value but does not say what.

    Args:
        value: What to return.

    Examples:
        >>> without_returns(1.0)
        1.0
    """
    return value


def without_an_argument(value: float, factor: float) -> float:
    """A sample that leaves an argument out.

    Args:
        value: What to scale.

    Returns:
        The product. ``factor:`` mentioned in passing is not an entry.

    Examples:
        >>> without_an_argument(1.0, 2.0)
        2.0
    """
    return value * factor


def raising_unnamed(value: float) -> float:
    """A sample whose Raises: section names another error than the one it raises.

    Args:
        value: What to check.

    Returns:
        ``value``.

    Raises:
        TypeError: Never.

    Examples:
        >>> raising_unnamed(1.0)
        1.0
    """
    if value < 0:
        raise ValueError("value must be at least 0")
    return value


def counting(stop: int):
    """A sample generator with a Returns: section where it needs Yields:.

    Args:
        stop: Where to stop.

    Returns:
        Nothing: it yields.

    Examples:
        >>> list(counting(2))
        [0, 1]
    """
    yield from range(stop)


def with_prose_for_an_example(value: float) -> None:
    """A sample whose Examples: section is prose only.

    Args:
        value: Ignored.

    Examples:
        Call it with any number.
    """


class Holder:
    """A sample class whose method and ``__init__`` argument go undocumented.

    Args:
        first: Kept.

    Examples:
        >>> Holder(1, 2).total()
        3
    """

    def __init__(self, first: int, second: int) -> None:
        self.first, self.second = first, second

    def total(self) -> int:
        """The sum of both."""
        return self.first + self.second


@pytest.mark.parametrize(
    ("sample", "gap"),
    [
        (without_returns, "without_returns returns a value but has no Returns: section"),
        (without_an_argument, "without_an_argument does not document its argument 'factor' under Args:"),
        (raising_unnamed, "raising_unnamed raises ValueError but its Raises: section does not name it"),
        (counting, "counting yields but has no Yields: section"),
        (with_prose_for_an_example, "with_prose_for_an_example's Examples: section holds neither a doctest"),
        (Holder, "Holder does not document its argument 'second' under Args: or Attributes:"),
        (Holder, "Holder.total returns a value but has no Returns: section"),
    ],
)
def test_the_check_finds_each_kind_of_gap(sample: object, gap: str) -> None:
    check = class_gaps if inspect.isclass(sample) else function_gaps
    gaps = check(sample.__name__, sample)
    assert any(found.startswith(gap) for found in gaps), gaps


def test_the_check_passes_a_complete_docstring() -> None:
    assert function_gaps("scaled", scaled) == []
    assert scaled(1.5, 3.0) == 4.5
