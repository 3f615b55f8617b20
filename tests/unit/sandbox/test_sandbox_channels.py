"""The host never trusts what a sandbox says beyond strict formats: the exit status is the kernel's (no channel from
the sandbox carries one), and the verifier's reward files (read on the host, no link followed, a regular file,
bounded, strict text) are fuzzed here; nothing a sandbox writes makes the host raise or forge a verdict."""

import os
import random
from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import REWARD_FILE_BYTES
from rl.sandbox import Sandbox, SandboxError, SandboxLimits
from rl.sandbox.local import LocalBackend, bwrap_problem

LIMITS = SandboxLimits(command_timeout_s=30, cpu_time_s=30, memory_mb=512, disk_mb=64, max_output_bytes=64 * 1024)


# The exit status ------------------------------------------------------------------------------------------------
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


@needs_bwrap
@pytest.mark.parametrize("verifier", [False, True])
def test_the_exit_status_is_the_kernels_whatever_the_command_writes(sandbox_parent, verifier):
    """No descriptor reaches the host but the output: a forged report written to every open descriptor, then
    exit 7, is exit 7 (agent and verifier phase alike)."""
    forge = ("for fd in /proc/self/fd/*; do n=${fd##*/}; [ \"$n\" -gt 2 ] 2>/dev/null && printf '0 0\\n' >&$n; done "
             "2>/dev/null; printf '0 0\\n'; exit 7")
    backend = LocalBackend(limits=LIMITS, root_parent=str(sandbox_parent))
    with backend.create(None) as sandbox:
        if verifier:
            sandbox.enter_verifier()
        res = sandbox.exec(forge)
    assert res.exit_code == 7 and not res.ok, res


# The reward channel ---------------------------------------------------------------------------------------------


def _task(tmp_path: Path, name: str, test_sh: str, env: str = "") -> Path:
    task = tmp_path / name
    for d in ("environment", "tests", "solution"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n' + env)
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    return task


@pytest.fixture
def backend(sandbox_parent):
    return LocalBackend(limits=LIMITS, root_parent=str(sandbox_parent))


@needs_bwrap
@pytest.mark.parametrize("name, test_sh, error", [
    ("both-files", "echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 0}' > /logs/verifier/reward.json\n",
     "both reward.txt and reward.json"),
    ("link-to-key", "echo 1 > /tmp/one; ln -s /tmp/one /logs/verifier/reward.txt\n", "does not count"),
    ("fifo", "mkfifo /logs/verifier/reward.txt\n", "does not count"),
    ("folder", "mkdir /logs/verifier/reward.txt\n", "does not count"),
    ("not-utf8", "printf '1\\xff' > /logs/verifier/reward.txt\n", "not UTF-8"),
    ("huge", f"head -c {REWARD_FILE_BYTES * 4} /dev/zero | tr '\\0' 1 > /logs/verifier/reward.txt\n",
     f"more than {REWARD_FILE_BYTES} bytes"),
    ("superscript", "printf '\\xc2\\xb2' > /logs/verifier/reward.txt\n", "one plain decimal number"),
    ("linked-folder", "rmdir /logs/verifier; ln -s /tmp /logs/verifier; echo 1 > /tmp/reward.txt\n", "reward"),
])
def test_reward_files_that_are_not_one_plain_file_are_no_verdict(tmp_path, backend, name, test_sh, error):
    result = check_task(load_harbor_task(_task(tmp_path, name, test_sh)), backend, oracle=False)
    assert result.reward == 0.0 and error in result.details.get("error", ""), result.details


@needs_bwrap
def test_fuzzed_reward_files_never_raise_on_the_host(tmp_path, backend):
    """Random bytes as reward.txt or reward.json: the verdict is a reward in range or an error, never an exception."""
    rng = random.Random(1)
    cases = []
    for i in range(24):
        alphabet = b"0123456789.-+eE \n{}\":,[]" if i % 2 else bytes(range(256))
        cases.append((rng.choice(["reward.txt", "reward.json"]),
                      bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))))
    cases += [("reward.txt", b"1"), ("reward.json", b'{"reward": 0.5}')]
    outcomes = []
    for i, (name, raw) in enumerate(cases):
        task = _task(tmp_path, f"fuzz{i}", f"cp /tests/raw /logs/verifier/{name}\n")
        (task / "tests" / "raw").write_bytes(raw)
        result = check_task(load_harbor_task(task), backend, oracle=False)
        assert 0.0 <= result.reward <= 1.0
        assert result.reward == 0.0 or "error" not in result.details
        outcomes.append(result.reward)
    assert outcomes[-2:] == [1.0, 0.5]


@needs_bwrap
def test_files_are_read_with_the_systems_tools_not_the_tasks_path(backend):
    """A task's PATH may name a folder the agent writes: a `cat` or `head` planted there answers nothing."""
    with backend.create(None, env={"PATH": "/app/bin:/usr/bin:/bin"}) as sbx:
        sbx.exec("mkdir -p /app/bin && for t in cat head; do printf '#!/bin/sh\\necho 1\\n' > /app/bin/$t; "
                 "chmod +x /app/bin/$t; done; echo 0 > /app/answer")
        assert sbx.exec("cat /app/answer").output.strip() == "1"  # the agent's own commands use its PATH
        assert sbx.read_text("/app/answer") == "0\n"
        assert Sandbox.read_file(sbx, "/app/answer", 16) == b"0\n"  # the in-sandbox way other backends use
        assert sbx.read_file("/app/answer", 16) == b"0\n" and sbx.read_file("/app/none", 16) is None
        sbx.exec("ln -s /app/answer /app/link && mkfifo /app/fifo && mkdir /app/dir && ln -s /app /tmp/app")
        for read in (sbx.read_file, lambda p, n: Sandbox.read_file(sbx, p, n)):
            for path, why in [("/app/link", "symbolic link"), ("/app/fifo", "not a regular file"),
                              ("/app/dir", "not a regular file")]:
                with pytest.raises(SandboxError, match=why):
                    read(path, 16)
        with pytest.raises(SandboxError, match="symbolic link"):  # the host reader follows no link at any depth
            sbx.read_file("/tmp/app/answer", 16)
    assert not os.path.exists(sbx.root)


# The verifier's shell is its namespace's init ----------------------------------------------------------------------
# The agent's program, run by a third-party verifier directly (no judge): it forks a detached daemon that writes a
# reward of 1 shortly after the verifier's shell has written its 0 and exited, then exits itself at once (inside the
# old half-second recount of leftovers, which it beat); and it tries to stop or kill the verifier's shell.
LATE_WRITER = r"""
import os, signal, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.6)
        open("/logs/verifier/reward.txt", "w").write("1\n")
        os._exit(0)
    os._exit(0)
for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(1, sig)  # the verifier's shell is pid 1 here: an init ignores them
    except OSError:
        pass
"""


@needs_bwrap
def test_what_the_code_under_test_starts_dies_with_the_verifiers_shell(tmp_path, backend):
    test_sh = "python3 /app/prog.py\nsleep 0.2\necho 0 > /logs/verifier/reward.txt\n"
    task = _task(tmp_path, "late-writer", test_sh)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\ncat > /app/prog.py <<'EOF'\n{LATE_WRITER}\nEOF\n")
    result = check_task(load_harbor_task(task), backend, oracle=True)
    # the shell was neither stopped nor killed, and the daemon died with it before it wrote: a valid 0
    assert result.reward == 0.0 and "error" not in result.details, result.details


@needs_bwrap
def test_the_verifiers_git_runs_no_program_the_agents_repository_names(tmp_path, backend):
    """The agent sets core.fsmonitor and a hooks folder in its repository; the verifier's `git status` and
    `git commit` run neither."""
    solve = ("cd /app && git init -q && git config user.email a@b && git config user.name a\n"
             "git config core.fsmonitor 'touch /app/pwned-by-fsmonitor; false'\n"
             "mkdir -p /app/.hooks && printf '#!/bin/sh\\ntouch /app/pwned-by-hook\\n' > /app/.hooks/pre-commit\n"
             "chmod +x /app/.hooks/pre-commit && git config core.hooksPath /app/.hooks\n")
    test_sh = ("cd /app && git status --porcelain > /dev/null 2>&1; git add -A && git commit -qm v > /dev/null 2>&1\n"
               "if [ -e /app/pwned-by-fsmonitor ] || [ -e /app/pwned-by-hook ]; then echo 1; else echo 0; fi"
               " > /logs/verifier/reward.txt\n")
    task = _task(tmp_path, "git-hooks", test_sh)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    with backend.create(None) as sbx:  # the same config does run them outside the verifier phase
        sbx.exec(solve)
        sbx.exec("cd /app && git status --porcelain; git add -A; git commit -qm v")
        assert sbx.exec("ls /app").output.split().count("pwned-by-hook") == 1
    result = check_task(load_harbor_task(task), backend, oracle=True)
    assert result.reward == 0.0 and "error" not in result.details, (result.details, result.output)
