"""The house keeps its shape: every import points down the floors, no circles, no module over ~700 lines,
no function over ~60 lines without a comment that says why.

The imports are read from the source with ``ast`` (lazy ones inside functions included), so nothing is
imported here. A new module must be given its floor in :data:`FLOORS` (docs/architecture.md draws them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_attncost"

#: Each module's floor: a module may import from its own floor or below, never above.
FLOORS = {
    "plugin": 9,
    "session": 8,
    "cli": 7, "settings": 7, "__main__": 7,
    "baseline": 6, "__init__": 6,
    "api": 5, "reporting": 5,
    "pipeline": 4, "timing": 4, "markers": 4,
    "counting": 3, "memory": 3, "inputs": 3, "cache": 3, "series": 3, "inferred": 3,
    "families": 2, "result": 2, "flow": 2, "roles": 2, "parts": 2, "plots": 2,
    "formulas": 1, "footprint": 1, "conventions": 1, "devices": 1, "units": 1, "ops": 1, "one_run": 1, "errors": 1,
    "files": 1, "request": 1,
}
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 60
WHY_LONG = "# long:"  # a function over MAX_FUNCTION_LINES says why in a comment that starts so


def _modules() -> dict[str, Path]:
    """Dotted name inside the package (``counting.jit``, ``api``) -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules *name* imports, at any depth of its code."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            stem = [*base, *(node.module.split(".") if node.module else [])]
            candidates = [".".join([*stem, alias.name]) for alias in node.names] + [".".join(stem)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest_attncost"):
            stem = node.module.split(".")[1:]  # type: ignore[union-attr]
            candidates = [".".join([*stem, alias.name]) for alias in node.names] + [".".join(stem)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name.split(".", 1)[1] for alias in node.names
                          if alias.name.startswith("pytest_attncost.")]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name and c}
    return found


def _room(name: str) -> str:
    return name.split(".")[0] or "__init__"


def test_every_module_has_a_floor() -> None:
    rooms = {_room(name) for name in _modules()}
    assert not rooms - set(FLOORS), f"give these modules a floor in FLOORS: {sorted(rooms - set(FLOORS))}"
    assert not set(FLOORS) - rooms, f"FLOORS names modules that no longer exist: {sorted(set(FLOORS) - rooms)}"


def test_imports_run_down_the_floors() -> None:
    modules = _modules()
    upward = [f"{name} (floor {FLOORS[_room(name)]}) imports {target} (floor {FLOORS[_room(target)]})"
              for name, path in modules.items() for target in _imports(name, path, modules)
              if FLOORS[_room(target)] > FLOORS[_room(name)]]
    assert not upward, "\n".join(upward)


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle through them
    graph = {name: {t for t in targets if not (t.startswith(name + ".") and name != "")}
             for name, targets in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join([*path[path.index(target):], target]))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_modules_and_functions_stay_small() -> None:
    big = []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            big.append(f"{name}: {len(lines)} lines (a module of more than {MAX_MODULE_LINES} has two jobs)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                body = lines[node.lineno - 1 : node.end_lineno]
                if length > MAX_FUNCTION_LINES and not any(line.strip().startswith(WHY_LONG) for line in body):
                    big.append(f"{name}.{node.name}: {length} lines, and no '{WHY_LONG}' comment says why")
    assert not big, "\n".join(big)


def test_the_guard_sees_an_upward_import(tmp_path: Path) -> None:
    """The reader finds relative, absolute and lazy imports (else the guard above could pass on nothing)."""
    modules = _modules()
    sample = tmp_path / "sample.py"
    sample.write_text("from . import api\nfrom .counting import jit\nimport pytest_attncost.plugin\n"
                      "def f():\n    from .reporting import Row\n")
    assert _imports("units", sample, modules) == {"api", "counting", "counting.jit", "plugin", "reporting"}
    nested = tmp_path / "__init__.py"
    nested.write_text("from ..errors import CountError\nfrom .jit import count_forward\n")
    assert _imports("counting", nested, modules) == {"errors", "counting.jit"}


def test_no_public_name_is_shadowed_by_a_submodule() -> None:
    # `import pytest_attncost.x` sets the package's attribute x to the module: a function of the same name
    # in __all__ (sweep, once) would then be a module after any import of it
    public = set(ast.literal_eval(next(
        node.value for node in ast.walk(ast.parse((PACKAGE / "__init__.py").read_text()))
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")))
    assert public and not public & {name.split(".")[0] for name in _modules()}


def test_sweep_is_the_function_after_every_submodule_is_imported() -> None:
    # in this process (a fresh one proves nothing more: importing a submodule sets the package's attribute
    # whenever it happens, and here every one of them is imported, again or for the first time)
    import importlib

    import pytest_attncost

    for name in _modules():
        if name != "__main__":
            importlib.import_module(f"pytest_attncost.{name}")
    found = [getattr(pytest_attncost, name) for name in ("sweep", "measure", "profile")]
    assert all(callable(f) and not hasattr(f, "__path__") and f.__module__ == "pytest_attncost.api"
               for f in found), found


#: Functions that may take more than five named parameters: the public signatures users call with keywords
#: (profile, measure, measure_memory and the fixture's twins, the formulas) and torch's own signatures that the
#: FlexAttention stand-ins mirror. A new wide function groups what travels together instead (request.Request).
MAX_WIDE_FUNCTIONS = 12
MAX_PARAMETERS = 5
#: Each vocabulary and the module that owns it: written once there, imported everywhere else (CAUSAL lives with
#: the formulas that count by it, as request.py imports formulas).
VOCABULARIES = {"COMPONENTS": "request", "PARTS": "request", "BACKENDS": "request", "MODES": "request",
                "CAUSAL": "formulas"}


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its named parameters: positional and keyword-only, not self/cls, not ``*args`` or ``**kwargs``."""
    args = node.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]


def _wide_functions(paths: dict[str, Path]) -> list[str]:
    return [f"{name}.{node.name} ({len(_parameters(node))}: {', '.join(_parameters(node))})"
            for name, path in paths.items() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(_parameters(node)) > MAX_PARAMETERS]


def _vocabularies() -> dict[str, tuple[str, ...]]:
    """The vocabularies, read from their owners' source: name -> its words, in order."""
    found: dict[str, tuple[str, ...]] = {}
    for owner in dict.fromkeys(VOCABULARIES.values()):
        for node in ast.parse((PACKAGE / f"{owner}.py").read_text()).body:
            name = getattr(node.targets[0], "id", "") if isinstance(node, ast.Assign) else ""
            if VOCABULARIES.get(name) == owner:
                found[name] = tuple(word for e in node.value.elts  # type: ignore[attr-defined]
                                    for word in (found[e.value.id] if isinstance(e, ast.Starred) else (e.value,)))
    return found


def _spells(words: list[str], vocabulary: tuple[str, ...]) -> bool:
    """All of the vocabulary's words and nothing else, or all of them in a row in its order (a header)."""
    k = len(vocabulary)
    return set(words) == set(vocabulary) or any(tuple(words[i : i + k]) == vocabulary for i in range(len(words)))


def _copies(paths: dict[str, Path], vocabularies: dict[str, tuple[str, ...]]) -> list[str]:
    """Literals outside its owner that spell a vocabulary out again (``__all__`` aside: the formulas
    ``attention_core`` ... are functions too)."""
    found = []
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        exported = {id(n.value) for n in ast.walk(tree)
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exported:
                words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                found += [f"{name}:{node.lineno} spells {vocabulary} again (import it from {VOCABULARIES[vocabulary]})"
                          for vocabulary, wanted in vocabularies.items()
                          if name != VOCABULARIES[vocabulary] and _spells(words, wanted)]
    return found


def test_few_functions_take_more_than_five_parameters() -> None:
    wide = _wide_functions(_modules())
    assert len(wide) <= MAX_WIDE_FUNCTIONS, (
        f"{len(wide)} functions take more than {MAX_PARAMETERS} named parameters (at most {MAX_WIDE_FUNCTIONS}):\n"
        + "\n".join(wide))


def test_each_vocabulary_is_written_once() -> None:
    vocabularies = _vocabularies()
    assert set(vocabularies) == set(VOCABULARIES), vocabularies
    copies = _copies(_modules(), vocabularies)
    assert not copies, "\n".join(copies)


def test_the_guards_see_a_wide_function_and_a_copied_vocabulary(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(self, a, b, c, d, e, *args, **kwargs): pass\n"
                      "def g(a, b, c, d, e, *, f): pass\n"
                      "SHOWN = ('torch', 'fvcore')\n"
                      "ROWS = ['test', 'attention_core', 'attention_proj', 'ffn', 'other']\n"
                      "NAMES = ('torch', 'fvcore', 'pytest')\n__all__ = ['attention_core', 'attention_proj', 'ffn']\n")
    assert _wide_functions({"sample": sample}) == ["sample.g (6: a, b, c, d, e, f)"]
    assert _vocabularies()["PARTS"] == ("attention_core", "attention_proj", "ffn", "other")
    copies = _copies({"sample": sample}, _vocabularies())
    assert copies == ["sample:3 spells BACKENDS again (import it from request)",
                      "sample:4 spells COMPONENTS again (import it from request)",
                      "sample:4 spells PARTS again (import it from request)"]
    assert _copies({"request": sample}, _vocabularies()) == []  # the owner spells its own
