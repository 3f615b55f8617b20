"""Hostile commands inside LocalSandbox: each is contained, the sandbox says what happened, the host is unharmed.

Every bomb here is bounded twice: by the sandbox's own limits (small rlimits, short timeouts, a small disk
quota) and by the test's choice of sizes, so a broken sandbox fails the test instead of harming the machine.
"""

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from rl.envs.tools import ToolBox
from rl.sandbox import LocalSandbox, SandboxLimits
from rl.sandbox.local import bwrap_problem

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

LIMITS = SandboxLimits(command_timeout_s=20, cpu_time_s=20, memory_mb=512, max_processes=64, max_file_mb=16,
                       disk_mb=64, max_output_bytes=64 * 1024)


@pytest.fixture(params=["host", "image"])
def sbx(request, tmp_path):
    """A sandbox on the host's system and one on a built image (which must give no more)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "main.py").write_text("print('hi')\n")
    image = request.getfixturevalue("test_image") if request.param == "image" else None
    with LocalSandbox(tree, limits=LIMITS, image=image) as s:
        yield s


def _host_processes_with(marker: str) -> list[int]:
    """Host processes whose command line holds marker, waiting briefly for killed ones to be reaped."""
    for _ in range(100):
        found = _scan(marker)
        if not found:
            return found
        time.sleep(0.05)
    return found


def _scan(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_no_network_to_host_localhost_or_outside(sbx):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(3)
    t = threading.Thread(target=lambda: accepted.append(_try_accept(server)))
    t.start()
    code = (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n        s.connect(addr); print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('blocked', addr, e.errno)\n")
    code += "print([name for _, name in socket.if_nameindex()])\n"
    res = sbx.exec(f"python3 -c {_q(code)}")
    t.join()
    server.close()
    assert "CONNECTED" not in res.output and res.output.count("blocked") == 3
    assert accepted == [None]  # nothing reached the host's listener
    assert res.output.splitlines()[-1] == "['lo']"  # the only interface is the sandbox's own loopback


def _try_accept(server):
    try:
        conn, _ = server.accept()
        conn.close()
        return "accepted"
    except OSError:
        return None


def _q(s):
    import shlex

    return shlex.quote(s)


def test_cannot_read_host_secrets_or_checkout(sbx, monkeypatch):
    monkeypatch.setenv("MC_TEST_SECRET_TOKEN", "s3cr3t-value")
    res = sbx.exec(f"cat /etc/shadow; ls /root; ls {REPO}; cat {REPO}/setup.py; ls /home; env; ls /run /var/run; "
                   "id -u")
    assert "s3cr3t-value" not in res.output  # the host's environment does not leak in
    assert "root:" not in res.output
    assert "megatron-composer" not in res.output  # setup.py's content
    assert "No such file or directory" in res.output
    assert res.output.strip().splitlines()[-1] != "0"  # never root inside


def test_cannot_write_outside_task_tree(sbx, tmp_path):
    victim = tmp_path / "victim"
    res = sbx.exec(f"touch /usr/evil /etc/evil /evil /dev/evil /var/evil; mkdir -p {tmp_path}; touch {victim}; "
                   "echo ok > /app/fine")
    # the host's system is bound read-only; an image's, and the sandbox's /, /var and /dev, are root's
    assert res.output.count("Read-only file system") + res.output.count("Permission denied") >= 5, res.output
    assert not Path("/usr/evil").exists() and not Path("/etc/evil").exists() and not victim.exists()
    assert not Path("/var/evil").exists() and sbx.read_file("/var/evil", 0) is None
    assert (sbx.app_dir / "fine").read_text() == "ok\n"


def test_file_tools_refuse_symlink_and_dotdot_escapes(sbx):
    tools = ToolBox(sbx)
    sbx.exec("ln -s /etc/passwd /app/pw; ln -s / /app/rootlink; ln -s /etc /app/etclink")
    for path in ("../etc/passwd", "/app/../etc/passwd", "pw", "rootlink/etc/hostname", "/etc/passwd",
                 "etclink/passwd"):
        obs = tools.call("read_file", {"path": path})
        assert obs.error and "outside the task tree" in obs.text, (path, obs.text)
    for path in ("../escape.txt", "etclink/evil", "rootlink/tmp/x", "pw"):
        obs = tools.call("write_file", {"path": path, "content": "x"})
        assert obs.error and "outside the task tree" in obs.text, (path, obs.text)
    assert not Path("/etc/evil").exists() and Path("/etc/passwd").read_text().startswith("root:")
    obs = tools.call("list_dir", {"path": "rootlink"})
    assert obs.error and "outside the task tree" in obs.text
    obs = tools.call("search", {"pattern": "root", "path": "etclink"})
    assert obs.error and "outside the task tree" in obs.text
    # Inside the tree everything works, symlinks included.
    sbx.exec("mkdir -p /app/sub && ln -s sub /app/inner")
    assert not tools.call("write_file", {"path": "inner/a.txt", "content": "fine"}).error
    assert tools.call("read_file", {"path": "sub/a.txt"}).text == "fine"


def test_fork_bomb_is_bounded(sbx):
    res = sbx.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=8)
    assert "Resource temporarily unavailable" in res.output or res.timed_out
    assert "process limit reached (64 processes)" in res.describe() or res.timed_out
    assert sbx.exec("echo alive").output == "alive\n"  # the sandbox (and host) recover at once


def test_memory_bomb_is_bounded(sbx):
    """Memory is the whole sandbox's (the cgroup, or the monitor), never a per-process address-space limit: a
    program may reserve far more address space than it touches (the JVM, Go, Node, torch), and one that touches
    more than the sandbox's memory is killed."""
    res = sbx.exec("python3 -c 'import mmap; m = mmap.mmap(-1, 8 * 1024**3); print(\"reserved\")'")
    assert res.ok and res.output == "reserved\n", res.output  # 8 GB of address space under a 512 MB sandbox
    res = sbx.exec("python3 -c 'x = bytearray(2 * 1024**3); print(len(x))'")
    assert res.exit_code != 0 and res.memory_exceeded
    assert "memory limit exceeded" in res.describe()


def test_infinite_loop_and_sigterm_ignoring_process_are_killed(sbx):
    marker = f"mc-loop-{os.getpid()}-{time.monotonic_ns()}"
    res = sbx.exec(f"trap '' TERM INT HUP; bash -c 'trap \"\" TERM; exec -a {marker} sleep 1000' & "
                   f"while :; do :; done", timeout=1.5)
    assert res.timed_out and "timeout" in res.describe() and res.exit_code == 124
    assert _host_processes_with(marker) == []


def test_cpu_time_limit_reported(tmp_path):
    with LocalSandbox(None, limits=SandboxLimits(cpu_time_s=1, command_timeout_s=20)) as s:
        res = s.exec("python3 -c 'while True: pass'")
    assert not res.timed_out and "CPU time limit" in res.describe()


def test_huge_output_is_capped(sbx):
    res = sbx.exec("head -c 100000000 /dev/zero | tr '\\0' 'x'")
    assert res.output_truncated and res.output_bytes == 100_000_000
    assert len(res.output) == LIMITS.max_output_bytes and "output capped" in res.describe()


def test_killing_the_parent_is_contained(sbx):
    res = sbx.exec(f"kill -9 $PPID; kill -9 1; kill -9 {os.getpid()}; kill -9 -1; echo still-here")
    assert "still-here" in res.output or res.exit_code != 0
    assert "killed" in res.describe() or "No such process" in res.output
    assert sbx.exec("echo next").output == "next\n"  # this test process (the host) lives on


def test_background_processes_live_for_the_episode_and_die_with_it(sbx):
    marker = f"mc-bg-{os.getpid()}-{time.monotonic_ns()}"
    res = sbx.exec(f"(exec -a {marker} sleep 1000) & setsid bash -c 'exec -a {marker} sleep 1000' & "
                   f"nohup bash -c 'exec -a {marker} sleep 1000' >/dev/null 2>&1 & echo started")
    assert res.output.startswith("started") and res.background_processes == 3
    assert "keep running in the background" in res.describe()
    assert len(_scan(marker)) == 3
    # the next command sees them, and cannot end the episode's init (it takes no signal from inside)
    pattern = f"{marker[:-1]}[{marker[-1]}]"  # matches the marker, and is not the marker (grep's own argv)
    res = sbx.exec(f"kill -9 1; kill -STOP 1; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | "
                   f"grep -cx '{pattern}'")
    assert res.output.split()[-1] == "3" and sbx.exec("true").background_processes == 0
    assert sbx.end_episode() == 3 and _host_processes_with(marker) == []
    assert sbx.exec("echo fresh").output == "fresh\n"  # the next command starts a new episode


def test_services_have_the_usual_writable_system_paths(sbx):
    """/var/log, /var/lib, /var/cache, /var/spool, /run, /tmp, /var/tmp and HOME are the agent's to write and outlive
    the agent phase (the verifier judges a frozen copy of all of them, as a container's would be); the system, and
    an image's other folders, are root's and read-only to it."""
    res = sbx.exec("mkdir -p /var/log/svc /var/lib/db /var/cache/c /var/spool/s /run/svc && "
                   "(setsid bash -c 'echo started > /var/log/svc/out.log; exec sleep 1000' >/dev/null 2>&1 &) && "
                   "for i in $(seq 100); do [ -s /var/log/svc/out.log ] && break; sleep 0.05; done && "
                   "echo 7 > /run/svc/pid && touch /var/tmp/t /tmp/u ~/.config-h && ls /tmp && "
                   "for p in /usr/x /etc/x /usr/local/bin/x /x /var/x /opt/x /srv/x; do "
                   "touch $p 2>/dev/null && echo wrote $p; done; true")
    assert res.output.split() == ["u"], res.output
    sbx.enter_verifier()
    res = sbx.exec("cat /var/log/svc/out.log /run/svc/pid; ls /var/tmp/; ls /tmp; ls -d ~/.config-h")
    assert res.output.split() == ["started", "7", "t", "u", "/root/.config-h"], res.output
    assert sbx.read_file("/run/svc/pid", 16) == b"7\n"


def test_closing_the_sandbox_ends_its_background_processes(tmp_path, sandbox_parent):
    marker = f"mc-bg-{os.getpid()}-{time.monotonic_ns()}"
    with LocalSandbox(None, limits=LIMITS, root_parent=sandbox_parent) as s:
        s.exec(f"setsid bash -c 'trap \"\" TERM HUP; exec -a {marker} sleep 1000' &")
        assert len(_scan(marker)) == 1
    assert _host_processes_with(marker) == []


def test_filling_the_disk_is_stopped(sbx):
    res = sbx.exec("head -c 200000000 /dev/zero > /app/big; ls -la /app/big", timeout=15)
    assert "file size limit reached (16 MB per file)" in res.describe()
    res = sbx.exec("for i in $(seq 1 20); do head -c 15000000 /dev/zero > /tmp/f$i || break; done; echo done",
                   timeout=15)
    assert res.disk_exceeded and "disk limit exceeded" in res.describe()
    assert sbx.exec("rm -f /tmp/f* /app/big && echo cleaned").output == "cleaned\n"
    # Memory-backed places are small or read-only, so they cannot be used to fill the host's RAM either.
    res = sbx.exec("for i in 1 2 3 4 5 6; do head -c 15000000 /dev/zero > /dev/shm/f$i || break; done; touch /big",
                   timeout=15)
    assert "No space left on device" in res.output and ("Read-only file system" in res.output
                                                        or "Permission denied" in res.output)


def test_refuses_without_bwrap_unless_unisolated(monkeypatch, tmp_path):
    import rl.sandbox.local as local
    from rl.sandbox.base import SandboxError

    monkeypatch.setattr(local, "bwrap_path", lambda: None)
    with pytest.raises(SandboxError, match="refuses to run without isolation.*bubblewrap.*unisolated=True"):
        LocalSandbox(None)
    with pytest.warns(local.UnisolatedWarning, match="WITHOUT ANY ISOLATION"):
        s = LocalSandbox(None, unisolated=True)
    with s:
        (s.app_dir / "x.txt").write_text("hello")
        assert s.exec("cat x.txt").output == "hello"


def test_judge_refuses_rather_than_run_the_code_unisolated(tmp_path):
    """Where bubblewrap cannot nest a sandbox (here: not on the PATH at all), judge exits 125 with a one-line
    reason, and the command never runs; the verifier's error names what the host lacks."""
    import subprocess

    from rl.envs.task import missing_tool
    from rl.sandbox.local import judge_script

    judge = tmp_path / "judge"
    judge.write_text(judge_script(str(tmp_path / "no-bwrap-here")))
    marker = tmp_path / "ran"
    res = subprocess.run(["/bin/bash", str(judge), "/usr/bin/touch", str(marker)], env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert res.returncode == 125 and not marker.exists()
    assert res.stderr.startswith("judge: cannot isolate the code under test")
    assert "unprivileged user namespaces" in missing_tool(res.stderr)


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_judge_runs_the_hosts_bubblewrap_whatever_the_path_says(tmp_path):
    """A task whose PATH puts /app/bin first: a `bwrap` the agent planted there is not what judge runs."""
    from rl.sandbox.local import LocalSandbox

    sb = LocalSandbox(None, env={"PATH": "/app/bin:/usr/bin:/bin"})
    try:
        sb.write_file("/app/bin/bwrap", b"#!/bin/sh\necho 1 > /logs/verifier/reward.txt; touch /app/planted-ran\n")
        sb.exec("chmod +x /app/bin/bwrap")
        sb.enter_verifier()
        res = sb.exec("/opt/verifier/bin/judge sh -c 'echo judged; ls /logs'")
        assert res.exit_code == 0 and res.output.strip() == "judged", res.output
        assert sb.read_text("/app/planted-ran") is None and sb.read_text("/logs/verifier/reward.txt") is None
    finally:
        sb.close()
