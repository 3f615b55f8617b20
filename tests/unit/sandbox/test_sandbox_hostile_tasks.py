"""Hostile tasks: a Harbor task whose reference solution is an attack, checked the way `check_task --oracle` does.

Each task's verifier gives reward 1 exactly when its attack worked, so every one must score 0 (or the task must
be refused when it is loaded), and the host must be unchanged afterwards: no file the attack aimed at changed,
no sandbox directory, mount, cgroup or process left behind. The classes: rewards planted where the verifier
writes, interpreter start-up hooks left for the verifier, memory spread over many processes, disk held by
unlinked files or spent on inodes, task folders that are symlinks to the host, and the ones that held before
(host files, host loopback and unix sockets, host processes, background processes that write rewards, fork
bombs, /dev and /sys, ptrace, setuid, the host's environment, network egress).
"""

import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from megatron_composer.data.chat_template import format_tool_call
from rl.envs.agent import ScriptedPolicy, run_episode
from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import TaskError, prepare_task
from rl.sandbox.limits import cgroup_problem, tmpfs_problem
from rl.sandbox.local import LocalBackend, bwrap_problem
from tests.hostile_assets import LIMITS, RecordingBackend, make_task, run_attack, run_solution

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

def _kernel_limits_problem() -> str | None:
    return cgroup_problem() or tmpfs_problem()


@pytest.fixture
def sandbox_root(sandbox_parent):
    """A folder of its own for the sandboxes (reachable by the sandbox users), to see that nothing is left."""
    return str(sandbox_parent)


@pytest.fixture(params=["kernel", "monitor", "image"])
def backend(request, sandbox_root):
    """Whole-sandbox limits by the kernel (a cgroup and a tmpfs per sandbox) and by the polling fallback; and every
    task built into an image (rl/sandbox/image.py), which must give the agent no more than the host's system."""
    if request.param == "image":
        request.getfixturevalue("image_base")  # skips, with the reason, where no image can be built
        return RecordingBackend(limits=LIMITS, root_parent=sandbox_root, build_images=True)
    if request.param == "kernel" and _kernel_limits_problem():
        pytest.skip(f"kernel limits unavailable here: {_kernel_limits_problem()}")
    on = request.param == "kernel"
    return RecordingBackend(limits=LIMITS, root_parent=sandbox_root, cgroups=on, tmpfs=on)


# Classes that broke before ------------------------------------------------------------------------------------
PLANTED_REWARD = ("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                  "chmod 444 /logs/verifier/reward.txt && chmod 555 /logs/verifier /logs")


def test_planted_reward_with_chmod_does_not_count(tmp_path, backend):
    task = make_task(tmp_path, "planted", PLANTED_REWARD + "\n")
    task_def = load_harbor_task(task)
    result = check_task(task_def, backend, oracle=True, log=lambda s: None)
    assert result.reward == 0.0 and "error" not in result.details  # the honest `echo 0` was written and read
    assert run_attack(task, backend) == 0.0


def test_planted_reward_through_an_episode_on_a_bundled_task(tmp_path):
    task = load_harbor_task(REPO / "examples" / "tasks" / "python-lru-cache-bug")
    backend = LocalBackend(limits=LIMITS)
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sbx:
            turns = [format_tool_call("run", {"command": PLANTED_REWARD}) + format_tool_call("submit", {})]
            res = run_episode(task, sbx, ScriptedPolicy(turns))
    finally:
        snapshot.discard()
    assert res.reward == 0.0 and "error" not in res.verify.details, res.verify.details


VERIFIER_RUNS_PYTHON = ("#!/bin/bash\ncd /app\nif python3 -c 'import sys; sys.exit(1)'; then echo 1; else echo 0; fi "
                        "> /logs/verifier/reward.txt\n")
STARTUP_HOOKS = """\
hook='import atexit, os; atexit.register(lambda: os._exit(0))'
user_site=$(python3 -m site --user-site)
mkdir -p "$user_site"
echo "$hook" > "$user_site/usercustomize.py"
echo "$hook" > "$user_site/sitecustomize.py"
echo "import atexit, os; atexit.register(lambda: os._exit(0))" > "$user_site/hook.pth"
echo "$hook" > /tmp/sitecustomize.py
echo "$hook" > /tmp/usercustomize.py
# The hooks work while the agent runs (a failing program exits 0), so only the verifier's isolation stops them.
python3 -c 'import sys; sys.exit(1)' && echo hooked > /tmp/hooks-live
"""


def test_interpreter_startup_hooks_do_not_reach_the_verifier(tmp_path, backend):
    task = make_task(tmp_path, "startup-hooks", STARTUP_HOOKS, verifier=VERIFIER_RUNS_PYTHON)
    task_def = load_harbor_task(task)
    sandbox = backend.create(None, limits=LIMITS)
    try:  # the attack is real: in the agent's phase the hook turns a failing exit into success
        sandbox.exec(task_def.solution.as_commands()[0])
        assert sandbox.read_text("/tmp/hooks-live") == "hooked\n"
    finally:
        sandbox.close()
    assert run_attack(task, backend) == 0.0


MEMORY_SPREAD = """\
for i in 1 2 3 4 5 6 7 8; do  # 8 x 100 MB, each within RLIMIT_AS; memory_mb is 256 for the whole sandbox
  python3 -c 'import sys, time; x = b"x" * (100 << 20); open(f"/tmp/alive-{sys.argv[1]}", "w").close()
time.sleep(3)' $i &
done
sleep 2
n=$(ls /tmp/alive-* 2>/dev/null | wc -l); running=$(jobs -rp | wc -l)
wait
[ "$n" = 8 ] && [ "$running" = 8 ] && touch /app/pwned
"""


def test_memory_across_eight_processes_is_one_limit(tmp_path, backend):
    task = make_task(tmp_path, "memory-spread", MEMORY_SPREAD, toml="[environment]\nmemory_mb = 256\n")
    assert run_attack(task, backend) == 0.0


UNLINKED_FILES = """\
python3 - <<'EOF'
import os, time
held = []
for i in range(12):  # 12 x 10 MB, each unlinked once written, all held open: 120 MB under a 64 MB disk
    f = open(f"/tmp/blob{i}", "wb")
    f.write(b"x" * (10 << 20)); f.flush(); os.fsync(f.fileno())
    os.unlink(f"/tmp/blob{i}")
    held.append(f)
    time.sleep(0.3)  # let a polling monitor see the growth
open("/app/pwned", "w").close()
EOF
"""


def test_unlinked_open_files_count_against_disk(tmp_path, backend):
    task = make_task(tmp_path, "unlinked", UNLINKED_FILES)
    assert run_attack(task, backend) == 0.0


INODE_FLOOD = """\
mkdir -p /tmp/flood && cd /tmp/flood
python3 -c '
import os
for i in range(20000):  # empty files: no blocks, only inodes (max_files is 3000)
    open(str(i), "w").close()
    if i % 1000 == 0: __import__("time").sleep(0.3)
open("/app/pwned", "w").close()
'
"""


def test_inode_flood_is_bounded(tmp_path, backend):
    task = make_task(tmp_path, "inodes", INODE_FLOOD)
    assert run_attack(task, backend) == 0.0


MEMFD_MEMORY = """\
python3 - <<'PY'
import os, time
held = []
for i in range(8):  # 8 x 60 MB in memfds (shared memory: in no private resident set); memory_mb is 256
    fd = os.memfd_create(f"m{i}")
    for _ in range(60):  # a memfd is a file: each stays under RLIMIT_FSIZE (max_file_mb 64)
        os.write(fd, b"x" * (1 << 20))
    held.append(fd)
    time.sleep(0.3)  # let a polling monitor see the growth
open("/app/pwned", "w").close()
PY
"""
MAPPED_UNLINKED = """\
for p in 0 1 2 3; do  # 4 processes x 2 x 40 MB, each file mapped, its descriptor closed and its name unlinked
  python3 - $p <<'PY' &
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
time.sleep(0.6 * int(sys.argv[1]))  # one file at a time in the folder: its walk never sees more than 40 MB
for i in range(2):
    name = f"/tmp/blob{sys.argv[1]}-{i}"
    with open(name, "wb+") as f:
        f.write(b"x" * (40 << 20))
        f.flush()
        # libc's mmap, not Python's (which keeps a descriptor): only the mapping holds the file
        assert libc.mmap(None, 40 << 20, 1, 1, f.fileno(), 0) not in (None, ctypes.c_void_p(-1).value)
    os.unlink(name)
    time.sleep(0.3)
open(f"/tmp/mapped{sys.argv[1]}", "w").close()
time.sleep(4)
PY
done
sleep 4
[ "$(ls /tmp/mapped* | wc -l)" = 4 ] && touch /app/pwned
wait
"""


@pytest.mark.parametrize("played_by", ["solution", "episode"])
@pytest.mark.parametrize("attack", ["memfd-memory", "mapped-unlinked-files"])
def test_shared_memory_and_mapped_unlinked_files_count(tmp_path, backend, attack, played_by):
    solve = MEMFD_MEMORY if attack == "memfd-memory" else MAPPED_UNLINKED
    task = make_task(tmp_path, attack, solve, toml="[environment]\nmemory_mb = 256\n")
    assert run_attack(task, backend, episode=played_by == "episode") == 0.0


@pytest.mark.parametrize("folder", ["tests", "solution", "environment"])
def test_symlinked_task_folders_are_refused(tmp_path, folder):
    secret = tmp_path / "host-secrets"
    secret.mkdir()
    (secret / "test.sh").write_text("cat /etc/hostname\n")
    (secret / "solve.sh").write_text("true\n")
    (secret / "Dockerfile").write_text("FROM ubuntu\n")
    task = make_task(tmp_path, f"symlinked-{folder}", "true\n")
    shutil.rmtree(task / folder)
    (task / folder).symlink_to(secret)
    with pytest.raises(TaskError, match=rf"{task / folder} resolves outside the task folder \(to {secret}\)"):
        load_harbor_task(task)
    # A single file that points out is refused the same way, with its path.
    task = make_task(tmp_path, f"symlinked-file-{folder}", "true\n")
    inner = {"tests": "test.sh", "solution": "solve.sh", "environment": "Dockerfile"}[folder]
    (task / folder / inner).unlink()
    (task / folder / inner).symlink_to(secret / inner)
    with pytest.raises(TaskError, match=rf"{task / folder / inner} resolves outside the task folder"):
        load_harbor_task(task)


# Classes that held, and must keep holding ---------------------------------------------------------------------
HELD = {
    "host-files": "cat /etc/shadow >/dev/null 2>&1 && touch /app/pwned\n"
                  "echo changed > {canary} 2>/dev/null && touch /app/pwned\n"
                  "ls {canary_dir} >/dev/null 2>&1 && touch /app/pwned\n",
    "host-loopback": "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)' "
                     "&& touch /app/pwned\n",
    "host-unix-socket": "python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect(\"{unix}\")' "
                        "2>/dev/null && touch /app/pwned\n",
    "host-processes": "kill -9 {host_pid} 2>/dev/null && touch /app/pwned\n"
                      "[ -e /proc/{host_pid}/cmdline ] && grep -q sleep /proc/{host_pid}/cmdline && touch /app/pwned\n",
    # background processes live on through the verifier (as in a container) and write a reward all along: they
    # write the episode's /logs, never the verifier's
    "background-late-reward": "(while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
                              "sleep 0.05; done) >/dev/null 2>&1 &\n"
                              "setsid nohup bash -c 'while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.05; "
                              "done' >/dev/null 2>&1 &\n",
    "fork-bomb": "bomb() {{ bomb | bomb & }}; bomb; sleep 1\n",
    "dev-and-sys": "echo x > /dev/sda 2>/dev/null && touch /app/pwned\n"
                   "echo 1 > /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null && touch /app/pwned\n"
                   "echo c > /proc/sysrq-trigger 2>/dev/null && touch /app/pwned\n"
                   "mknod /tmp/mem c 1 1 2>/dev/null && touch /app/pwned\n",
    "ptrace": "python3 - <<'EOF'\nimport ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "for pid in ({host_pid}, {test_pid}):\n    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH\n"
              "        open('/app/pwned', 'w').close()\nEOF\n",
    "setuid": "for b in /usr/bin/su /usr/bin/sudo /usr/bin/passwd /usr/bin/mount /usr/bin/newgrp; do\n"
              "  [ -x $b ] && $b --help >/dev/null 2>&1 </dev/null; done\n"
              "cp /bin/sh /tmp/sh && chmod u+s /tmp/sh && /tmp/sh -c '[ $(id -u) = 0 ]' && touch /app/pwned\n"
              "[ \"$(id -u)\" = 0 ] && touch /app/pwned\n",
    "host-environment": "env | grep -q MC_HOSTILE_SECRET && touch /app/pwned\n",
    "network-egress": "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)' 2>/dev/null "
                      "&& touch /app/pwned\n"
                      "getent hosts example.com >/dev/null && touch /app/pwned\n",
}


@pytest.mark.parametrize("attack", sorted(HELD))
def test_attacks_that_held_still_hold(tmp_path, attack, monkeypatch, sandbox_root):
    backend = RecordingBackend(limits=LIMITS, root_parent=sandbox_root)
    canary = tmp_path / "canary" / "host-file.txt"
    canary.parent.mkdir()
    canary.write_text("host data\n")
    monkeypatch.setenv("MC_HOSTILE_SECRET", "s3cr3t")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    unix_path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix.listen(4)
    unix.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def accept_all():
        while not stop.is_set():
            for s in (server, unix):
                try:
                    accepted.append(s.accept())
                except OSError:
                    pass

    acceptor = threading.Thread(target=accept_all)
    acceptor.start()
    host_proc = subprocess.Popen(["sleep", "120"])
    try:
        solve = HELD[attack].format(canary=canary, canary_dir=canary.parent, port=server.getsockname()[1],
                                    unix=unix_path, host_pid=host_proc.pid, test_pid=os.getpid())
        task = make_task(tmp_path, attack, solve)
        assert run_attack(task, backend, watched=[canary]) == 0.0
        assert host_proc.poll() is None  # the host's process lives
    finally:
        stop.set()
        acceptor.join()
        host_proc.kill()
        host_proc.wait()
        server.close()
        unix.close()
    assert accepted == []  # nothing reached the host's listeners
    assert canary.read_text() == "host data\n"


# The code under test, run by the verifier, attacks the verdict ----------------------------------------------------
WRITE_ONE = "open('/logs/verifier/reward.txt', 'w').write('1\\n')\n"
CODE_UNDER_TEST = {
    # sitecustomize in the work tree: the bundled verifiers do not put /app on PYTHONPATH at start-up
    "sitecustomize-in-app": ("sitecustomize.py", "import atexit, os\natexit.register(lambda: os._exit(0))\n"),
    # write the reward, then kill the verifier's shell before it writes the honest one
    "write-then-kill-verifier": ("lru.py", "import os, signal\n" + WRITE_ONE + "os.kill(os.getppid(), signal.SIGKILL)\n"
                                 "os.kill(os.getpgid(0), signal.SIGKILL)\n"),
    # write the reward, then lock it so the verifier's `echo 0` fails
    "write-then-lock-reward": ("lru.py", "import os\n" + WRITE_ONE + "os.chmod('/logs/verifier/reward.txt', 0o444)\n"
                               "os.chmod('/logs/verifier', 0o555)\n"),
    # end the process with success as it loads, before any test could fail
    "exit-zero-on-load": ("lru.py", "import os\nos._exit(0)\n"),
    # find this case in the verifier's answer key and print its expected output
    "print-the-answer-key": ("lru.py", "import json, os, sys\n"
                             "for path in ('/tests/cases.json', '/tests/test_lru.py'):\n"
                             "    try:\n        cases = json.load(open(path))['cases']\n    except Exception:\n"
                             "        continue\n    for case in cases:\n"
                             "        if case['argv'][-1] == open('/proc/self/cmdline').read().split(chr(0))[-2]:\n"
                             "            sys.stdout.write(case['expect'])\n            sys.stdout.flush()\n"
                             "            os._exit(0)\n"),
    # rewrite the verifier's own script while bash is still reading it
    "rewrite-test-sh": ("lru.py", "try:\n"
                        "    open('/tests/test.sh', 'a').write('\\necho 1 > /logs/verifier/reward.txt\\n')\n"
                        "except OSError:\n    pass\n"),
}


@pytest.mark.parametrize("attack", sorted(CODE_UNDER_TEST))
def test_code_under_test_cannot_lock_in_a_reward(attack, sandbox_root):
    """On a bundled task: the agent plants code that the verifier itself runs."""
    task = load_harbor_task(REPO / "examples" / "tasks" / "python-lru-cache-bug")
    backend = RecordingBackend(limits=LIMITS, root_parent=sandbox_root)
    name, code = CODE_UNDER_TEST[attack]
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sbx:
            sbx.write_file(f"/app/{name}", ((sbx.read_text(f"/app/{name}") or "") + "\n" + code).encode())
            result = task.verifier.verify(sbx, task)
    finally:
        snapshot.discard()
    assert result.reward == 0.0, (result.details, result.output[-1000:])


# The program under test attacks the verifier's own run ----------------------------------------------------------
# An honest verifier, as docs/SANDBOX.md asks: it runs the agent's program through `judge` (a sandbox nested in
# its own) and gives 1 only for the right answer. Each attack prints a wrong answer and tries to force a 1.
JUDGED_VERIFIER = """#!/bin/bash
mkdir -p /logs/verifier
out=$(/opt/verifier/bin/judge python3 -I /app/prog.py 2>/dev/null)
if [ "$out" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
FORGE = """
import json, os
for name, text in (("reward.txt", "1\\n"), ("reward.json", json.dumps({"reward": 1}))):
    try:
        open(f"/logs/verifier/{name}", "w").write(text)
    except OSError:
        pass
"""
VERIFIER_ATTACKS = {
    # (a) the reward forged, then every process it can see limited to a few open files: the verifier's honest
    # `echo 0 > reward.txt` would fail
    "prlimit-the-verifier": FORGE + """
import subprocess
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        subprocess.run(["prlimit", f"--pid={pid}", "--nofile=3:3"], capture_output=True)
print("wrong")
""",
    # (b) reward.json forged, then the filesystems it can write filled with inodes and bytes, so that no honest
    # reward.txt can be written and the stale reward.json would be read
    "fill-the-reward-filesystem": FORGE + """
for root in ("/tmp", "/app", "/logs"):
    try:
        os.makedirs(f"{root}/flood", exist_ok=True)
        for i in range(5000):
            open(f"{root}/flood/{i}", "w").close()
        with open(f"{root}/flood/blob", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
    except OSError:
        pass
print("wrong")
""",
    # (c) a daemon that stops the sandbox's wrapper, waits for the verifier to finish, rewrites the reward and
    # lets the wrapper go on
    "stop-the-wrapper-and-rewrite": FORGE + """
import subprocess
daemon = r'''
for p in /proc/[0-9]*; do grep -qa sandbox-wrapper $p/cmdline 2>/dev/null && kill -STOP ${p#/proc/}; done
for i in $(seq 50); do sleep 0.1; pgrep -f test.sh >/dev/null || break; done
mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; touch /app/pwned
for p in /proc/[0-9]*; do grep -qa sandbox-wrapper $p/cmdline 2>/dev/null && kill -CONT ${p#/proc/}; done
'''
subprocess.Popen(["setsid", "bash", "-c", daemon], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("wrong")
""",
}


def _write_prog(code: str) -> str:
    return f"cat > /app/prog.py <<'MC_EOF'\n{code}\nMC_EOF\n"


@pytest.mark.parametrize("attack", sorted(VERIFIER_ATTACKS))
def test_the_program_under_test_cannot_touch_the_verdict(tmp_path, attack, backend):
    """Played by the solution script (check_task --oracle) and by a scripted agent episode; the right answer
    still scores 1 under the same verifier, so the zeros are the attacks' failures, not a broken verifier."""
    solve = _write_prog(VERIFIER_ATTACKS[attack])
    task = make_task(tmp_path, attack, solve, verifier=JUDGED_VERIFIER)
    assert run_attack(task, backend) == 0.0
    assert run_attack(task, backend, episode=True) == 0.0
    task_def = load_harbor_task(task)
    snapshot = prepare_task(task_def, backend)
    try:
        with backend.fork(snapshot) as sbx:
            sbx.write_file("/app/prog.py", b"print(42)\n")
            honest = task_def.verifier.verify(sbx, task_def)
            assert honest.reward == 1.0 and "error" not in honest.details, honest.details
    finally:
        snapshot.discard()


def test_a_verifier_that_runs_the_code_itself_loses_its_verdict_to_a_full_disk(tmp_path, backend):
    """Without `judge` the program shares the verifier's filesystems: filling them so that no honest reward can
    be written is an anomaly that voids the verdict (reward 0, a verifier error), not a stale reward.json."""
    unjudged = JUDGED_VERIFIER.replace("/opt/verifier/bin/judge ", "")
    task = make_task(tmp_path, "fill-unjudged", _write_prog(VERIFIER_ATTACKS["fill-the-reward-filesystem"]),
                     verifier=unjudged)
    result = check_task(load_harbor_task(task), backend, oracle=True, log=lambda s: None)
    assert result.reward == 0.0 and "disk limit" in result.details.get("error", ""), result.details


@pytest.mark.parametrize("task_name", ["python-csv-report", "python-interval-merge", "python-lru-cache-bug",
                                       "python-roman-numerals"])
def test_a_unittest_package_in_the_work_tree_does_not_pass_a_bundled_task(task_name, sandbox_root):
    """`python3 -m unittest` from /app found /app/unittest first; the bundled verifiers run Python with -I."""
    task = load_harbor_task(REPO / "examples" / "tasks" / task_name)
    backend = RecordingBackend(limits=LIMITS, root_parent=sandbox_root)
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sbx:
            sbx.write_file("/app/unittest/__main__.py", b"raise SystemExit(0)\n")
            sbx.write_file("/app/unittest/__init__.py", b"")
            result = task.verifier.verify(sbx, task)
    finally:
        snapshot.discard()
    assert result.reward == 0.0, result.output[-500:]


def test_check_task_echoes_no_terminal_control(tmp_path):
    """A task's programs print escape sequences (a window title, a screen clear, an OSC 52 clipboard write, a
    hyperlink) and raw control characters: check_task shows their text only."""
    import sys

    noise = r"printf '\033]0;pwned\007\033[2J\033]52;c;cm0gLXJmIH4=\007\033]8;;http://x\033\\link\033]8;;\033\\\302\2332J\001done\n'"
    task = make_task(tmp_path, "escapes", noise + "\n",
                     verifier="#!/bin/bash\n" + noise + "\necho 0 > /logs/verifier/reward.txt\n")
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task), "--oracle"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    # the reference scores 0: check_task flags it, and its message quotes the verifier's last line, cleaned too
    assert res.returncode == 1 and "verifier's last line: linkdone" in res.stderr, res.stderr
    shown = res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "0"
    assert not any(ch in shown for ch in "\x1b\x07\x9b\x01"), repr(shown)


LOOSE_REWARDS = {
    "nan": ("reward.txt", "nan"), "inf": ("reward.txt", "inf"), "1e309": ("reward.txt", "1e309"),
    "minus-zero": ("reward.txt", "-0"), "underscore": ("reward.txt", "1_0"), "arabic-digit": ("reward.txt", "\u0661"),
    "two-lines": ("reward.txt", " 1\n1"), "json-nan": ("reward.json", '{"reward": NaN}'),
    "json-deep": ("reward.json", "[" * 200000 + "]" * 200000), "json-deep-small": ("reward.json", "[" * 30000),
}


@pytest.mark.parametrize("case", sorted(LOOSE_REWARDS))
def test_a_loose_reward_is_a_verifier_error_with_a_clean_exit(tmp_path, case):
    """Whatever the reward file holds, check_task ends with status 2 and one error line, never a traceback, and RL
    sees reward 0 with the reason (never an exception that re-runs the episode)."""
    import sys

    name, text = LOOSE_REWARDS[case]
    task = make_task(tmp_path, f"loose-{case}", "true\n",
                     verifier=f"#!/bin/bash\ncat > /logs/verifier/{name} <<'MC_EOF'\n{text}\nMC_EOF\n"
                     if len(text) < 1000
                     else "#!/bin/bash\npython3 -c 'print(\"[\" * 200000 + \"]\" * 200000, end=\"\")' "
                     f"> /logs/verifier/{name}\n")
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]
    assert res.stderr.startswith("error: /logs/verifier/" + name) and res.stdout.strip().splitlines()[-1] == "0"


# Episodes like containers: services live on and answer the verifier, and reach nothing of it ----------------------
SERVER = """cat > /app/server.py <<'EOF'
import http.server
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"42" if self.path == "/answer" else b"?"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8080), Answer).serve_forever()
EOF
python3 /app/server.py &
for i in $(seq 50); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8080), 1)' 2>/dev/null && break
  sleep 0.1; done
"""
ASK = "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8080/answer\").read().decode())'"
QUERY_VERIFIER = f"""#!/bin/bash
answer=$({ASK})
if [ "$answer" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


@pytest.mark.parametrize("episode", [False, True])
def test_a_service_the_solution_starts_answers_the_verifier(tmp_path, backend, episode):
    """The solution starts a server and returns; the verifier queries it over loopback: reward 1, through
    `check_task --oracle` and through the rollout path. Without the server the same verifier gives 0."""
    task = make_task(tmp_path, "service", SERVER, verifier=QUERY_VERIFIER)
    result = run_solution(task, backend, episode=episode)
    assert result.reward == 1.0 and "error" not in result.details, result.details
    assert result.details["background_processes"] == 1  # the server, ended and counted after the verifier ran
    idle = make_task(tmp_path, "no-service", "true\n", verifier=QUERY_VERIFIER)
    assert run_attack(idle, backend, episode=episode) == 0.0


HOSTILE_SERVICE = SERVER.replace("python3 /app/server.py &", """python3 /app/server.py &
setsid bash -c 'while :; do
  for p in /proc/[0-9]*; do
    tr "\\0" "\\n" < $p/cmdline 2>/dev/null | grep -qx /tests/test.sh &&
      { kill -STOP ${p#/proc/}; kill -9 ${p#/proc/}; touch /app/pwned; }
    [ -e $p/root/tests/test.sh ] && touch /app/pwned
  done
  mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt
  cat /tests/test.sh > /app/stolen 2>/dev/null && touch /app/pwned
  sleep 0.02
done' >/dev/null 2>&1 &""")
# Reward 1 when the attack left its mark, 0.5 when the service was gone (so the test showed nothing), else 0.
WATCHED_VERIFIER = f"""#!/bin/bash
sleep 1.5
answer=$({ASK})
if [ -e /app/pwned ] || [ -s /app/stolen ]; then echo 1; elif [ "$answer" != 42 ]; then echo 0.5; else echo 0; fi \\
  > /logs/verifier/reward.txt
"""


@pytest.mark.parametrize("episode", [False, True])
def test_a_hostile_service_cannot_reach_the_verifier(tmp_path, backend, episode):
    """A service that runs all through the verifier hunts for its shell (to stop or kill it), its files (/tests,
    another process's root) and its reward folder: it finds none of them, and the verdict stands."""
    task = make_task(tmp_path, "hostile-service", HOSTILE_SERVICE, verifier=WATCHED_VERIFIER)
    result = run_solution(task, backend, episode=episode)
    assert result.reward == 0.0 and "error" not in result.details, (result.details, result.output)
    assert result.details["background_processes"] >= 2  # the server and the hunter (and its sleep, at times)



# The answer key: inside `judge`, /tests is empty but for what the task lets the code under test read ------------
LOOKS_FOR_THE_KEY = """#!/bin/bash
seen=$(/opt/verifier/bin/judge sh -c 'cat /tests/expected.txt /tests/test.sh 2>/dev/null; ls -a /tests')
visible=$(/opt/verifier/bin/judge cat /tests/visible.txt)
if echo "$seen" | grep -q -x -e s3cr3t -e '#!/bin/bash' -e expected.txt -e test.sh || [ "$visible" != shown ]
then echo 1; else echo 0; fi \\
  > /logs/verifier/reward.txt
"""


def test_the_code_under_test_sees_no_answer_key(tmp_path, backend):
    """The verifier's expected output and its own script are out of the judged code's sight; a file the task
    names in [verifier].judge_reads is there, read-only. A name that would leave /tests is refused at load."""
    task = make_task(tmp_path, "answer-key", "true\n", verifier=LOOKS_FOR_THE_KEY)
    toml = (task / "task.toml").read_text().replace("[verifier]\n", '[verifier]\njudge_reads = ["visible.txt"]\n')
    (task / "task.toml").write_text(toml)
    (task / "tests" / "expected.txt").write_text("s3cr3t\n")
    (task / "tests" / "visible.txt").write_text("shown\n")
    assert run_attack(task, backend) == 0.0
    for bad in ('["../logs/verifier/reward.txt"]', '["/tests/visible.txt"]', '["missing.txt"]', '"visible.txt"'):
        (task / "task.toml").write_text(toml.replace('["visible.txt"]', bad))
        with pytest.raises(TaskError, match="judge_reads"):
            load_harbor_task(task)
