"""The house rules of the layout (docs/layout.md; the README's map), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "judgeloop"


def _imports(path: Path) -> list[str]:
    """Every judgeloop module a file imports, at top level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("judgeloop"):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("judgeloop")]
    return out


def test_commands_are_thin_shells_that_import_no_other_command():
    for path in sorted((SRC / "commands").glob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= 150, f"{path.name} has {lines} lines; move its logic into the library"
        others = [m for m in _imports(path) if m.startswith("judgeloop.commands")]
        assert not others, f"{path.name} imports {others}; commands import the library, not each other"


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("data", ("judgeloop.retrieval", "judgeloop.models", "judgeloop.raft", "judgeloop.loop")),
        ("calibration", ("judgeloop.loop", "judgeloop.commands", "judgeloop.raft")),
        ("retrieval", ("judgeloop.raft", "judgeloop.loop", "judgeloop.commands")),
        ("judges", ("judgeloop.loop", "judgeloop.commands", "judgeloop.raft")),
    ],
)
def test_imports_point_down_the_house(package, forbidden):
    for path in sorted((SRC / package).rglob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(forbidden)]
        assert not bad, f"{path.relative_to(SRC)} imports {bad}: {package}/ sits below those packages"


COMPONENTS = ("judges", "calibration", "retrieval", "routing", "raft", "data", "loop", "models")


@pytest.mark.parametrize("package", COMPONENTS)
def test_components_import_no_study_and_no_command(package):
    """Studies (experiment drivers and their reports) sit above the components they run; a component
    that imported one would pull a driver, its schema and its report into every user of the component."""
    for path in sorted((SRC / package).rglob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(("judgeloop.studies", "judgeloop.commands"))]
        assert not bad, f"{path.relative_to(SRC)} imports {bad}: a component imports no study and no command"


def test_no_function_is_over_100_lines():
    long = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and node.end_lineno - node.lineno + 1 > 100:
                long.add(f"{path.relative_to(SRC)}:{node.name}")
    assert not long, f"functions over 100 lines: {sorted(long)}; split them into named steps"


def test_calibration_imports_no_judge():
    """judges/ (a panel calibrating its members, a calibrated judge) imports calibration's calibrators and
    pair features, so calibration/ sits below judges/ and imports none of it; what scores pairs with a judge
    (the calibration lab, the judge probe) is a study."""
    for path in sorted((SRC / "calibration").rglob("*.py")):
        bad = [m for m in _imports(path) if m.startswith("judgeloop.judges")]
        assert not bad, f"{path.relative_to(SRC)} imports {bad}; calibration/ sits below judges/"
