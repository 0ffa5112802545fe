"""The house rules of the layout (docs/layout.md; the README's map), checked on the source."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "judgeloop"
FORMATTER_MARKER = re.compile(r"#\s*fmt:\s*(skip|off)\b")


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the judgeloop modules it imports: at top level, inside a function or under
    ``TYPE_CHECKING`` alike (a type-only import still ties the two modules together for a reader).
    ``from judgeloop.pkg import mod`` counts as an import of the module ``judgeloop.pkg.mod``."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for me, path in paths.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in paths and t != me}
        graph[me] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    """``judgeloop.loop.steps`` -> ``judgeloop.loop``; a top-level module belongs to ``judgeloop``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else "judgeloop"


def test_no_package_has_an_import_circle():
    """Inside a package the modules form layers: none imports, directly or round about, one that imports
    it (type-only and function-level imports included), so each can be read after those it uses."""
    graph = _import_graph()
    circles = []
    for package in sorted({_package(m) for m in graph}):
        inside = {m for m in graph if _package(m) == package}
        circles += _circles({m: graph[m] & inside for m in inside})
    assert not circles, f"import circles inside a package: {circles}; move what both need below both"


def test_nothing_below_the_run_names_loop_run():
    """``LoopRun`` (loop/setup.py) is the run; the modules setup.py imports, directly or not (the steps,
    the evaluation, the pairs, the state, ...), take the run's parts instead. Only the run's own rooms
    (setup, run, alarms) name it."""
    graph = _import_graph()
    below, todo = set(), ["judgeloop.loop.setup"]
    while todo:
        for m in graph[todo.pop()] - below:
            below.add(m)
            todo.append(m)
    assert {"judgeloop.loop.steps", "judgeloop.loop.evaluation"} <= below
    naming = []
    for module in sorted(below):
        path = SRC.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            # a name (LoopRun), an attribute (setup.LoopRun), an imported name
            if "LoopRun" in {getattr(node, key, None) for key in ("id", "attr", "name")}:
                naming.append(module)
                break
    assert not naming, f"{naming} name LoopRun but sit below loop/setup.py; pass them the run's parts"


def test_the_formatter_lays_out_all_code():
    """``ruff format`` lays out every file (``make lint`` checks it): no statement opts out with a
    formatter marker (skip, off); one would be kept only for a table aligned by hand, and there is none."""
    root = SRC.parents[1]
    marked = []
    for folder in ("src", "tests", "recipes", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if FORMATTER_MARKER.search(line):
                    marked.append(f"{path.relative_to(root)}:{n}")
    assert not marked, f"formatter markers at {marked}: let ruff format lay the statement out"


def test_the_version_is_on_the_ground_floor_and_no_module_reads_the_package_root():
    """``version.py`` imports nothing of judgeloop, so every module may read ``__version__`` from it; the
    package root (``judgeloop/__init__.py``) re-exports it and the calibrated judge lazily, so a module that
    imported the root would point up at everything the root can load."""
    graph = _import_graph()
    assert graph["judgeloop.version"] == set(), "version.py imports judgeloop modules; it is the ground floor"
    assert graph["judgeloop"] <= {"judgeloop.version", "judgeloop.judges", "judgeloop.judges.calibrated"}
    readers = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bare = isinstance(node, ast.Import) and "judgeloop" in {a.name for a in node.names}
            # from judgeloop import devices: a module of the package, not the root's own names
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            own = isinstance(node, ast.ImportFrom) and node.module == "judgeloop" and node.level == 0
            if bare or (own and any(f"judgeloop.{n}" not in graph for n in names)):
                readers.append(_module_name(path))
    readers = sorted(set(readers) - {"judgeloop"})
    assert not readers, f"{readers} import the package root; read judgeloop.version instead"


# the core, on the house's lowest floors (docs/layout.md): every other module may import it, so it imports
# nothing of judgeloop but itself
CORE = {
    "judgeloop.version",
    "judgeloop.errors",
    "judgeloop.logging",
    "judgeloop.hashing",
    "judgeloop.intervals",
    "judgeloop.text",
    "judgeloop.io",
    "judgeloop.config",
    "judgeloop.deprecation",
}


def test_the_core_imports_nothing_above_it():
    """A core module that imported a package (``config.py`` once reached into ``models/`` for the cache
    folder) would point up at everything that package imports, and drag it into every user of the core."""
    graph = _import_graph()
    above = {m: sorted(graph[m] - CORE) for m in sorted(CORE) if graph[m] - CORE}
    assert not above, f"the core imports modules above it: {above}; move what it needs into the core"


def test_the_server_imports_no_integration():
    """The server's routes for other trainers (OpenRLHF's, verl's) live in serving/, beside the batcher they
    answer through; integrations/ (what a trainer calls: TRL's reward function, verl's compute_score) sits
    above it, so the server loads no trainer adapter."""
    for path in sorted((SRC / "serving").rglob("*.py")):
        bad = [m for m in _imports(path) if m.startswith("judgeloop.integrations")]
        assert not bad, f"{path.relative_to(SRC)} imports {bad}; serving/ sits below integrations/"


def test_no_library_module_imports_the_test_servers():
    """``judgeloop.testing`` holds servers for tests, benchmarks and demos (openai_compat.py, llamacpp.py);
    no library module imports it (the deprecated aliases at their old places in serving/ apart), so a
    user of the library, the judge server included, never loads a test server."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "testing") or _alias(path):
            continue
        found = [m for m in _imports(path) if m.startswith("judgeloop.testing")]
        if found:
            bad.append(f"{path.relative_to(SRC)} imports {found}")
    assert not bad, f"{bad}; judgeloop.testing is for tests and demos, the library imports none of it"


def test_importing_the_server_package_loads_no_test_server():
    """``import judgeloop.serving`` in a fresh process loads neither test server nor its alias (the
    modules below it are covered by the import rule above, read from the source)."""
    code = (
        "import sys, judgeloop.serving\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('judgeloop.testing') or m in "
        "('judgeloop.serving.openai_compat', 'judgeloop.serving.llamacpp'))\n"
        "assert not loaded, loaded"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


README = SRC.parents[1] / "README.md"
# a path the map names: a file (loop/steps.py) or a folder (configs/accelerate/), not one after ../ or a dot
MAP_PATH = re.compile(r"(?<![\w./-])([\w/]+\.py|\w[\w/]*/)(?!\w)")


def _map_blocks() -> list[str]:
    section = README.read_text().split("## Map of the house", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, re.S)


def _alias(path: Path) -> bool:
    """A module kept at an old name for one release (judgeloop.deprecation): the map names the new one."""
    return (ast.get_docstring(ast.parse(path.read_text())) or "").startswith("Deprecated alias")


def test_the_readme_map_names_what_exists_and_every_top_level_module_and_package():
    """The README's map of the house: every file and folder it names exists (in the repository, in
    src/judgeloop/, or in the folder its entry is about), and it names each top-level module and each
    package of src/judgeloop/ (deprecated aliases apart)."""
    root = SRC.parents[1]
    blocks = _map_blocks()
    assert len(blocks) == 2, "the map is two blocks: the repository's folders, then src/judgeloop/"
    missing, named = [], set()
    for block, bases in ((blocks[0], [root, SRC]), (blocks[1], [SRC])):
        here = None  # the folder the current entry is about (its first column)
        for line in block.splitlines():
            if line and not line[0].isspace():
                head = line.split()[0]
                here = head if head.endswith("/") else None
            for name in MAP_PATH.findall(line):
                places = [base / name for base in bases] + [base / here / name for base in bases if here]
                if not any(p.exists() for p in places):
                    missing.append(name)
            named |= set(MAP_PATH.findall(line))
    assert not missing, f"the README's map names {missing}, which do not exist; make the map true"
    top = {p.name for p in SRC.glob("*.py") if p.name != "__init__.py" and not _alias(p)}
    top |= {f"{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    unnamed = sorted(top - named)
    assert not unnamed, f"the README's map does not name {unnamed}; add each where it sits in the house"


def test_a_module_that_reads_the_metrics_table_spells_no_list_of_metrics():
    """A metric is one row of ``loop/metrics_table.py``; the evaluation, the curve, the model card and the
    ablation's report read their lists of metrics from it. A tuple, list or set of two or more metric keys
    written out in one of them would be a second list that the table no longer governs."""
    from judgeloop.loop.metrics_table import METRICS

    names = {m.name for m in METRICS} | {m.per_article for m in METRICS if m.per_article}
    spelled = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "metrics_table.py" or "judgeloop.loop.metrics_table" not in _imports(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                found = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(found) >= 2:
                    spelled.append(f"{path.relative_to(SRC)}:{node.lineno} {found}")
    assert not spelled, f"lists of metrics outside the metrics table: {spelled}; add a column to the table"


def test_no_loop_function_takes_the_policys_parts_apart():
    """The policy is one object (``loop/policy.py``'s ``Policy``: model, reference, tokenizer, prompt
    builder, backend); a loop function that took both ``tokenizer`` and ``build_prompt`` would be spelling
    its parts out again. Lower pieces take what they use: ``generate`` the model and tokenizer, the prompt
    builder its tokenizer."""
    spelled = []
    for path in sorted((SRC / "loop").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
                if {"tokenizer", "build_prompt"} <= names:
                    spelled.append(f"{path.relative_to(SRC)}:{node.name}")
    assert not spelled, f"{spelled} take tokenizer and build_prompt; take the Policy (loop/policy.py)"
