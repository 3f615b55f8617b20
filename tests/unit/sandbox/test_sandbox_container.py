"""Container engines (docker, podman, apptainer): the same task contract as LocalSandbox, and on docker and podman
the same rewards as the local backend for the same tasks, built on the same local Debian base where this host can
build it (no registry needed; `make test-podman`). Skipped, with the reason, where an engine is missing or cannot
run containers."""

from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.sandbox import SandboxLimits
from rl.sandbox.container import ENGINES, engine_problem, make_container_backend
from rl.sandbox.image import build_problem
from rl.sandbox.local import LocalBackend
from tests.unit.envs.test_envs_images import TB2_UVX, built_task

REPO = Path(__file__).resolve().parents[3]


def _backend(engine):
    problem = engine_problem(engine)
    if problem:
        pytest.skip(f"{engine}: {problem}")
    return make_container_backend(engine, SandboxLimits(command_timeout_s=60), local_base=build_problem() is None)


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_the_same_tasks_give_the_same_rewards_as_the_local_backend(engine, tmp_path):
    """A bundled task (the host's system stands in locally), a task that must be built (apt, pip, files outside
    /app) and a verifier that fetches uv: untouched and solved, the engine's reward is the local backend's."""
    backend = _backend(engine)
    if not backend.local_base:
        pytest.skip(f"no local base to build on: {build_problem()}")
    tasks = [REPO / "examples" / "tasks" / "python-csv-report", built_task(tmp_path / "built")]
    uvx = built_task(tmp_path / "uvx", dockerfile="FROM ubuntu:24.04\nWORKDIR /opt/project\nCOPY data data\n")
    (uvx / "tests" / "test.sh").write_text(TB2_UVX)
    (uvx / "solution" / "solve.sh").write_text(
        "#!/bin/bash\npython3 -c \"import json; print(sum(i['n'] for i in json.load(open('data/items.json'))))\" "
        "> answer.txt\n")
    (uvx / "tests" / "test_outputs.py").write_text(
        "import json\nfrom pathlib import Path\n\n\ndef test_answer():\n"
        "    items = json.loads(Path('data/items.json').read_text())\n"
        "    assert Path('answer.txt').read_text().strip() == str(sum(i['n'] for i in items))\n")
    local = LocalBackend()
    for task_dir in tasks + [uvx]:
        task = load_harbor_task(task_dir)
        for oracle in (False, True):
            mine = check_task(task, local, oracle=oracle, log=lambda s: None).reward
            theirs = check_task(task, backend, oracle=oracle, log=lambda s: None)
            assert theirs.reward == mine == float(oracle), (task_dir.name, oracle, theirs.output[-2000:])


@pytest.mark.parametrize("engine", ENGINES)
def test_task_untouched_zero_oracle_one(engine):
    backend = _backend(engine)
    task = load_harbor_task(REPO / "examples" / "tasks" / "python-lru-cache-bug")
    assert check_task(task, backend, oracle=False, log=lambda s: None).reward == 0.0
    assert check_task(task, backend, oracle=True, log=lambda s: None).reward == 1.0


@pytest.mark.parametrize("engine", ENGINES)
def test_container_has_no_network_and_kills_on_timeout(engine):
    backend = _backend(engine)
    with backend.create(None) as sbx:
        res = sbx.exec("python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 80))\"")
        assert res.exit_code != 0
        res = sbx.exec("trap '' TERM; while :; do :; done", timeout=2)
        assert res.timed_out
        assert sbx.exec("echo alive").output == "alive\n"
