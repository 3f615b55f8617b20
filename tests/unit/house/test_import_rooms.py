"""The rooms' import rules, read from the source with ast (every import, also those inside functions):
the library imports neither phase, pretraining and RL do not import each other, and no module imports
itself through a chain of others."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("megatron_composer", "pretrain", "rl")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _from_module(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module a `from X import ...` in module `name` (file `path`) reads from."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tree's modules that `name` imports: `from a.b import c` names a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, name, path)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_pretraining_and_rl_do_not_import_each_other_and_the_library_imports_neither():
    bad = []
    for name, deps in _graph().items():
        room = name.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if (room, other) in (("pretrain", "rl"), ("rl", "pretrain"), ("megatron_composer", "pretrain"),
                                 ("megatron_composer", "rl")):
                bad.append(f"{name} -> {dep}")
    assert not bad, bad


def test_no_import_cycle():
    graph = _graph()
    # Tarjan's strongly connected components; a component of more than one module is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_a_cycle_and_a_crossing(tmp_path, monkeypatch):
    """The two rules above fail on a tree that breaks them (so they can fail)."""
    for pkg, body in (("pretrain", "from rl import b\n"), ("rl", "import pretrain.a\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / ("a.py" if pkg == "pretrain" else "b.py")).write_text(body)
    (tmp_path / "megatron_composer").mkdir()
    (tmp_path / "megatron_composer" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = _graph()
    assert graph["pretrain.a"] == {"rl.b"} and graph["rl.b"] == {"pretrain.a"}
    import pytest

    with pytest.raises(AssertionError):
        test_no_import_cycle()
    with pytest.raises(AssertionError):
        test_pretraining_and_rl_do_not_import_each_other_and_the_library_imports_neither()


def test_the_model_imports_no_cpu_only_kernel_module():
    """The model calls device-neutral kernel entry points (megatron_composer/kernels/<name>.py); the C++ CPU
    kernels and their loader (megatron_composer/kernels/cpu) are theirs to pick."""
    bad = [f"{name} -> {dep}" for name, deps in _graph().items() if name.startswith("megatron_composer.model")
           for dep in deps if dep.startswith("megatron_composer.kernels.cpu")]
    assert not bad, bad


def _private_imports() -> list[str]:
    """`from our.module import _name` across modules (within one module it is no import)."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_module(node, name, path)
            if base in modules and base != name:
                bad += [f"{name} imports {base}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def _entry_modules() -> set[str]:
    """Command-line programs in the packages: modules with an `if __name__ == "__main__":` block."""
    return {name for name, path in _modules().items() if '__name__ == "__main__"' in path.read_text()}


def test_no_private_name_is_imported_from_another_module():
    bad = _private_imports()
    assert not bad, bad


def test_library_code_does_not_import_command_line_programs():
    entries = _entry_modules()
    bad = [f"{name} -> {dep}" for name, deps in _graph().items() for dep in deps if dep in entries]
    assert not bad, bad


# Rooms of rl/ that everything else builds on: they import nothing else of rl/ (the sandbox runs commands and
# knows no task format; weight sync moves tensors and knows no trainer or rollout).
RL_FOUNDATIONS = ("rl.sandbox", "rl.weight_sync")


def _upward_imports() -> list[str]:
    bad = []
    for name, deps in _graph().items():
        room = next((r for r in RL_FOUNDATIONS if name == r or name.startswith(r + ".")), None)
        if room is None:
            continue
        bad += [f"{name} -> {dep}" for dep in deps
                if dep.startswith("rl.") and not (dep == room or dep.startswith(room + "."))]
    return bad


def test_sandbox_and_weight_sync_import_nothing_above_them():
    bad = _upward_imports()
    assert not bad, bad


def _reach(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


# rl/rollout by job, lowest first: a module imports only modules of rl/rollout in layers below its own.
ROLLOUT_LAYERS = (
    ("rl.rollout", "rl.rollout.config", "rl.rollout.tasks", "rl.rollout.records"),  # schema, task kinds, records
    ("rl.rollout.engines", "rl.rollout.episodes"),  # the engine and its ranks; the episodes of a group
    ("rl.rollout.worker",),  # the claim loop
    ("rl.rollout.launch",),  # how workers run: the one place that chooses
)
ROLLOUT_MACHINERY = {name for layer in ROLLOUT_LAYERS[1:] for name in layer}


def test_config_schemas_reach_no_engine_and_no_rollout_machinery():
    """rl.config and the rollout schema are read before any work (checks, --help, the dry run): through no chain
    of imports do they load the inference engines or the rollout worker."""
    graph = _graph()
    bad = [f"{schema} reaches {dep}" for schema in ("rl.config", "rl.rollout.config") for dep in _reach(graph, schema)
           if dep.startswith("megatron_composer.inference") or dep in ROLLOUT_MACHINERY]
    bad += [f"rl.rollout.config reaches {dep}" for dep in _reach(graph, "rl.rollout.config")
            if dep.startswith(("megatron_composer.model", "rl.rollout."))]
    assert not bad, bad


def test_rollout_modules_import_only_lower_layers():
    graph = _graph()
    layer = {name: i for i, names in enumerate(ROLLOUT_LAYERS) for name in names}
    mine = [name for name in graph if name == "rl.rollout" or name.startswith("rl.rollout.")]
    bad = [f"{name} has no layer in ROLLOUT_LAYERS" for name in mine if name not in layer]
    bad += [f"{name} -> {dep}" for name in mine if name in layer for dep in graph[name]
            if dep in layer and layer[dep] >= layer[name]]
    assert not bad, bad


def test_trainer_and_launch_run_workers_only_through_the_rollout_launch():
    """How a worker runs is chosen in rl/rollout/launch.py: the trainer (its in-process workers) and the roles'
    launch import no worker, engine or episode module themselves."""
    graph = _graph()
    bad = [f"{name} -> {dep}" for name in ("rl.trainer", "rl.launch") for dep in graph[name]
           if dep in ROLLOUT_MACHINERY - {"rl.rollout.launch"}]
    assert not bad, bad


def test_command_line_programs_live_outside_the_library_packages():
    """A program's argument parsing is in tools/ (or the root entrypoints); the packages keep what it calls."""
    entries = sorted(_entry_modules())
    assert not entries, entries


def test_the_library_packages_import_no_tool():
    """tools/ holds programs and generators (the task family); the packages never import them."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{name} -> {m}" for m in mods if m == "tools" or m.startswith("tools.")]
    assert not bad, bad
