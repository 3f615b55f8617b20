"""What sandboxes hold on the host goes when their run stops (rl/sandbox/leftovers.py): a stop signal releases every
sandbox, snapshot, mount and cgroup of the process; what a SIGKILLed run left is swept at the next start, and only
that (a live process's sandboxes are untouched)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rl.sandbox import LocalBackend
from rl.sandbox.layers import overlay_problem
from rl.sandbox.leftovers import sweep
from rl.sandbox.owners import make_dir, owner_alive, owner_of, owner_tag
from tests.sandbox_assets import NOTHING, left_by

ROOT = Path(__file__).resolve().parents[3]

# A process that holds a sandbox in its verifier phase (two tmpfs where the host mounts them), a snapshot, a build
# folder and a command still running in the sandbox, then waits to be stopped.
_HOLDER = """
import signal, sys, threading, time
# As a terminal starts a run: a runner that ignores SIGINT and SIGHUP (a shell's background job, nohup) passes that on,
# and a process that ignores a stop signal keeps ignoring it (release_on_signals leaves it so).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from rl.sandbox import LocalBackend
from rl.sandbox.leftovers import held_dir, release_on_signals
if sys.argv[2] == "handlers":
    release_on_signals()
backend = LocalBackend(root_parent=sys.argv[1])
sandbox = backend.create(None)
snapshot = sandbox.snapshot()
sandbox.enter_verifier()
build = held_dir("task", sys.argv[1]); build.__enter__()
threading.Thread(target=sandbox.exec, args=("sleep 60",), kwargs={"timeout": 120}, daemon=True).start()
time.sleep(0.5)
print("ready", sandbox.whole_sandbox_limits, flush=True)
time.sleep(120)
"""


def _start_holder(parent: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(parent), mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.stderr.read()
    return proc


def test_names_carry_their_owner():
    path = make_dir("probe")
    try:
        owner = owner_of(path.name)
        assert owner is not None and f"{owner[0]}.{owner[1]}" == owner_tag() and owner_alive(owner)
        assert not owner_alive((owner[0], owner[1] + 1))  # the same pid started at another time is someone else
        assert owner_of("mc-sandbox-abc123") is None and owner_of("other-1.2-x") is None
    finally:
        path.rmdir()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_releases_every_sandbox_snapshot_mount_and_cgroup(sandbox_parent, sig):
    proc = _start_holder(sandbox_parent, "handlers")
    held = left_by(sandbox_parent, proc.pid)
    assert len(held["folders"]) == 4  # sandbox, verifier, snapshot, build folder
    proc.send_signal(sig)
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode != 0 and "released 3 sandbox resource(s)" in err  # the verifier goes with its sandbox, err
    assert left_by(sandbox_parent, proc.pid) == NOTHING


def test_what_a_killed_run_left_is_swept_at_the_next_start_and_nothing_else(sandbox_parent):
    mine = LocalBackend(root_parent=str(sandbox_parent)).create(None)  # a live process's sandbox: never swept
    try:
        proc = _start_holder(sandbox_parent, "plain")
        proc.kill()
        proc.wait(timeout=60)
        left = left_by(sandbox_parent, proc.pid)
        assert len(left["folders"]) == 4
        if mine.whole_sandbox_limits == {"memory": "cgroup", "disk": "tmpfs"}:
            # the sandbox's and the verifier's tmpfs at least (where layers stack, the overlays and the frozen layer's
            # tmpfs; the judge's user namespace)
            assert len(left["mounts"]) >= 2 + 3 * (overlay_problem() is None) and left["cgroups"]
        # the next check_task (a fresh process) sweeps them before it starts, and says so in one line
        check = subprocess.run([sys.executable, str(ROOT / "tools/check_task.py"),
                                str(ROOT / "examples/tasks/python-roman-numerals")], capture_output=True, text=True,
                               env={**os.environ, "TMPDIR": str(sandbox_parent)}, timeout=120)
        assert check.returncode == 0 and check.stdout.splitlines()[-1] == "0", check.stderr
        (line,) = [x for x in check.stderr.splitlines() if "removed what stopped runs left" in x]
        assert f"of pids {proc.pid}" in line and "1 sandbox folder(s), 1 snapshot folder(s)" in line
        assert left_by(sandbox_parent, proc.pid) == NOTHING
        assert mine.exec("echo alive").output.strip() == "alive"  # untouched
        assert sweep(sandbox_parent, force=True) is None  # nothing more to say
    finally:
        mine.close()


def test_a_stopping_process_makes_no_new_sandbox(sandbox_parent):
    code = ("import os, signal, sys\n"
            "from rl.sandbox import LocalBackend, SandboxError\n"
            "from rl.sandbox.leftovers import release_all\n"
            "backend = LocalBackend(root_parent=sys.argv[1])\n"
            "release_all()\n"
            "try:\n    backend.create(None)\nexcept SandboxError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(sandbox_parent)], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert "this process is stopping" in out.stdout, out.stderr
    assert [n for n in os.listdir(sandbox_parent) if n.startswith("mc-")] == []
