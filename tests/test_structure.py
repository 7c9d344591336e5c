"""The shape of the source tree: no import cycles among the modules under src/, no module over 500 lines,
no function over 80 lines, no top-level definition referenced nowhere, no module file name in two
packages (a feature package's plugin-protocol modules aside), lower layers never import higher ones (the
runtime never imports a feature or the composition root), the pure layers never import torch, and
only the run spec's flag generator declares command-line flags.

Imports are read with ``ast`` (nothing is imported). Every ``import`` statement counts as an edge,
at module level or inside a function: a lazy import hides a cycle from the interpreter, not from the
design. So does an import path written as a string, ``"package.module:attr"`` (how feature bundles
name their plugins and hooks): a string constant of that form whose module is under src/ is an edge
too, and so is a module imported by name, ``importlib.import_module("pipewright.x")`` or
``import_module(f"pipewright.features.{name}.options")``: an edge to every module under src/ the name can
be (each formatted value standing for one or more dotted names), and a package's names loaded on first
use (``lazy_attributes``: a module name as a string). Imports under ``if TYPE_CHECKING:`` are the
exception: they exist for annotations, never run,
and create no dependency. ``import a.b`` / ``from a import b`` is an edge to module ``a.b`` when it
exists, else to ``a``; the implicit import of a parent package's ``__init__`` is not counted.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 500
MAX_FUNCTION_LINES = 80

#: Functions longer than MAX_FUNCTION_LINES, listed only while they are split along their jobs. The list
#: must shrink to empty: never add to it; remove an entry when its function is split (the test fails
#: while a listed function is gone or short enough).
LONG_FUNCTIONS: set[str] = set()

#: Top-level definitions referenced nowhere, listed only while they are removed. The list must shrink to
#: empty: never add to it (the test fails while a listed name is gone or referenced).
UNUSED_DEFINITIONS: set[str] = set()
#: Where a reference counts: the code, tests, benchmarks and tools, the documents (a command they show),
#: and the package metadata (entry points).
REFERENCE_GLOBS = (
    "src/**/*.py",
    "tests/**/*.py",
    "benchmarks/**/*.py",
    "tools/**/*.py",
    "*.md",
    "docs/**/*.md",
)

#: The module names a feature package may share with the other feature packages and with the core
#: part it plugs into: its part of that layer or command (``features/vocab/kinds.py`` its action kinds,
#: ``options.py`` its option section, ``cost.py`` its cost rules, ``runtime.py`` its runtime parts,
#: ``train.py`` its training plugin, ``simulate.py`` its ``simulate`` hook, ``feature.py`` its bundle;
#: docs/architecture.md).
FEATURE_PROTOCOL = frozenset(
    {"cost.py", "feature.py", "kinds.py", "options.py", "runtime.py", "simulate.py", "train.py"}
)
#: Module file names used in more than one package, listed only while one of each is renamed; empty it,
#: never add to it (the test fails while a listed name is used once).
REUSED_NAMES: dict[str, str] = {}

#: The one module that declares command-line flags (every command's, generated from the run spec).
FLAG_GENERATOR = "pipewright.runspec.flags"
#: Other modules calling ``add_argument``, listed only while their calls are removed; empty it, never add.
OTHER_FLAG_DECLARATIONS: set[str] = set()

#: Known import cycles, listed only while they are removed; empty it, never add to it. Each is a registry
#: that imports its entries by name (``import_module(f"…{name}")``, seen since those calls count) while
#: an entry imports the registry back: the schedule families import ``ScheduleInfo`` from the schedule
#: registry, the commands import the CLI package, the asynchronous feature's trainer asks
#: ``pipewright.features`` for the library's schedules.
KNOWN_CYCLES: set[frozenset[str]] = set()

#: The option-section modules of the features: the only feature modules the run spec imports (the
#: built-in features' sections, :mod:`pipewright.runspec.feature_registry`).
FEATURE_OPTIONS = re.compile(r"pipewright\.features\.\w+\.options")

#: The layers above the foundation modules (the option sections, the value checks).
_ABOVE_FOUNDATION = (
    "pipewright.models",
    "pipewright.cost",
    "pipewright.sim",
    "pipewright.plan",
    "pipewright.runspec",
    "pipewright.features",
    "pipewright.runtime",
    "pipewright.training",
    "pipewright.measure",
    "pipewright.cli",
)
#: A module under the key never imports one under the values (lower layers never import higher ones).
FORBIDDEN = {
    "pipewright.runtime": (
        "pipewright.features",
        "pipewright.training",
        "pipewright.cli",
        "pipewright.measure",
    ),
    "pipewright.measure": ("pipewright.cli",),  # above the composition root, below the CLI
    "pipewright.features": ("pipewright.training", "pipewright.cli"),
    "pipewright.training": ("pipewright.cli",),
    "pipewright.codec": ("pipewright.passes",),
    # a feature plugs into these layers (its cost rules, hooks, passes): they call it, never import it
    "pipewright.passes": ("pipewright.schedules", "pipewright.features", "pipewright.sim", "pipewright.cli"),
    "pipewright.schedules": ("pipewright.features", "pipewright.sim", "pipewright.plan", "pipewright.cli"),
    "pipewright.models": (  # below the cost models and the run spec, which read a ModelSpec and presets
        "pipewright.cost",
        "pipewright.runspec",
        "pipewright.runtime",
        "pipewright.sim",
        "pipewright.plan",
        "pipewright.features",
        "pipewright.cli",
    ),
    "pipewright.cost": (
        "pipewright.runtime",
        "pipewright.sim",
        "pipewright.plan",
        "pipewright.features",
        "pipewright.cli",
    ),
    "pipewright.sim": ("pipewright.runtime", "pipewright.plan", "pipewright.features", "pipewright.cli"),
    "pipewright.plan": ("pipewright.runtime", "pipewright.features", "pipewright.cli"),
    "pipewright.mesh": ("pipewright.runtime", "pipewright.cost", "pipewright.sim", "pipewright.plan"),
    "pipewright.topology": ("pipewright.runtime", "pipewright.cost", "pipewright.sim", "pipewright.plan"),
    "pipewright.runspec": (  # below the cost models, which read a spec
        "pipewright.cost",
        "pipewright.runtime",
        "pipewright.sim",
        "pipewright.plan",
        "pipewright.training",
        "pipewright.cli",
    ),
    # the option sections and the checks of values people write: below every layer that declares options
    **dict.fromkeys(("pipewright.options", "pipewright.values"), _ABOVE_FOUNDATION),
}
#: Pure Python: these modules (and packages) import no torch.
PURE = (
    "pipewright.ir",
    "pipewright.kinds",
    "pipewright.deps",
    "pipewright.passes",
    "pipewright.schedules",
    "pipewright.cost",
    "pipewright.sim",
    "pipewright.plan",
    "pipewright.topology",
    "pipewright.hardware",
    "pipewright.mesh",
    "pipewright.models.spec",
    "pipewright.models.layout",
    "pipewright.models.layout_text",
    "pipewright.runspec",
)


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@dataclass(frozen=True)
class ModuleFacts:
    """What the tests read from one module: its imports, its functions' lengths, its top-level names."""

    imports: frozenset[str]
    function_lengths: dict[str, int]
    definitions: tuple[str, ...]


@cache
def facts(name: str) -> ModuleFacts:
    """One parse per module, shared by the tests (the tree itself is not kept)."""
    path = modules()[name]
    module = ast.parse(path.read_text(), str(path))
    return ModuleFacts(
        frozenset(_imports(module, name)),
        function_lengths(module, name),
        tuple(top_level_definitions(module)),
    )


def imports(name: str) -> set[str]:
    """Every module name ``name`` imports (module- and function-level), resolved as the docstring says;
    names outside src/ (torch, stdlib) are kept as written."""
    return set(facts(name).imports)


def _imports(module: ast.Module, name: str) -> set[str]:
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    lazy = any(_called(n) == "lazy_attributes" for n in ast.walk(module) if isinstance(n, ast.Call))
    for node in _runtime_nodes(module):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules() else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = import_string(node.value)
            if target is not None:
                out.add(target)
            elif lazy and node.value in modules():  # (pipewright.lazy: name → its module)
                out.add(node.value)
        elif isinstance(node, ast.Call):
            out.update(imported_by_name(node))
    out.discard(name)
    return out


def _called(call: ast.Call) -> str:
    """The name of the function ``call`` calls (``importlib.import_module(…)``: ``import_module``)."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def imported_by_name(call: ast.Call) -> set[str]:
    """The modules under src/ that ``importlib.import_module(NAME)`` can import: NAME a string constant
    or an f-string, whose formatted values each stand for one or more dotted names (any other
    argument: none)."""
    if _called(call) != "import_module" or not call.args:
        return set()
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        pattern = re.escape(arg.value)
    elif isinstance(arg, ast.JoinedStr):
        pattern = "".join(
            re.escape(part.value) if isinstance(part, ast.Constant) else r"\w+(?:\.\w+)*"
            for part in arg.values
        )
    else:
        return set()
    return {m for m in modules() if re.fullmatch(pattern, m)}


_IMPORT_STRING = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+):[A-Za-z_][\w]*$")


def import_string(text: str) -> str | None:
    """The module under src/ that ``"package.module:attr"`` names, else None."""
    match = _IMPORT_STRING.match(text)
    return match.group(1) if match and match.group(1) in modules() else None


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only, which never
    run and so create no dependency)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {t for t in imports(m) if t in mods} for m in mods}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_cycle_path(g, set(comp)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _cycle_path(g: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One closed path through a strongly connected component, for the failure message."""
    start = min(comp)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in g[path[-1]] if w in comp)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return [*path, start]
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return [*path, next(iter(nxt))]
        path.append(fresh[0])
        seen.add(fresh[0])


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_strings_are_edges() -> None:
    assert import_string("pipewright.features.kfac.train:KfacPlugin") == "pipewright.features.kfac.train"
    assert import_string("no.such.module:attr") is None
    assert import_string("pipewright.features.kfac.train") is None
    assert "pipewright.features.kfac.train" in imports("pipewright.features.kfac.feature")


def test_modules_imported_by_name_are_edges() -> None:
    call = ast.parse('importlib.import_module(f"pipewright.features.{name}.options")').body[0].value
    assert imported_by_name(call) == {m for m in modules() if FEATURE_OPTIONS.fullmatch(m)}
    assert imported_by_name(ast.parse('import_module("pipewright.ir")').body[0].value) == {"pipewright.ir"}
    assert imported_by_name(ast.parse("import_module(name)").body[0].value) == set()
    assert "pipewright.features.kfac.feature" in imports("pipewright.features")
    assert "pipewright.features.kfac.feature" in imports("pipewright.features.kfac")  # a lazy name's


def test_cycle_finder_reports_a_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(graph())
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles: " + "; ".join(" -> ".join(c) for c in new)
    stale = KNOWN_CYCLES - {frozenset(c) for c in found}
    assert not stale, f"gone, remove from KNOWN_CYCLES: {[sorted(c) for c in stale]}"


def test_no_module_over_500_lines() -> None:
    long = {
        name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along their jobs): {long}"


def test_lower_layers_never_import_higher_ones() -> None:
    bad = [
        f"{m} imports {t}"
        for m in modules()
        for layer, above in FORBIDDEN.items()
        if _under(m, layer)
        for t in imports(m)
        if any(_under(t, a) for a in above)
    ]
    assert not bad, "; ".join(bad)


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for t in g[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_run_spec_reads_only_the_features_option_sections() -> None:
    """The run spec's default feature sections come from the features' options modules alone, and those
    import nothing above the option sections (so the run spec depends on no feature bundle, kinds,
    passes, cost rules or runtime)."""
    read = {
        t
        for m in modules()
        if _under(m, "pipewright.runspec")
        for t in imports(m)
        if _under(t, "pipewright.features")
    }
    assert read, "the run spec's feature registry is not seen importing the options modules"
    bad = sorted(t for t in read if not FEATURE_OPTIONS.fullmatch(t))
    assert not bad, f"the run spec imports feature modules other than their option sections: {bad}"
    g = graph()
    above = [
        f"{m} imports {t}"
        for m in modules()
        if FEATURE_OPTIONS.fullmatch(m)
        for t in sorted(reachable(g, m))
        if any(_under(t, layer) for layer in _ABOVE_FOUNDATION)
    ]
    assert not above, "; ".join(above)


def test_pure_layers_import_no_torch() -> None:
    bad = [
        f"{m} imports {t}"
        for m in modules()
        if any(_under(m, p) for p in PURE)
        for t in imports(m)
        if _under(t, "torch")
    ]
    assert not bad, "; ".join(bad)


def function_lengths(module: ast.Module, name: str) -> dict[str, int]:
    """Lines of every function and method in ``module`` (``def`` line to last line, decorators not
    counted), keyed ``name:Class.method`` (nested functions as ``outer.inner``). Only statement lists
    are walked: a function is always a statement."""
    out = {}
    todo: list[tuple[ast.AST, str]] = [(module, "")]
    while todo:
        node, prefix = todo.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = prefix + child.name
                    if not isinstance(child, ast.ClassDef):
                        out[f"{name}:{qual}"] = child.end_lineno - child.lineno + 1
                    todo.append((child, qual + "."))
                elif isinstance(child, ast.AST):
                    todo.append((child, prefix))
    return out


def test_function_lengths_are_measured_per_method() -> None:
    source = "class A:\n def f(self):\n  if 1:\n   def g():\n    pass\n  return g\n"
    assert function_lengths(ast.parse(source), "m") == {"m:A.f": 5, "m:A.f.g": 2}


def test_no_function_over_80_lines() -> None:
    lengths = {q: n for name in modules() for q, n in facts(name).function_lengths.items()}
    long = {q: n for q, n in lengths.items() if n > MAX_FUNCTION_LINES and q not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them along their jobs): {long}"
    stale = sorted(q for q in LONG_FUNCTIONS if lengths.get(q, 0) <= MAX_FUNCTION_LINES)
    assert not stale, f"gone or split, remove from LONG_FUNCTIONS: {stale}"


def top_level_definitions(module: ast.Module) -> list[str]:
    """Names a module defines at top level (functions, classes, assigned names), less dunders and
    decorated definitions (a decorator may register them: they are used by being defined)."""
    names = []
    for node in module.body:
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.decorator_list
        ):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not (n.startswith("__") and n.endswith("__"))]


def unused_definitions() -> set[str]:
    """``module:name`` of each top-level definition whose name occurs nowhere but in its definitions: a
    word count over REFERENCE_GLOBS and pyproject.toml, so an import, a call, an ``__all__`` entry, an
    import-path string, a docstring's or a document's mention all count as references."""
    words: Counter[str] = Counter()
    paths = {p for pattern in REFERENCE_GLOBS for p in ROOT.glob(pattern)} | {ROOT / "pyproject.toml"}
    paths.discard(Path(__file__).resolve())  # UNUSED_DEFINITIONS names them
    for path in paths:
        words.update(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    defined = {name: facts(name).definitions for name in modules()}
    times_defined = Counter(n for names in defined.values() for n in names)
    return {f"{m}:{n}" for m, names in defined.items() for n in names if words[n] <= times_defined[n]}


def test_no_definition_referenced_nowhere() -> None:
    unused = unused_definitions()
    new = sorted(unused - UNUSED_DEFINITIONS)
    assert not new, f"top-level definitions referenced nowhere (remove them): {new}"
    stale = sorted(UNUSED_DEFINITIONS - unused)
    assert not stale, f"removed or referenced now, remove from UNUSED_DEFINITIONS: {stale}"


def reused_names() -> dict[str, list[str]]:
    """Each module file name (``__init__.py`` aside) that more than one package holds, with its paths
    under src/pipewright; a feature package's FEATURE_PROTOCOL modules (``features/<name>/kinds.py``)
    are not counted."""
    where: dict[str, list[str]] = {}
    for path in modules().values():
        rel = path.relative_to(SRC / "pipewright")
        protocol = len(rel.parts) == 3 and rel.parts[0] == "features" and rel.name in FEATURE_PROTOCOL
        if rel.name != "__init__.py" and not protocol:
            where.setdefault(rel.name, []).append(rel.as_posix())
    return {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}


def test_no_file_name_in_two_packages() -> None:
    found = reused_names()
    new = {n: p for n, p in found.items() if n not in REUSED_NAMES}
    assert not new, f"module names used in two packages (name each for what it holds): {new}"
    stale = sorted(set(REUSED_NAMES) - set(found))
    assert not stale, f"renamed, remove from REUSED_NAMES: {stale}"


def test_feature_protocol_names_are_in_use() -> None:
    """The allowance is not wider than the features: each plugin-protocol name is a module of one."""
    held = {p.name for p in (SRC / "pipewright" / "features").glob("*/*.py")}
    assert not FEATURE_PROTOCOL - held, sorted(FEATURE_PROTOCOL - held)


def declares_flags(name: str) -> bool:
    """Whether module ``name`` calls ``….add_argument(…)``."""
    text = modules()[name].read_text()
    if "add_argument" not in text:
        return False
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
        for n in ast.walk(ast.parse(text))
    )


def test_only_the_generator_declares_flags() -> None:
    declaring = {m for m in modules() if declares_flags(m)}
    assert FLAG_GENERATOR in declaring
    new = sorted(declaring - OTHER_FLAG_DECLARATIONS - {FLAG_GENERATOR})
    assert not new, f"flags declared outside {FLAG_GENERATOR} (declare a run-spec field): {new}"
    stale = sorted(OTHER_FLAG_DECLARATIONS - declaring)
    assert not stale, f"no flags declared there now, remove from OTHER_FLAG_DECLARATIONS: {stale}"
