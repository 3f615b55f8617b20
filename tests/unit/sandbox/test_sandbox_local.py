"""LocalSandbox basics: private task tree, snapshots and forks, copy_in, exit reporting, and the forking pool."""

import threading
import time
from pathlib import Path

import pytest

from rl.envs.harbor import load_harbor_task
from rl.envs.task import DirectoryTree, RunStep, ScriptVerifier, Task, TaskError, prepare_task
from rl.sandbox import LocalBackend, LocalSandbox, SandboxError
from rl.sandbox.image import ImageBuilder, build_problem
from rl.sandbox.local import bwrap_problem
from rl.sandbox.pool import SandboxPool

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


@pytest.fixture
def tree(tmp_path):
    t = tmp_path / "tree"
    (t / "pkg").mkdir(parents=True)
    (t / "pkg" / "a.txt").write_text("original\n")
    return t


def test_tree_is_a_private_copy(tree):
    with LocalSandbox(tree) as sbx:
        res = sbx.exec("cat pkg/a.txt && echo changed > pkg/a.txt && pwd")
        assert res.ok and res.output == "original\n/app\n"
        assert sbx.read_text("/app/pkg/a.txt") == "changed\n"
        assert sbx.read_text("/app/missing") is None
    assert (tree / "pkg" / "a.txt").read_text() == "original\n"


def test_exit_codes_env_stdin_and_persistent_tmp(tree):
    with LocalSandbox(tree, env={"GREETING": "hi"}) as sbx:
        assert sbx.exec("exit 7").exit_code == 7
        assert sbx.exec("echo $GREETING $EXTRA", env={"EXTRA": "there"}).output == "hi there\n"
        assert sbx.exec("wc -c", stdin=b"x" * 300_000).output.strip() == "300000"
        sbx.exec("echo kept > /tmp/note")
        assert sbx.exec("cat /tmp/note").output == "kept\n"  # /tmp lives as long as the sandbox
        sbx.write_file("/app/new/dir/f.txt", b"data")
        assert sbx.exec("cat new/dir/f.txt", cwd="/app").output == "data"
        res = sbx.exec("kill -SEGV $$")
        assert "SIGSEGV" in res.describe()


def test_snapshot_and_forks_are_independent(tree):
    backend = LocalBackend()
    with backend.create(tree) as base:
        base.exec("echo prepared > pkg/b.txt")
        snap = base.snapshot()
    try:
        with backend.fork(snap) as f1, backend.fork(snap) as f2:
            f1.exec("echo one > pkg/b.txt")
            assert f2.exec("cat pkg/b.txt").output == "prepared\n"
            assert f1.exec("cat pkg/b.txt").output == "one\n"
        # the snapshot is a layer of what the sandbox wrote, over the layers it was made from
        assert (snap.layers[0] / "app" / "pkg" / "b.txt").read_text() == "prepared\n"
        assert not (snap.layers[0] / "app" / "pkg" / "a.txt").exists() or snap.layers[1:] == ()
    finally:
        snap.discard()
    assert not snap.own.exists()


def test_copy_in_adds_files_without_following_the_sandboxes_links(tree, tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "t.sh").write_text("echo from-tests\n")
    canary = tmp_path / "canary"
    canary.mkdir()
    with LocalSandbox(tree) as sbx:
        assert sbx.exec("ls /solution").exit_code != 0
        sbx.copy_in(extra, "/solution")
        assert sbx.exec("bash /solution/t.sh").output == "from-tests\n"
        with pytest.raises(SandboxError, match="system path"):
            sbx.copy_in(extra, "/usr/lib")
        # a link the agent left where the copy goes is replaced, never written through (as root, on the host)
        sbx.exec(f"ln -s {canary} /app/host_link && ln -s /etc /app/etc_link")
        sbx.copy_in(extra / "t.sh", "/app/etc_link/evil.sh")
        sbx.copy_in(extra, "/app/host_link", merge=True)
        assert sbx.exec("test -d /app/etc_link && test -d /app/host_link && ls /app/etc_link").output == "evil.sh\n"
        assert list(canary.iterdir()) == [] and not Path("/etc/evil.sh").exists()


def test_workdir_must_be_inside_tree(tree):
    with pytest.raises(SandboxError, match="must be under"):
        LocalSandbox(tree, workdir="/srv")


def _counting_task(tmp_path) -> Task:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return Task(name="count", instruction="-", tree=DirectoryTree(tmp_path / "tree"), verifier=ScriptVerifier(tests),
                setup=[RunStep("echo ran >> /app/setup_runs", "/app", {}, "test")])


def test_pool_prepares_once_forks_per_sample_and_runs_concurrently(tree, tmp_path):
    task = _counting_task(tmp_path)
    barrier = threading.Barrier(2, timeout=60)

    def sample(sbx, i):
        barrier.wait()  # two samples must be live at the same time for this to pass
        sbx.exec(f"echo sample{i} >> /app/setup_runs")
        return sbx.exec("cat /app/setup_runs").output

    with SandboxPool(LocalBackend(), prepare_task, concurrency=2) as pool:
        outputs = pool.run_group(task, sample, group_size=4)
    assert outputs == [f"ran\nsample{i}\n" for i in range(4)]


def test_failed_setup_names_its_origin(tmp_path):
    task_dir = tmp_path / "broken"
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "tests").mkdir()
    (task_dir / "instruction.md").write_text("x")
    (task_dir / "task.toml").write_text("")
    (task_dir / "tests" / "test.sh").write_text("exit 0\n")
    (task_dir / "environment" / "Dockerfile").write_text("FROM debian\nWORKDIR /app\nRUN apt-get install -y foo\n")
    task = load_harbor_task(task_dir)
    # an install is built into an image where this host can build one (else the line says why it cannot)
    try:
        builds = build_problem() is None and ImageBuilder().base().is_dir()
    except SandboxError:  # no way to the Debian mirror
        builds = False
    failed = (r"Dockerfile:3: Debian's archive, which stands in for the FROM image's, has no package foo: build the "
              r"task on a container backend from its own image \(the whole log" if builds
              else r"\(it must be built: .*Dockerfile:3: RUN reaches past /app")
    with SandboxPool(LocalBackend(), prepare_task, concurrency=1) as pool:
        with pytest.raises(TaskError, match=failed):
            pool.prepare(task)
    (task_dir / "environment" / "Dockerfile").write_text("FROM debian\nWORKDIR /app\nRUN echo first; echo last >&2; "
                                                        "exit 3\n")
    task = load_harbor_task(task_dir)
    with SandboxPool(LocalBackend(), prepare_task, concurrency=1) as pool:
        with pytest.raises(TaskError, match=r"Dockerfile:3: setup command failed \(exit code 3\): last \(the whole "
                                            r"log: .*setup-.*\.log\)$"):
            pool.prepare(task)


def _cmdline_has(proc: Path, marker: str) -> bool:
    try:
        return marker.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def test_unisolated_mode_still_applies_limits(tmp_path):
    import warnings

    from rl.sandbox.local import UnisolatedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedWarning)
        backend = LocalBackend(unisolated=True)
        with backend.create(None) as sbx:
            marker = f"mc-unisolated-{id(sbx)}"
            res = sbx.exec(f"(exec -a {marker} sleep 30) & echo started", timeout=60)
            assert res.output == "started\n" and not res.timed_out
            for _ in range(100):  # SIGKILL was sent when the shell exited; give the kernel a moment to reap
                alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, marker)]
                if not alive:
                    break
                time.sleep(0.05)
            assert alive == []  # the command's session was killed when its shell exited
            assert sbx.exec("sleep 3", timeout=0.5).timed_out
            assert Path(sbx.workdir).is_dir() and str(sbx.root) in sbx.workdir


SERVICE_ENTRYPOINT = """#!/bin/bash
echo "127.0.0.1 svc.test" >> /etc/hosts
python3 -m http.server 80 --bind 127.0.0.1 --directory /app/site >/dev/null 2>&1 &
for _ in $(seq 100); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 80))" 2>/dev/null && break
  sleep 0.05; done
exec "$@"
"""
FETCH = ("python3 -c \"import urllib.request; print(urllib.request.urlopen('http://svc.test/').read().decode(), "
         "end='')\"")


def test_an_entrypoint_starts_each_episode_as_a_container_starts(tmp_path):
    """The image's ENTRYPOINT runs first in every episode, with its own /etc/hosts and ports below 1024 (as docker
    gives a container): the service it leaves running answers the agent and the verifier, which sees /etc/hosts
    read-only; a sandbox's /etc/hosts is its own."""
    tree = tmp_path / "tree"
    (tree / "site").mkdir(parents=True)
    (tree / "site" / "index.html").write_text("served\n")
    (tree / "entrypoint.sh").write_text(SERVICE_ENTRYPOINT)
    (tree / "entrypoint.sh").chmod(0o755)
    with LocalSandbox(tree, entrypoint=("/app/entrypoint.sh",)) as sbx, LocalSandbox(tree) as other:
        res = sbx.exec(FETCH)
        if res.output.startswith("Traceback") and "Permission denied" in res.output:
            pytest.skip("ports below 1024 need a root host (docs/SANDBOX.md)")
        assert res.output == "served\n", res.output
        assert "svc.test" not in other.exec("cat /etc/hosts").output  # each sandbox's /etc/hosts is its own
        sbx.enter_verifier()
        res = sbx.exec(f"{FETCH}; echo 127.0.0.2 forged >> /etc/hosts")
        assert res.output.startswith("served\n") and ("Read-only file system" in res.output
                                                       or "Permission denied" in res.output), res.output
        sbx.leave_verifier()
        assert sbx.end_episode() >= 1  # the service was running until the episode ended
        assert sbx.exec(FETCH).output == "served\n"  # the next episode starts with the entrypoint again


def test_an_entrypoint_that_fails_is_one_line_before_any_command_runs(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "entrypoint.sh").write_text("#!/bin/bash\necho 'cannot find config.yaml' >&2\nexit 4\n")
    (tree / "entrypoint.sh").chmod(0o755)
    with LocalSandbox(tree, entrypoint=("/app/entrypoint.sh",)) as sbx:
        with pytest.raises(SandboxError) as e:
            sbx.exec("touch /app/ran")
        (line,) = str(e.value).splitlines()
        assert "ENTRYPOINT ['/app/entrypoint.sh']" in line and "status 4 cannot find config.yaml" in line, line
        assert not (sbx.app_dir / "ran").exists()
    (tree / "entrypoint.sh").write_text("#!/bin/bash\ntouch /tmp/started\n")  # runs and ends without exec "$@"
    with LocalSandbox(tree, entrypoint=("/app/entrypoint.sh",)) as sbx:
        assert sbx.exec("ls /tmp/started").ok
