"""The package's layering, checked on its source (README "How it works" and "Architecture").

A checkpoint flows one way: trigger -> capture -> stage -> write -> commit. Each stage folder
imports only the foundation modules beside the stages, its own folder and the stages before it;
``hf_export.py`` composes the stages, ``lightning/`` (the glue) sits above them and ``tools/``
on top. Imports are read at every depth (inside functions too, and the lazy re-exports of
``areal_lightning/__init__.py``, which name their modules in a table of strings, and
``importlib.import_module`` calls); ``if TYPE_CHECKING:``
blocks are not imports at run time. No import cycle at any depth. A private name of torch,
Lightning, transformers or peft (or of the standard library) is spelled only in the two adapter
modules, attribute accesses, imports and strings (``getattr(x, "_name")``) alike.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_internals import _defined_names

PACKAGE = Path(__file__).resolve().parents[1] / "areal_lightning"

FOUNDATION = ("errors", "version", "namespaces", "_torch_internals", "_fault", "objectstore", "layout", "telemetry",
              "config", "collective")
"""Modules beside the stages that any stage may use (they import no stage)."""
STAGES = ("trigger", "capture", "stage", "write", "commit")
ABOVE = ("hf_export", "lightning", "tools")
ADAPTERS = ("lightning/_internals.py", "_torch_internals.py")


def layer(module: str) -> int:
    """0: foundation; 1-5: the stages in flow order; 6: hf_export; 7: lightning/; 8: tools/ and the
    package's entry points (``__init__``, ``__main__``)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "__main__":
        return 8
    head = parts[0]
    if head in FOUNDATION:
        return 0
    if head in STAGES:
        return 1 + STAGES.index(head)
    if head in ABOVE:
        return 6 + ABOVE.index(head)
    raise AssertionError(f"areal_lightning.{head}: a module the layering does not place; add it to test_layers.py")


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("areal_lightning",) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The package modules ``name`` imports at run time, at any depth: (module, line)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_blocks(tree)
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            targets = [node.args[0].value]  # importlib.import_module("areal_lightning.x")
        elif isinstance(node, ast.Dict):  # a lazy re-export table {name: "areal_lightning.x"}
            targets = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        found += [(t, node.lineno) for t in targets if t in known and t != name]
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    return [f"{name}:{line} imports {target} (layer {layer(target)} > {layer(name)})"
            for name, edges in sorted(graph.items()) for target, line in edges if layer(target) > layer(name)]


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted({t for t, _ in graph[start]})))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({t for t, _ in graph[child]}))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_is_placed_and_the_stages_import_only_downward() -> None:
    graph = import_graph()
    assert graph, "no modules found"
    offenders = layer_violations(graph)
    assert not offenders, "imports against the stage order (foundation < trigger < capture < stage < write < " \
                          "commit < hf_export < lightning < tools):\n" + "\n".join(offenders)


def test_no_import_cycle_at_any_depth() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks themselves, on a made-up package: a stage importing a later stage inside a
    function, a cycle through a function-level import, a lazy import named in a string."""
    pkg = tmp_path / "areal_lightning"
    for folder in ("", "capture", "commit", "lightning"):
        (pkg / folder).mkdir(parents=True, exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "capture" / "a.py").write_text("def f():\n    from areal_lightning.commit import b\n")
    (pkg / "commit" / "b.py").write_text("from areal_lightning.capture.a import f\n")
    (pkg / "lightning" / "c.py").write_text("import importlib\nM = importlib.import_module('areal_lightning.lightning.d')\n")
    (pkg / "lightning" / "d.py").write_text("from . import c\n")
    graph = import_graph(pkg)
    assert layer_violations(graph) == [
        "areal_lightning.capture.a:2 imports areal_lightning.commit (layer 5 > 2)",
        "areal_lightning.capture.a:2 imports areal_lightning.commit.b (layer 5 > 2)"]
    assert sorted(cycles(graph)) == [["areal_lightning.capture.a", "areal_lightning.commit.b"],
                                     ["areal_lightning.lightning.c", "areal_lightning.lightning.d"]]


# -- private names of other libraries, strings included ------------------------------------------

# A name in a string that looks private but is a documented public API.
DOCUMENTED = {"_fields"}  # collections.namedtuple's field names (documented as public)
_PRIVATE_IN_STRING = re.compile(r"(?<![A-Za-z0-9_.\-/{])_[A-Za-z][A-Za-z0-9_]*")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
        # an attribute docstring: a string statement right after an assignment
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) \
                        and isinstance(after.value, ast.Constant):
                    found.add(id(after.value))
    return found


def own_names(trees: dict[Path, ast.AST]) -> set[str]:
    """What the package defines itself (test_internals' guard: functions, classes, variables,
    arguments, attributes set on its own objects) and its module names; ``_areal*`` attributes
    are its marks on others' objects."""
    return _defined_names(trees) | {path.stem for path in trees}


def private_strings(trees: dict[Path, ast.AST], root: Path = PACKAGE) -> list[str]:
    """Private names of other libraries spelled in strings (not docstrings) outside the adapters."""
    own = own_names(trees)
    offenders = []
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        if rel in ADAPTERS:
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for name in _PRIVATE_IN_STRING.findall(node.value):
                    if name not in own and not name.startswith("_areal") and name not in DOCUMENTED:
                        offenders.append(f"{rel}:{node.lineno}: {name!r}")
    return offenders


def test_no_private_name_of_another_library_in_a_string_outside_the_adapters() -> None:
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    offenders = private_strings(trees)
    assert not offenders, "private names in strings outside lightning/_internals.py and _torch_internals.py " \
                          "(move the access into an adapter):\n" + "\n".join(offenders)


@pytest.mark.parametrize("code", [
    "def f(m):\n    return getattr(m, '_fsdp_wrapped_module', m)\n",
    "def f(m):\n    return hasattr(m, '_hf_peft_config_loaded')\n",
    "import warnings\ndef f():\n    getattr(warnings, '_filters_mutated')()\n",
])
def test_the_string_check_catches_a_private_name_in_getattr(code: str, tmp_path: Path) -> None:
    path = tmp_path / "areal_lightning" / "capture" / "x.py"
    assert private_strings({path: ast.parse(code)}, tmp_path / "areal_lightning")


# -- every error a user can see is an AreaLightningError ------------------------------------------

# Raises of built-in exceptions that stay built-in, and why (none reaches a user as such).
BUILTIN_RAISES = {
    ("__init__.py", "AttributeError"): "the module __getattr__ protocol of the lazy re-exports",
    ("tools/certify/__init__.py", "AttributeError"): "the module __getattr__ protocol",
    ("tools/demo/__init__.py", "AttributeError"): "the module __getattr__ protocol",
    ("capture/loader.py", "ValueError"): "remap_position: caught by RecoverState and raised as RecoverMismatchError",
    ("capture/optimizer_names.py", "ValueError"): "by_index: caught by the session, raised as RecoverMismatchError",
    ("capture/loader.py", "RuntimeError"): "an internal invariant (a position asked for before the first batch)",
    ("commit/atomic.py", "ValueError"): "AtomicDir's invariants on names the package builds itself",
    ("config.py", "ValueError"): "parse_signals: caught three lines below and raised as ConfigError",
    ("tools/losses.py", "ValueError"): "read_losses: caught by certify and reported in its table",
    ("tools/losses.py", "AttributeError"): "the module __getattr__ protocol",
    ("namespaces.py", "ImportError"): "neither lightning.pytorch nor pytorch_lightning is installed (an install error)",
    ("write/process.py", "EOFError"): "the checkpoint process's pipe closed: caught and raised as CheckpointWriteError",
    ("write/raw.py", "ValueError"): "tensor_bytes' precondition (the package stages to contiguous CPU tensors first)",
}


def builtin_raises(trees: dict[Path, ast.AST], root: Path = PACKAGE) -> list[tuple[str, str, int]]:
    import builtins

    names = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
             and issubclass(getattr(builtins, n), BaseException)}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in names:
                    found.append((path.relative_to(root).as_posix(), exc.id, node.lineno))
    return found


def test_every_error_a_user_can_see_is_an_area_lightning_error() -> None:
    """``errors.py`` promises one base class: a raise of a built-in exception is either one of the
    listed internal ones or a defect (use ConfigError, UsageError, CheckpointNotFoundError, ...)."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    offenders = [f"{rel}:{line}: raise {name}" for rel, name, line in builtin_raises(trees)
                 if (rel, name) not in BUILTIN_RAISES]
    assert not offenders, "built-in exceptions raised outside AreaLightningError:\n" + "\n".join(offenders)


def test_the_raise_check_catches_a_builtin_raise(tmp_path: Path) -> None:
    path = tmp_path / "areal_lightning" / "write" / "x.py"
    tree = ast.parse("def f(x):\n    if x:\n        raise ValueError('bad x')\n")
    assert builtin_raises({path: tree}, tmp_path / "areal_lightning") == [("write/x.py", "ValueError", 3)]
