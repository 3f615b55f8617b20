"""What the hostile-task tests share: a task folder made from an attack (its solution is the attack, its verifier is
honest), a backend that remembers its sandboxes, and a run of the attack through `check_task --oracle` or through an
episode (the rollout path) that checks the host is unchanged afterwards."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

from megatron_composer.data.chat_template import format_tool_call
from rl.envs.agent import ScriptedPolicy, run_episode
from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import prepare_task
from rl.sandbox import SandboxLimits
from rl.sandbox.base import process_tree
from rl.sandbox.limits import find_cgroup_parents
from rl.sandbox.local import LocalBackend

# The verifier of every attack task: reward 1 exactly when the attack left its mark.
PWNED_VERIFIER = "#!/bin/bash\nif [ -e /app/pwned ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
LIMITS = SandboxLimits(command_timeout_s=30, cpu_time_s=30, memory_mb=256, max_processes=64, max_file_mb=64,
                       disk_mb=64, max_files=3000, max_output_bytes=64 * 1024)


class RecordingBackend(LocalBackend):
    """LocalBackend that remembers its sandboxes' names, so that their leftovers (cgroups) can be looked for."""

    def _make(self, *args, **kwargs):
        sandbox = super()._make(*args, **kwargs)
        self.__dict__.setdefault("made", []).append(sandbox.root.name)
        return sandbox


def make_task(tmp_path: Path, name: str, solve: str, verifier: str = PWNED_VERIFIER, toml: str = "",
              dockerfile: str = "FROM ubuntu:24.04\nWORKDIR /app\n") -> Path:
    task = tmp_path / name
    for d in ("environment", "tests", "solution"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text(f"Hostile task {name}.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 30.0\n'
                                    + toml)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(verifier)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    return task


def host_state(backend: LocalBackend, watched: list[Path]) -> dict:
    """What an attack must not change: watched files, and nothing of any sandbox left on the host."""
    root = backend.root_parent
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
              if line.split()[1].startswith(root)]
    made = backend.__dict__.get("made", [])
    parents = find_cgroup_parents()
    cgroups = [str(base / name) for base in ((parents.memory, parents.pids) if parents else ()) for name in made
               if (base / name).exists()]
    # every process a sandbox runs descends from this one (its launchers, keepers, verifier namespaces' holders)
    procs = []
    for pid in process_tree(os.getpid()):
        try:
            if pid != os.getpid() and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                procs.append(str(pid))
        except OSError:
            pass
    return {"files": {str(p): p.read_bytes() if p.is_file() else None for p in watched},
            "sandbox dirs": sorted(os.listdir(root)), "mounts": mounts, "cgroups": cgroups, "processes": procs}


def run_attack(task_dir: Path, backend: LocalBackend, watched: list[Path] = (), episode: bool = False) -> float:
    """The task's reward when its solution is the attack: played as `check_task --oracle` does (solve.sh), or
    (episode) by a scripted agent that sends solve.sh through the `run` tool; the host must be unchanged."""
    return run_solution(task_dir, backend, watched, episode).reward


def run_solution(task_dir: Path, backend: LocalBackend, watched: list[Path] = (), episode: bool = False,
                 before_verifier=None):
    """The VerifyResult of run_attack's run. `before_verifier(sandbox)` runs between the agent and the verifier
    (episodes only)."""
    before = host_state(backend, list(watched))
    task = load_harbor_task(task_dir)
    if episode:
        snapshot = prepare_task(task, backend)
        try:
            with backend.fork(snapshot) as sbx:
                turns = [format_tool_call("run", {"command": task.solution.as_commands()[0]})
                         + format_tool_call("submit", {})]
                if before_verifier is not None:
                    run_episode(task, sbx, ScriptedPolicy(turns), verify=False)
                    before_verifier(sbx)
                    result = type("Episode", (), {"verify": task.verifier.verify(sbx, task)})
                else:
                    result = run_episode(task, sbx, ScriptedPolicy(turns))
        finally:
            snapshot.discard()
    else:
        result = check_task(task, backend, oracle=True, log=lambda s: None)
    clean = {"files": before["files"], "sandbox dirs": [], "mounts": [], "cgroups": [],
             "processes": before["processes"]}
    for _ in range(50):  # killed processes may take a moment to be reaped
        after = host_state(backend, list(watched))
        if after == clean:
            break
        time.sleep(0.1)
    assert after == clean, "the host changed"
    return result.verify if episode else result
