"""Nothing this plugin writes itself is a pickle; everything it loads is loaded weights-only.

Recover checkpoints are DCP directories: DCP's ``.metadata`` and the checkpoint's
non-tensor state are pickles written by torch.distributed.checkpoint (documented in the
README's security note); everything else is JSON, safetensors or plain text. Every
``torch.load`` of the package passes ``weights_only=True`` (AST check, with an explicit
allowlist of documented exceptions, empty), no loading call passes ``weights_only=False``,
and auto-resume asks its CheckpointIO for a weights-only load (checked at run time).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from safetensors import safe_open

from areal_lightning import HFSaverCallback, RecoverCallback
from tests.conftest import LMModule, make_trainer, tiny_llama, token_loader

PACKAGE = Path(__file__).resolve().parents[1] / "areal_lightning"
PICKLE_OR_ZIP = (b"\x80", b"PK\x03\x04")


def test_no_pickle_outside_dcp_files(tmp_path, tokenizer) -> None:
    common = dict(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=2)
    make_trainer([HFSaverCallback(mode="async", **common), RecoverCallback(**common)], max_epochs=1).fit(
        LMModule(tiny_llama(), tokenizer=tokenizer), token_loader(n_batches=4))
    trial = tmp_path / "checkpoints" / "u" / "e" / "t"
    checked = 0
    for path in sorted(p for p in trial.rglob("*") if p.is_file()):
        if path.parent.name == "recover_checkpoint":
            continue  # DCP's own format (see the module doc)
        head = path.read_bytes()[:4]
        assert not head.startswith(PICKLE_OR_ZIP), path
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                assert list(f.keys())
        elif path.name == ".lock":
            assert path.read_text().strip().isdigit()
        else:
            raise AssertionError(f"unexpected file written: {path}")
        checked += 1
    assert checked >= 6 + 2 * 4  # recover_info + two exports (config, generation config, weights, tokenizer)


# torch.load call sites allowed to pass anything but ``weights_only=True``, as
# {(file relative to the package, enclosing function): why}. Every entry must be documented
# in the README's security note. Empty: every torch.load of the package is weights-only.
WEIGHTS_ONLY_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("write/dcp_reader.py", "_load_trusted"): "reached only when the caller explicitly passes "
    "weights_only=False (RecoverCallback(weights_only=False) / load_checkpoint(weights_only=False)) for trusted storage",
}


class _TorchLoadFinder(ast.NodeVisitor):
    """Calls of ``torch.load`` however it is spelled (``torch.load``, ``import torch as t; t.load``,
    ``torch.serialization.load``, ``from torch import load``), with their enclosing function."""

    def __init__(self) -> None:
        self.torch_names = {"torch"}
        self.load_names: set[str] = set()
        self.scope: list[str] = []
        self.calls: list[tuple[str, int, ast.Call]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch":
                self.torch_names.add(alias.asname or "torch")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in ("torch", "torch.serialization"):
            for alias in node.names:
                if alias.name == "load":
                    self.load_names.add(alias.asname or "load")

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _is_torch(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.torch_names
        return (isinstance(node, ast.Attribute) and node.attr == "serialization"
                and isinstance(node.value, ast.Name) and node.value.id in self.torch_names)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if ((isinstance(func, ast.Attribute) and func.attr == "load" and self._is_torch(func.value))
                or (isinstance(func, ast.Name) and func.id in self.load_names)):
            self.calls.append((".".join(self.scope) or "<module>", node.lineno, node))
        self.generic_visit(node)


def torch_load_calls() -> list[tuple[str, str, int, ast.Call]]:
    """(file, enclosing function, line, call) of every torch.load call in the package."""
    out = []
    for source in sorted(PACKAGE.rglob("*.py")):
        finder = _TorchLoadFinder()
        finder.visit(ast.parse(source.read_text()))
        out += [(str(source.relative_to(PACKAGE)), scope, line, call) for scope, line, call in finder.calls]
    return out


def test_every_torch_load_passes_weights_only_true() -> None:
    """Every torch.load of the package passes the literal ``weights_only=True`` (no variable, no
    ``**kwargs``, no default), except the documented call sites of WEIGHTS_ONLY_EXCEPTIONS."""
    calls = torch_load_calls()
    assert calls, "expected torch.load calls in the engine"
    bad = []
    for rel, scope, line, call in calls:
        if (rel, scope) in WEIGHTS_ONLY_EXCEPTIONS:
            continue
        value = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
        if value is None:
            bad.append(f"{rel}:{line} ({scope}): torch.load without weights_only")
        elif not (isinstance(value, ast.Constant) and value.value is True):
            bad.append(f"{rel}:{line} ({scope}): weights_only={ast.unparse(value)} (must be True)")
    assert not bad, "torch.load calls that are not weights-only:\n" + "\n".join(bad)
    stale = set(WEIGHTS_ONLY_EXCEPTIONS) - {(rel, scope) for rel, scope, _, _ in calls}
    assert not stale, f"WEIGHTS_ONLY_EXCEPTIONS names call sites that no longer exist: {sorted(stale)}"


def test_the_torch_load_finder_sees_every_spelling() -> None:
    code = ("import torch\nimport torch as th\nfrom torch import load\nfrom torch.serialization import load as ld\n"
            "def f(b, kw):\n    torch.load(b, weights_only=True)\n    th.load(b)\n    load(b, **kw)\n"
            "    torch.serialization.load(b, weights_only=False)\n    ld(b)\n    other.load(b)\n")
    finder = _TorchLoadFinder()
    finder.visit(ast.parse(code))
    assert [(scope, line) for scope, line, _ in finder.calls] == [("f", 6), ("f", 7), ("f", 8), ("f", 9), ("f", 10)]


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def test_no_load_passes_weights_only_false() -> None:
    """No loading call of the package (callee named ``*load*`` or ``*resume*``: a CheckpointIO's
    ``load_checkpoint``, the engine's ``load``, Lightning's ``resume_start``, ...) passes
    ``weights_only=False`` as a keyword. (``dump_checkpoint(weights_only=False)`` means "with the
    optimizer state", not unpickling: it is not a load.) Positional arguments are checked at
    run time by the next test."""
    bad = []
    for source in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(source.read_text())
        rel = str(source.relative_to(PACKAGE))
        allowed = [range(f.lineno, (f.end_lineno or f.lineno) + 1) for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, f.name) in WEIGHTS_ONLY_EXCEPTIONS]
        for node in ast.walk(tree):
            if any(node_line in r for r in allowed for node_line in [getattr(node, "lineno", -1)]):
                continue
            if isinstance(node, ast.Call) and any(w in _callee(node).lower() for w in ("load", "resume")):
                for k in node.keywords:
                    if k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is False:
                        bad.append(f"{source.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)[:120]}")
    assert not bad, "calls passing weights_only=False:\n" + "\n".join(bad)


def test_auto_resume_loads_its_own_checkpoint_weights_only(tmp_path) -> None:
    """At run time: RecoverCallback's auto-resume asks the CheckpointIO for a weights-only load."""
    from areal_lightning import DCPCheckpointIO

    seen = []

    class Recording(DCPCheckpointIO):
        def load_checkpoint(self, path, map_location=None, weights_only=None):
            seen.append(weights_only)
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    common = dict(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=2)
    make_trainer([RecoverCallback(**common)], plugins=[Recording()], max_epochs=1).fit(
        LMModule(tiny_llama()), token_loader(n_batches=4))
    assert seen == []
    make_trainer([RecoverCallback(**common)], plugins=[Recording()], max_epochs=2).fit(
        LMModule(tiny_llama()), token_loader(n_batches=4))
    assert seen == [True], f"auto-resume loaded its checkpoint with weights_only={seen}"
