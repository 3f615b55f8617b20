"""Whole-sandbox limits: memory over all processes, disk including unlinked-but-open files and inodes, by the
kernel (a cgroup and a tmpfs per sandbox) where the host allows and by the polling monitor everywhere."""

import threading
import time

import pytest

import rl.sandbox.limits as limits
from rl.sandbox import LocalSandbox, SandboxError, SandboxLimits
from rl.sandbox.local import bwrap_problem

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
LIMITS = SandboxLimits(command_timeout_s=30, cpu_time_s=30, memory_mb=256, max_processes=64, max_file_mb=64,
                       disk_mb=64, max_files=3000)
# 8 x 100 MB under 256 MB: each says when it holds its memory; the shell waits (however slow the host) until all 8 do
# or the limit has ended some.
EIGHT_PROCESSES = ("for i in 1 2 3 4 5 6 7 8; do python3 -c 'import sys, time; x = b\"x\" * (100 << 20); "
                   "open(f\"/tmp/alive-{sys.argv[1]}\", \"w\").close(); time.sleep(10)' $i & done; "
                   "for t in $(seq 100); do [ \"$(ls /tmp/alive-* 2>/dev/null | wc -l)\" = 8 ] && break; "
                   "[ \"$(jobs -rp | wc -l)\" -lt 8 ] && break; sleep 0.1; done; echo running $(jobs -rp | wc -l); "
                   "kill $(jobs -rp) 2>/dev/null; wait")
UNLINKED = ("python3 -c '\nimport os, time\nheld = []\nfor i in range(12):\n    f = open(f\"/tmp/b{i}\", \"wb\")\n"
            "    f.write(b\"x\" * (10 << 20)); f.flush(); os.unlink(f\"/tmp/b{i}\"); held.append(f); time.sleep(0.3)\n"
            "print(\"held all\")'")
INODES = ("mkdir /tmp/f && cd /tmp/f && python3 -c '\nimport time\nfor i in range(20000):\n"
          "    open(str(i), \"w\").close()\n    if i % 1000 == 0: time.sleep(0.3)\nprint(\"made all\")'")


def _kernel_problem():
    return limits.cgroup_problem() or limits.tmpfs_problem()


@pytest.fixture(params=["kernel", "monitor"])
def mode(request):
    if request.param == "kernel" and _kernel_problem():
        pytest.skip(f"kernel limits unavailable here: {_kernel_problem()}")
    return request.param


def _sandbox(mode, limits_=LIMITS):
    on = mode == "kernel"
    return LocalSandbox(None, limits=limits_, cgroups=on, tmpfs=on)


def test_the_mode_in_use_is_reported(mode):
    with _sandbox(mode) as s:
        kind = {"kernel": ("cgroup", "tmpfs"), "monitor": ("monitor", "monitor")}[mode]
        assert s.whole_sandbox_limits == {"memory": kind[0], "disk": kind[1]}
        if mode == "kernel":  # every command runs inside the sandbox's own cgroup, on its own filesystem
            # (its writable layer is on the tmpfs: an overlay reports the size of its upper filesystem)
            out = s.exec("df -k /app /tmp | tail -2").output
            assert out.count("tmpfs") + out.count("overlay") == 2 and out.count(" 65536 ") == 2, out
            running = threading.Thread(target=s.exec, args=("sleep 1",))
            running.start()
            time.sleep(0.5)
            members = [(d / "cgroup.procs").read_text().split() for d in s._cgroup.dirs]
            running.join()
            assert all(members), members


def test_memory_is_one_limit_for_all_processes(mode):
    with _sandbox(mode) as s:
        res = s.exec(EIGHT_PROCESSES)
    assert res.memory_exceeded and "memory limit exceeded" in res.describe(), res.describe()
    assert "running 8" not in res.output
    with _sandbox(mode, SandboxLimits(memory_mb=2048)) as s:  # the same programs fit a larger limit
        res = s.exec(EIGHT_PROCESSES)
    assert "running 8" in res.output and not res.memory_exceeded, res.describe()


def test_unlinked_open_files_count(mode):
    with _sandbox(mode) as s:
        res = s.exec(UNLINKED)
        assert "held all" not in res.output
        if mode == "kernel":
            assert "No space left on device" in res.output
        else:
            assert res.disk_exceeded and "disk limit exceeded" in res.describe()
        assert s.exec("echo fine").ok  # the space came back when the files were closed


def test_inodes_count(mode):
    with _sandbox(mode) as s:
        res = s.exec(INODES)
        assert "made all" not in res.output
        assert res.disk_exceeded and "disk limit exceeded" in res.describe(), res.describe()
        assert s.exec("rm -rf /tmp/f && echo cleaned").output == "cleaned\n"


def test_requiring_the_kernel_where_it_is_missing_is_an_error(monkeypatch):
    monkeypatch.setattr(limits, "find_cgroup_parents", lambda: None)
    with pytest.raises(SandboxError, match=r"LocalSandbox\(cgroups=True\): .*polling monitor"):
        LocalSandbox(None, cgroups=True)
    with LocalSandbox(None) as s:  # by default the monitor takes over
        assert s.whole_sandbox_limits["memory"] == "monitor"


def test_tree_larger_than_the_disk_is_refused(tmp_path):
    if limits.tmpfs_problem():
        pytest.skip(limits.tmpfs_problem())
    (tmp_path / "big").write_bytes(b"x" * (3 << 20))
    with pytest.raises(SandboxError, match=r"does not fit the sandbox's disk limit \(2 MB"):
        LocalSandbox(tmp_path, limits=SandboxLimits(disk_mb=2), tmpfs=True)
