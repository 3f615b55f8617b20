"""Where a test file lives, by one rule (docs/ARCHITECTURE.md, "Tests"):
- tests/e2e/: files whose every test is a long end-to-end run (marked e2e; `make test-e2e`);
- tests/distributed/: files that launch several processes (torchrun + gloo; their worker scripts in
  tests/distributed/workers/);
- tests/unit/<room>/: the rest, one process each, in the room of the code they test;
- tests/vllm_backend/: the tests that need vLLM (their own environment, `make test-vllm`).
Shared fixtures and assets stay at the top of tests/."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
ROOMS = {"benchmarks", "checkpoint", "data", "envs", "fp8", "house", "inference", "kernels", "model", "parallel",
         "pretrain", "rl", "sandbox", "tools", "training", "weight_sync"}
LAUNCHERS = ("torch.distributed.run", "torchrun")


def _is_e2e(decorators: list[ast.expr]) -> bool:
    return any("e2e" in ast.unparse(d) for d in decorators)


def _tests(tree: ast.Module) -> list[bool]:
    """Whether each test function of the module is marked e2e (a module-level pytestmark marks them all)."""
    module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "e2e" in ast.unparse(n.value) for n in tree.body)
    return [module_mark or _is_e2e(n.decorator_list) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")]


def _launches(tree: ast.Module) -> bool:
    """Imports the torchrun helper (tests/distributed/torchrun.py) or builds a command line that runs torchrun."""
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tests.distributed"):
            return True
        if isinstance(n, ast.List) and any(isinstance(e, ast.Constant) and e.value in LAUNCHERS for e in n.elts):
            return True
    return False


def misplaced(tests_dir: Path) -> list[str]:
    bad = []
    for path in sorted(tests_dir.rglob("test_*.py")):
        rel = path.relative_to(tests_dir)
        where = rel.parts[0]
        if where == "vllm_backend":
            continue
        tree = ast.parse(path.read_text())
        marks, launches = _tests(tree), _launches(tree)
        all_e2e = bool(marks) and all(marks)
        if where == "e2e":
            if not all_e2e:
                bad.append(f"{rel}: in e2e/ but has tests not marked e2e")
        elif all_e2e:
            bad.append(f"{rel}: every test is marked e2e; it belongs in tests/e2e/")
        elif where == "distributed":
            if not launches:
                bad.append(f"{rel}: in distributed/ but launches no processes; it belongs in tests/unit/<room>/")
        elif where == "unit" and len(rel.parts) == 3 and rel.parts[1] in ROOMS:
            if launches:
                bad.append(f"{rel}: launches processes; it belongs in tests/distributed/")
        else:
            bad.append(f"{rel}: not in tests/unit/<room>/ (rooms: {sorted(ROOMS)}), tests/distributed/ or tests/e2e/")
    return bad


def test_every_test_file_is_where_the_rule_puts_it():
    assert not misplaced(TESTS), misplaced(TESTS)


def test_the_rule_sees_a_misplaced_file(tmp_path):
    (tmp_path / "unit" / "model").mkdir(parents=True)
    (tmp_path / "distributed").mkdir()
    (tmp_path / "test_flat.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "unit" / "model" / "test_launch.py").write_text(
        "from tests.distributed.torchrun import run_worker\n\ndef test_a():\n    pass\n")
    (tmp_path / "unit" / "model" / "test_long.py").write_text(
        "import pytest\n\n@pytest.mark.e2e\ndef test_a():\n    pass\n")
    (tmp_path / "distributed" / "test_one.py").write_text("def test_a():\n    pass\n")
    bad = misplaced(tmp_path)
    assert len(bad) == 4 and all(any(b.startswith(f) for b in bad) for f in (
        "test_flat.py", "unit/model/test_launch.py", "unit/model/test_long.py", "distributed/test_one.py"))
