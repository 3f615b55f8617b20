"""Closing a sandbox removes whatever its commands left, at any depth, without following a link out of it, and
releases its tmpfs and cgroup even when a file cannot be removed; as root and as an unprivileged host user."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rl.sandbox import SandboxError, SandboxLimits
from rl.sandbox.leftovers import remove_tree
from rl.sandbox.limits import find_cgroup_parents
from rl.sandbox.local import LocalSandbox, bwrap_problem

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

# Links to the host's files inside folders the sandbox made unwritable and unreadable, and a chain of folders
# deeper than Python's recursion limit and longer than PATH_MAX, some locked.
LEAVE_A_MESS = """
mkdir -p /app/locked/inner && ln -s {host_file} /app/locked/file-link && ln -s {host_dir} /app/locked/dir-link
ln -s {host_file} /app/locked/inner/file-link && chmod 000 /app/locked/inner && chmod 555 /app/locked
python3 -c '
import os
os.chdir("/tmp")
for i in range(1500):
    os.mkdir("d" * 24)
    if i % 300 == 299:
        os.symlink("{host_file}", "link")
    os.chdir("d" * 24)
open("bottom", "w").close()
os.chmod(".", 0o500)
'
"""

# Run by the unprivileged user: make a sandbox, leave the mess, close it, report what is left.
CHILD = """
import json, os, sys
from pathlib import Path
from rl.sandbox import SandboxError, SandboxLimits
from rl.sandbox.local import LocalSandbox
root, host_file, host_dir, mess = sys.argv[1:5]
sb = LocalSandbox(None, root_parent=root, limits=SandboxLimits(max_files=20000))
res = sb.exec(mess)
sb.close()
print(json.dumps({"exit": res.exit_code, "output": res.output[-500:], "left": sorted(os.listdir(root))}))
"""


def _host_target(tmp: Path) -> tuple[Path, Path, dict]:
    host_dir = tmp / "host"
    host_dir.mkdir()
    host_file = host_dir / "secret.txt"
    host_file.write_text("host data\n")
    os.chmod(host_file, 0o600)
    os.chmod(host_dir, 0o711)
    return host_file, host_dir, _state(host_file, host_dir)


def _state(host_file: Path, host_dir: Path) -> dict:
    return {"file_mode": oct(os.lstat(host_file).st_mode), "dir_mode": oct(os.lstat(host_dir).st_mode),
            "text": host_file.read_text(), "entries": sorted(os.listdir(host_dir))}


def _leftover_mounts(root: str) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(root)]


@pytest.mark.parametrize("tmpfs", [None, False], ids=["own-tmpfs-where-possible", "host-filesystem"])
def test_closing_removes_any_depth_follows_no_link_and_releases_everything(tmp_path, tmpfs):
    host_file, host_dir, before = _host_target(tmp_path)
    root = tempfile.mkdtemp(prefix="mc-cleanup-")
    os.chmod(root, 0o711)
    try:
        sb = LocalSandbox(None, root_parent=root, limits=SandboxLimits(max_files=20000), tmpfs=tmpfs)
        name = sb.root.name
        res = sb.exec(LEAVE_A_MESS.format(host_file=host_file, host_dir=host_dir))
        assert res.exit_code == 0, res.output
        with pytest.raises(SandboxError) as e:  # the verifier's frozen copy follows 1024 folders deep, not more
            sb.enter_verifier()
        assert "nested deeper than 1024" in str(e.value) and "\n" not in str(e.value)
        assert [n for n in os.listdir(root) if n.startswith("mc-verifier")] == []
        sb.exec("chmod -R u+rwx /tmp/dddddddddddddddddddddddd; rm -rf /tmp/dddddddddddddddddddddddd")
        sb.enter_verifier()  # a verifier phase's own tmpfs goes too
        sb.exec("mkdir -p /tmp/v && chmod 000 /tmp/v")
        sb.close()
        assert os.listdir(root) == [] and _leftover_mounts(root) == []
        parents = find_cgroup_parents()
        if parents is not None:
            assert not any((base / name).exists() for base in (parents.memory, parents.pids))
        assert _state(host_file, host_dir) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_remove_tree_reports_what_it_cannot_remove_and_removes_the_rest(tmp_path):
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "link").symlink_to(tmp_path)
    if os.geteuid() == 0:  # root may remove anything: nothing to report
        assert remove_tree(tree) == [] and not tree.exists()
        return
    (tmp_path / "elsewhere").mkdir()
    assert remove_tree(tree) == [] and not tree.exists() and (tmp_path / "elsewhere").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to become an unprivileged user (setpriv)")
def test_an_unprivileged_host_user_cleans_up_without_touching_its_own_files(tmp_path):
    """As uid 65534: the sandbox runs in a user namespace as that user, so its files are the host user's own and
    a cleanup that followed a link would change them. The host's file and folder keep their modes."""
    home = Path(tempfile.mkdtemp(prefix="mc-nonroot-"))
    os.chmod(home, 0o755)
    try:
        host_file, host_dir, _ = _host_target(home)
        root = home / "sandboxes"
        root.mkdir()
        for p in (home / "host", host_file, root):
            os.chown(p, 65534, 65534)
        before = _state(host_file, host_dir)
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(REPO)}
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              CHILD, str(root), str(host_file), str(host_dir),
                              LEAVE_A_MESS.format(host_file=host_file, host_dir=host_dir)],
                             cwd=home, env=env, capture_output=True, text=True, timeout=300)
        if res.returncode != 0 and "refuses to run without isolation" in res.stderr:
            pytest.skip("unprivileged user namespaces are not available to uid 65534 here")
        assert res.returncode == 0, res.stderr[-2000:]
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert report["exit"] == 0, report["output"]
        assert report["left"] == [] and _leftover_mounts(str(root)) == []
        assert _state(host_file, host_dir) == before
    finally:
        shutil.rmtree(home, ignore_errors=True)

