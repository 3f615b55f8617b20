"""Container engines (docker, podman, apptainer): the same task contract as LocalSandbox. Skipped, with the
reason, where an engine is missing or cannot run containers."""

from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.sandbox import SandboxLimits
from rl.sandbox.container import ENGINES, engine_problem, make_container_backend

REPO = Path(__file__).resolve().parents[3]


def _backend(engine):
    problem = engine_problem(engine)
    if problem:
        pytest.skip(f"{engine}: {problem}")
    return make_container_backend(engine, SandboxLimits(command_timeout_s=60))


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
