"""The verifier judges a frozen copy in a world of its own, and the host never writes through what a task made.

One hostile task per class of attack on that boundary: the agent's commands are the attack (they leave services
running, links and files), the verifier is honest and, where it says so, written the old way (it copies into the work
tree, trusts a path, runs a reference server). Each attack gives 0 through `check_task --oracle` and through an
episode (the rollout path), and the host is unchanged: no file written through a link (a canary outside every
sandbox), nothing left running or mounted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.sandbox.local import LocalSandbox, bwrap_problem
from tests.hostile_assets import LIMITS, RecordingBackend, make_task, run_attack, run_solution

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

PLAYED_BY = pytest.mark.parametrize("episode", [False, True], ids=["check_task", "episode"])


@pytest.fixture
def backend(sandbox_parent):
    return RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent))


def _canary(tmp_path: Path) -> Path:
    canary = tmp_path / "canary"
    canary.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(canary, 0o777)  # writable by anyone: only a write *through* the host could reach it, and must not
    (canary / "host-file.txt").write_text("host data\n")
    return canary


# 1. Services share the verifier's live files -------------------------------------------------------------------
REWRITES_THE_TEST = """\
setsid bash -c 'while :; do
  [ -f /app/test_it.py ] && ! grep -q forged /app/test_it.py && echo "print(\\"forged\\")" > /app/test_it.py
  [ -d /app/venv/bin ] && [ ! -e /app/venv/bin/check ] && printf "#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n" \\
    > /app/venv/bin/check && chmod +x /app/venv/bin/check
  if [ -L /app/out.txt ]; then rm -f /app/out.txt; echo wrong > /app/out.txt
  else rm -f /app/out.txt; ln -s /tests/expected.txt /app/out.txt; fi
  sleep 0.005
done' >/dev/null 2>&1 &
"""
# The old way: copies its test into the work tree, builds a helper folder there, checks a file then compares it.
COPIES_INTO_THE_WORK_TREE = """#!/bin/bash
cp /tests/test_it.py /app/test_it.py; mkdir -p /app/venv/bin
ok=1
for i in $(seq 20); do
  [ -f /app/out.txt ] && [ ! -L /app/out.txt ] && cmp -s /app/out.txt /tests/expected.txt && echo 1 > /tmp/matched
  sleep 0.01
done
[ -e /tmp/matched ] || ok=0
[ "$(python3 /app/test_it.py)" = forged ] && ok=1
[ -x /app/venv/bin/check ] && /app/venv/bin/check && exit 0
echo $ok > /logs/verifier/reward.txt
"""


@PLAYED_BY
def test_services_cannot_change_what_the_verifier_reads(tmp_path, backend, episode):
    task = make_task(tmp_path, "live-files", REWRITES_THE_TEST, verifier=COPIES_INTO_THE_WORK_TREE)
    (task / "tests" / "test_it.py").write_text("print('honest')\n")
    (task / "tests" / "expected.txt").write_text("the answer\n")
    assert run_attack(task, backend, episode=episode) == 0.0


# 2. Shared system paths -------------------------------------------------------------------------------------------
SYSTEM_PATHS = """\
rm -rf /var/tmp 2>/dev/null; ln -s /app /var/tmp 2>/dev/null
echo "127.0.0.2 localhost" >> /etc/hosts
cat > /app/solution.py <<'EOF'
import os
for where in ("/app/expected.txt", "/var/tmp/expected.txt"):
    if os.path.exists(where):
        print(open(where).read(), end="")
        raise SystemExit
print("no idea")
EOF
cat > /app/forged.py <<'EOF'
import http.server
class Forged(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"42")
http.server.HTTPServer(("127.0.0.2", 8099), Forged).serve_forever()
EOF
setsid python3 /app/forged.py >/dev/null 2>&1 &
sleep 0.5
"""
# Puts the answer in /var/tmp while the judged code runs (judge gives it a /tmp and /var/tmp of its own; the work tree
# is shared), and asks `localhost` for a value.
TRUSTS_SYSTEM_PATHS = """#!/bin/bash
cp /tests/expected.txt /var/tmp/expected.txt
out=$(/opt/verifier/bin/judge python3 /app/solution.py)
got=$(python3 -c 'import urllib.request as u; print(u.urlopen("http://localhost:8099/", timeout=3).read().decode())' \\
      2>/dev/null)
if [ "$out" = "$(cat /tests/expected.txt)" ] || [ "$got" = 42 ]; then echo 1; else echo 0; fi \\
  > /logs/verifier/reward.txt
"""


@PLAYED_BY
def test_shared_system_paths_are_the_agents_no_more(tmp_path, backend, episode):
    """/var is root's (its /var/tmp cannot become a link into the work tree the judged code shares), and the
    verifier's /etc/hosts keeps `localhost` its own."""
    task = make_task(tmp_path, "system-paths", SYSTEM_PATHS, verifier=TRUSTS_SYSTEM_PATHS)
    (task / "tests" / "expected.txt").write_text("s3cr3t\n")
    assert run_attack(task, backend, episode=episode) == 0.0


def test_an_images_folders_on_the_path_are_not_the_agents(tmp_path, image_base, sandbox_parent):
    """An image whose PATH names /opt/tools/bin: the agent cannot put a `bash` there for the verifier to run."""
    backend = RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent), build_images=True)
    solve = ("mkdir -p /opt/tools/bin; printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' "
             "> /opt/tools/bin/bash; chmod +x /opt/tools/bin/bash; true\n")
    task = make_task(tmp_path, "image-path", solve, dockerfile="FROM debian:bookworm\nWORKDIR /app\n"
                     "RUN mkdir -p /opt/tools/bin\nENV PATH=/opt/tools/bin:$PATH\n",
                     verifier="#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
    assert run_attack(task, backend) == 0.0


# 3. Shared network ------------------------------------------------------------------------------------------------
TAKES_THE_PORT = """\
cat > /app/forged.py <<'EOF'
import http.server
class Forged(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"reference")
http.server.HTTPServer(("127.0.0.1", 8097), Forged).serve_forever()
EOF
setsid python3 /app/forged.py >/dev/null 2>&1 &
cat > /app/relay.py <<'EOF'
import array, os, socket
s = socket.socket(socket.AF_UNIX)
s.bind("\\0mc-reward-relay")
s2 = socket.socket(socket.AF_UNIX)
s2.bind("/app/relay.sock")
for sock in (s, s2):
    sock.listen(4)
    sock.setblocking(False)
import time
while True:
    for sock in (s, s2):
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            continue
        fds = array.array("i")
        msg, anc, _, _ = conn.recvmsg(16, socket.CMSG_LEN(4))
        for level, kind, data in anc:
            fds.frombytes(data[:4])
        for fd in fds:  # the verifier's reward folder: write 1 into it, now and later
            for _ in range(100):
                with open(os.open("reward.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd), "w") as f:
                    f.write("1\\n")
                time.sleep(0.02)
    time.sleep(0.01)
EOF
setsid python3 /app/relay.py >/dev/null 2>&1 &
cat > /app/solution.py <<'EOF'
import os, socket
fd = os.open("/logs/verifier", os.O_RDONLY | os.O_DIRECTORY)
for where in ("\\0mc-reward-relay", "/app/relay.sock"):
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(where)
        c.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])
    except OSError:
        pass
EOF
sleep 0.5
"""
# Runs its own reference server on 8097 and compares; runs the code under test directly (the old way).
OWN_REFERENCE_SERVER = """#!/bin/bash
mkdir -p /tmp/site && echo -n truth > /tmp/site/index.html
python3 -m http.server 8097 --bind 127.0.0.1 --directory /tmp/site >/dev/null 2>&1 &
for i in $(seq 50); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8097), 1)' 2>/dev/null && break
  sleep 0.1; done
got=$(python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8097/").read().decode())')
python3 /app/solution.py
sleep 0.5
if [ "$got" = reference ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
sleep 0.5
"""


@PLAYED_BY
def test_the_verifier_has_a_network_of_its_own(tmp_path, backend, episode):
    """A service that took the verifier's reference port first does not answer it (a port the verifier binds is its
    own), and the code under test reaches no service over an abstract unix socket or a socket file to hand it the
    reward folder."""
    from rl.sandbox.netns import nft_problem

    if nft_problem() is not None:
        pytest.skip(f"a published port gives way to the verifier's own only with nftables: {nft_problem()}")
    task = make_task(tmp_path, "network", TAKES_THE_PORT, verifier=OWN_REFERENCE_SERVER)
    assert run_attack(task, backend, episode=episode) == 0.0


PUBLISHED = """\
cat > /app/serve.py <<'EOF'
import http.server, socketserver, threading
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"42")
http.server.HTTPServer(("0.0.0.0", 8095), Answer).serve_forever()
EOF
setsid python3 /app/serve.py >/dev/null 2>&1 &
python3 -c '
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 8094))
open("/app/udp-ready", "w").close()
while True:
    data, addr = s.recvfrom(100); s.sendto(data.upper(), addr)' >/dev/null 2>&1 &
sleep 0.5
"""
ASKS_THE_SERVICES = """#!/bin/bash
tcp=$(python3 -c 'import urllib.request; print(urllib.request.urlopen("http://localhost:8095/").read().decode())')
udp=$(python3 -c '
import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
s.sendto(b"ping", ("127.0.0.1", 8094)); print(s.recv(100).decode())')
if [ "$tcp" = 42 ] && [ "$udp" = PING ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def test_the_episodes_services_are_published_to_the_verifier(tmp_path, backend):
    """What the agent left listening (TCP and UDP) answers the verifier on loopback, as a published port."""
    task = make_task(tmp_path, "published", PUBLISHED, verifier=ASKS_THE_SERVICES)
    assert run_attack(task, backend) == 1.0


# 4. The code under test reaching into the verifier's shell ---------------------------------------------------------
INTO_THE_SHELL = """\
cat > /app/solution.py <<'EOF'
import ctypes, os, re
out = []
try:  # rewrite the verifier shell's copy of its script: `echo 0` becomes `echo 1`
    maps = open("/proc/1/maps").read()
    with open("/proc/1/mem", "r+b", buffering=0) as mem:
        for line in maps.splitlines():
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "rw" not in line.split()[1]:
                continue
            try:
                mem.seek(start); data = mem.read(end - start)
            except OSError:
                continue
            for m in re.finditer(rb"echo 0 > /logs/verifier/reward.txt", data):
                mem.seek(start + m.start() + 5); mem.write(b"1")
    out.append("mem")
except OSError as e:
    out.append(f"mem:{e.errno}")
for name in ("environ", "fd"):
    try:
        os.listdir(f"/proc/1/{name}") if name == "fd" else open(f"/proc/1/{name}").read()
        out.append(name)
    except OSError as e:
        out.append(f"{name}:{e.errno}")
libc = ctypes.CDLL(None, use_errno=True)
class rlimit(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
r = rlimit(0, 0)  # the shell could not open its next file, nor fork
out.append("prlimit" if libc.prlimit(1, 7, ctypes.byref(r), None) == 0 else f"prlimit:{ctypes.get_errno()}")
print(" ".join(out))
EOF
"""
RUNS_THE_CODE_ITSELF = """#!/bin/bash
python3 /app/solution.py > /tmp/reached
sleep 0.2
echo 0 > /logs/verifier/reward.txt
"""


@PLAYED_BY
def test_the_code_under_test_cannot_reach_the_verifiers_shell(tmp_path, backend, episode):
    """/proc/1/mem, environ and fd of the verifier's shell are closed to what it runs (the shell is not dumpable),
    and so are another process's limits (prlimit64 with a pid) and perf_event_open (seccomp)."""
    task = make_task(tmp_path, "shell-memory", INTO_THE_SHELL, verifier=RUNS_THE_CODE_ITSELF)
    result = run_solution(task, backend, episode=episode)
    assert result.reward == 0.0 and "error" not in result.details, result.details


def test_the_verifiers_processes_are_not_dumpable_and_its_own_run_as_usual(sandbox_parent):
    with LocalSandbox(None, root_parent=str(sandbox_parent)) as sbx:
        sbx.enter_verifier()
        res = sbx.exec("cat /proc/1/environ >/dev/null 2>&1 && echo open; "
                       "python3 -c 'import sys; print(sys.version_info[0])'; bash -c 'echo nested'")
        assert res.output.split() == ["3", "nested"], res.output


# 5. The host writes through links as root -------------------------------------------------------------------------
def _multi_step(tmp_path: Path, canary: Path) -> Path:
    task = tmp_path / "multi-step-links"
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (task / "instruction.md").write_text("Two steps.\n")
    (task / "task.toml").write_text('version = "1.1"\n[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n')
    for name, solve in (("one", f"ln -s {canary} /app/data; ln -s {canary}/host-file.txt /app/notes.txt; true\n"),
                        ("two", "true\n")):
        step = task / "steps" / name
        for d in ("tests", "solution", "workdir"):
            (step / d).mkdir(parents=True)
        (step / "instruction.md").write_text(f"Step {name}.\n")
        (step / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
        (step / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    (task / "steps" / "two" / "workdir" / "data").mkdir()
    (task / "steps" / "two" / "workdir" / "data" / "host-file.txt").write_text("overwritten\n")
    (task / "steps" / "two" / "workdir" / "notes.txt").write_text("overwritten\n")
    return task


def test_a_multi_step_copy_in_never_follows_a_link_the_agent_left(tmp_path, backend):
    canary = _canary(tmp_path)
    task = _multi_step(tmp_path, canary)
    result = run_solution(task, backend, watched=[canary / "host-file.txt"])
    assert result.reward == 0.0 and sorted(os.listdir(canary)) == ["host-file.txt"]
    assert (canary / "host-file.txt").read_text() == "host data\n"


def test_a_dockerfile_copy_never_follows_a_link_a_run_step_left(tmp_path, image_base, sandbox_parent):
    canary = _canary(tmp_path)
    backend = RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent), build_images=True)
    task = make_task(tmp_path, "copy-through", "true\n", verifier="#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n",
                     dockerfile=f"FROM debian:bookworm\nWORKDIR /app\nRUN ln -s {canary} /opt/out && "
                                f"ln -s {canary}/host-file.txt /opt/file\nCOPY files/ /opt/out/\n"
                                "COPY files/host-file.txt /opt/file\n")
    (task / "environment" / "files").mkdir()
    (task / "environment" / "files" / "host-file.txt").write_text("overwritten\n")
    (task / "environment" / "files" / "new.txt").write_text("new\n")
    assert run_attack(task, backend, watched=[canary / "host-file.txt"]) == 0.0
    assert sorted(os.listdir(canary)) == ["host-file.txt"]


# 9. The verifier's machinery does not depend on the agent's state ------------------------------------------------
def test_what_the_agent_left_never_makes_the_verifier_raise(tmp_path, backend):
    """A folder where a log goes, the process-limit message in the verifier's output, an episode that ended before
    the verifier: the verdict is the verifier's (here 0), never an exception."""
    task = make_task(tmp_path, "machinery", "mkdir -p /var/log/entrypoint.log /run/x; true\n",
                     verifier="#!/bin/bash\necho 'bash: fork: retry: Resource temporarily unavailable'\n"
                              "echo 0 > /logs/verifier/reward.txt\n",
                     dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nCOPY ep.sh /app/ep.sh\nENTRYPOINT [\"/app/ep.sh\"]\n")
    (task / "environment" / "ep.sh").write_text("#!/bin/bash\nexec \"$@\"\n")
    os.chmod(task / "environment" / "ep.sh", 0o755)
    for episode in (False, True):
        result = run_solution(task, backend, episode=episode,
                              before_verifier=(lambda sbx: sbx.end_episode()) if episode else None)
        assert result.reward == 0.0 and "error" not in result.details, result.details


def test_check_task_reports_the_verdict_of_a_frozen_copy(tmp_path, sandbox_parent):
    """Everything the agent left is the verifier's data (HOME, /tmp, /var/tmp), as in a container."""
    task = make_task(tmp_path, "data", "mkdir -p ~/.jupyter && echo cfg > ~/.jupyter/c.json; echo t > /tmp/t; "
                     "echo v > /var/tmp/v\n",
                     verifier="#!/bin/bash\nif [ \"$(cat ~/.jupyter/c.json /tmp/t /var/tmp/v)\" = \"$(printf "
                              "'cfg\\nt\\nv')\" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    result = check_task(load_harbor_task(task), RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent)),
                        oracle=True, log=lambda s: None)
    assert result.reward == 1.0, result.details
    shutil.rmtree(task)


def test_a_separate_verifier_gets_the_prepared_task_and_only_the_declared_artifacts(tmp_path, sandbox_parent):
    """Harbor's environment_mode = "separate": the verifier starts from the prepared task (not the episode), with
    the artifacts the task declares copied over as regular files (links and undeclared files are not), and no
    process of the episode's published to it."""
    backend = RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "given.txt").write_text("given\n")
    with backend.create(tree) as base:
        snapshot = base.snapshot()
    try:
        with backend.fork(snapshot) as sbx:
            sbx.exec("mkdir -p /app/out/sub && echo result > /app/out/sub/r.txt && ln -s /etc/passwd /app/out/pw && "
                     "echo hidden > /app/undeclared.txt && echo changed > /app/given.txt && ln -s /app/out /app/link "
                     "&& (setsid python3 -m http.server 8093 --bind 127.0.0.1 >/dev/null 2>&1 &) && sleep 0.5")
            sbx.enter_verifier(separate=True, artifacts=["/app/out", "/app/link", "/app/missing"])
            res = sbx.exec("find /app | sort; cat /app/given.txt; python3 -c 'import socket; "
                           "socket.create_connection((\"127.0.0.1\", 8093), 2)' 2>/dev/null && echo reached")
            assert res.output.split() == ["/app", "/app/given.txt", "/app/out", "/app/out/sub", "/app/out/sub/r.txt",
                                          "given"], res.output
    finally:
        snapshot.discard()


def test_the_agent_and_the_verifier_run_as_the_users_a_task_names(test_image, sandbox_parent):
    """A user of the image's /etc/passwd for either phase (root for the verifier by default); root is not given to
    the agent (the verifier runs on the image's system, which the agent must not change)."""
    with LocalSandbox(None, image=test_image, user="nobody", root_parent=str(sandbox_parent)) as sbx:
        assert sbx.exec("id -u; echo $HOME").output.split() == ["65534", "/nonexistent"]
        sbx.enter_verifier()
        assert sbx.exec("id -u").output.split() == ["0"]
        sbx.enter_verifier(user="nobody")
        assert sbx.exec("id -u").output.split() == ["65534"]
    with LocalSandbox(None, image=test_image, user="root", root_parent=str(sandbox_parent)) as sbx:
        assert sbx.exec("id -u").output.split() == ["1000"]
    with pytest.raises(Exception, match="not in its image's /etc/passwd"):
        LocalSandbox(None, image=test_image, user="no-such-user", root_parent=str(sandbox_parent))


def _digest(folder: Path) -> dict:
    """Every entry of a folder: its type, mode, owner, size, content digest, link target (never followed)."""
    import hashlib
    import stat as st

    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            s = os.lstat(path)
            if st.S_ISREG(s.st_mode):
                extra = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif st.S_ISLNK(s.st_mode):
                extra = os.readlink(path)
            else:
                extra = None
            out[os.path.relpath(path, folder)] = (st.S_IFMT(s.st_mode), st.S_IMODE(s.st_mode), s.st_uid, s.st_size,
                                                  extra)
    return out


WRITE_EVERYWHERE = r"""
# every folder of the sandbox this user can write into, and every file it can open for writing
find / -xdev \( -path /proc -o -path /sys -o -path /dev \) -prune -o -writable -print 2>/dev/null |
  while IFS= read -r p; do
    if [ -d "$p" ]; then echo mine > "$p/.mc-written" 2>/dev/null; else echo mine >> "$p" 2>/dev/null; fi
  done
for p in /usr/bin/python3 /usr/local/bin/uv /etc/passwd /opt/tool/version /bin/sh; do
  echo evil >> "$p" 2>/dev/null; rm -f "$p" 2>/dev/null; done
echo done
"""


def test_an_episode_that_writes_everywhere_changes_nothing_below_its_own_layer(test_image, sandbox_parent, tmp_path):
    """An episode writes into every path it can (and tries the image's system); its verifier writes too. Forks of
    the same prepared task start as before, and the image's layers and the prepared task's layer are unchanged."""
    backend = RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "given.txt").write_text("given\n")
    with backend.create(tree, image=test_image) as base:
        snapshot = base.snapshot()
    before = {str(layer): _digest(layer) for layer in snapshot.layers}
    try:
        with backend.fork(snapshot) as sbx:
            res = sbx.exec(WRITE_EVERYWHERE, timeout=60)
            assert res.output.strip().endswith("done"), res.output
            assert sbx.exec("cat /app/given.txt").output.startswith("given\nmine")  # its own copy changed
            sbx.enter_verifier()
            sbx.exec(WRITE_EVERYWHERE, timeout=60)
        with backend.fork(snapshot) as fresh:
            res = fresh.exec("cat /app/given.txt /opt/tool/version; ls -a /app /tmp /root | grep -c mc-written")
            assert res.output.split() == ["given", "tool", "0"], res.output
    finally:
        after = {str(layer): _digest(layer) for layer in snapshot.layers}
        snapshot.discard()
    assert after == before


def test_a_task_in_separate_mode_is_judged_on_its_artifacts_alone(tmp_path, sandbox_parent):
    """task.toml's [verifier] environment_mode = "separate" with its `artifacts`: through check_task, the verifier
    sees the declared file (as a regular file) and nothing else of the agent's, and its reward follows."""
    verifier = ("#!/bin/bash\nif [ \"$(cat /app/out.txt)\" = 42 ] && [ ! -e /app/scratch.txt ] && [ ! -L /app/out.txt ]"
                " && [ ! -e /app/key.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    solve = "echo 42 > /app/out.txt; echo junk > /app/scratch.txt; ln -s /tests/key /app/key.txt\n"
    toml = 'artifacts = ["/app/out.txt", "/app/key.txt"]\n'
    task = make_task(tmp_path, "separate", solve, verifier=verifier, toml=toml)
    text = (task / "task.toml").read_text().replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    (task / "task.toml").write_text(toml + text.replace(toml, ""))
    backend = RecordingBackend(limits=LIMITS, root_parent=str(sandbox_parent))
    assert run_attack(task, backend) == 1.0
    shared = make_task(tmp_path, "shared", solve, verifier=verifier)
    assert run_attack(shared, backend) == 0.0  # the default: the agent's whole frozen world, scratch.txt included
