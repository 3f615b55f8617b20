"""Container engines (docker, podman, apptainer): the same task contract as LocalSandbox, and on docker and podman
the same rewards as the local backend for the same tasks, built on the same local Debian base where this host can
build it (no registry needed), and each task prepared once per digest. The tests that run an engine are long
(marked e2e): `make test-docker` and `make test-podman` run them, not `make test`; they skip, with the reason, where
an engine is missing or cannot run containers."""

import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import prepare_task
from rl.sandbox import SandboxError, SandboxLimits
from rl.sandbox.base import Service
from rl.sandbox.container import (
    ENGINES,
    ContainerSnapshot,
    copy_into_folders,
    engine_problem,
    entrypoint_argv,
    make_container_backend,
    missing_images,
    tree_digest,
)
from rl.sandbox.image import ImageBuilder, build_problem
from rl.sandbox.local import LocalBackend
from tests.unit.envs.test_envs_images import TB2_UVX, built_task, service_task

REPO = Path(__file__).resolve().parents[3]


def _backend(engine):
    problem = engine_problem(engine)
    if problem:
        pytest.skip(f"{engine}: {problem}")
    return make_container_backend(engine, SandboxLimits(command_timeout_s=60), local_base=build_problem() is None)


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_the_same_tasks_give_the_same_rewards_as_the_local_backend(engine, tmp_path):
    """A bundled task (the host's system stands in locally), a task that must be built (apt, pip, files outside
    /app), one whose image's ENTRYPOINT starts a service on port 80 under a name of its /etc/hosts, and a verifier
    that fetches uv: untouched and solved, the engine's reward is the local backend's."""
    backend = _backend(engine)
    if not backend.local_base:
        pytest.skip(f"no local base to build on: {build_problem()}")
    tasks = [REPO / "examples" / "tasks" / "python-csv-report", built_task(tmp_path / "built"),
             service_task(tmp_path / "service")]
    uvx = built_task(tmp_path / "uvx", dockerfile="FROM ubuntu:24.04\nWORKDIR /opt/project\nCOPY data data\n")
    (uvx / "tests" / "test.sh").write_text(TB2_UVX)
    (uvx / "solution" / "solve.sh").write_text(
        "#!/bin/bash\npython3 -c \"import json; print(sum(i['n'] for i in json.load(open('data/items.json'))))\" "
        "> answer.txt\n")
    (uvx / "tests" / "test_outputs.py").write_text(
        "import json\nfrom pathlib import Path\n\n\ndef test_answer():\n"
        "    items = json.loads(Path('data/items.json').read_text())\n"
        "    assert Path('answer.txt').read_text().strip() == str(sum(i['n'] for i in items))\n")
    local = LocalBackend()
    for task_dir in tasks + [uvx]:
        task = load_harbor_task(task_dir)
        for oracle in (False, True):
            mine = check_task(task, local, oracle=oracle, log=lambda s: None).reward
            theirs = check_task(task, backend, oracle=oracle, log=lambda s: None)
            assert theirs.reward == mine == float(oracle), (task_dir.name, oracle, theirs.output[-2000:])


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ENGINES)
def test_task_untouched_zero_oracle_one(engine):
    backend = _backend(engine)
    task = load_harbor_task(REPO / "examples" / "tasks" / "python-lru-cache-bug")
    assert check_task(task, backend, oracle=False, log=lambda s: None).reward == 0.0
    assert check_task(task, backend, oracle=True, log=lambda s: None).reward == 1.0


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ENGINES)
def test_container_has_no_network_and_kills_on_timeout(engine):
    backend = _backend(engine)
    with backend.create(None) as sbx:
        res = sbx.exec("python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 80))\"")
        assert res.exit_code != 0
        res = sbx.exec("trap '' TERM; while :; do :; done", timeout=2)
        assert res.timed_out
        assert sbx.exec("echo alive").output == "alive\n"


COMPOSE = """\
services:
  main:
    depends_on:
      api:
        condition: service_healthy
  api:
    build:
      context: ./api
    environment:
      - GREETING=${MC_TEST_GREETING:-hello from api}
    expose: ["5000"]
    healthcheck:
      test: ["CMD", "python3", "-c", "import socket; socket.create_connection(('localhost', 5000), timeout=2)"]
      interval: 1s
      timeout: 5s
      retries: 30
"""
API_SERVER = """\
import http.server, os
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(os.environ["GREETING"].encode())
http.server.HTTPServer(("127.0.0.1", 5000), Answer).serve_forever()
"""


def multi_container_task(root: Path, server: str = API_SERVER) -> Path:
    """Harbor's multi-container recipe in small: an api service built from its own Dockerfile beside the task's
    container, reached by its name; the agent and the verifier query it."""
    task = root / "multi-container"
    files = {"instruction.md": "Write what http://api:5000/ answers to /app/answer.txt.\n",
             "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n',
             "environment/Dockerfile": "FROM python:3.12-slim\nWORKDIR /app\n",
             "environment/docker-compose.yaml": COMPOSE,
             "environment/api/Dockerfile": "FROM python:3.12-slim\nWORKDIR /srv\nCOPY server.py .\n"
                                           'CMD ["python3", "server.py"]\n',
             "environment/api/server.py": server,
             "solution/solve.sh": "#!/bin/bash\npython3 -c \"import urllib.request; open('/app/answer.txt', 'wb')."
                                  "write(urllib.request.urlopen('http://api:5000/').read())\"\n",
             "tests/test.sh": "#!/bin/bash\nlive=$(python3 -c \"import urllib.request; print(urllib.request."
                              "urlopen('http://api:5000/').read().decode(), end='')\")\n"
                              "if [ \"$live\" = 'hello from api' ] && [ \"$(cat /app/answer.txt 2>/dev/null)\" = "
                              "\"$live\" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > "
                              "/logs/verifier/reward.txt; fi\n"}
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_multi_container_task_runs_beside_its_services(engine, tmp_path):
    """The compose file's other service is built (on the local base) and started beside the task's container,
    sharing only loopback, its name in /etc/hosts, waited for until healthy: 0 untouched, 1 solved. A service that
    never becomes healthy is one line with its last output, and leaves no container behind."""
    backend = _backend(engine)
    if not backend.local_base:
        pytest.skip(f"no local base to build on: {build_problem()}")
    task = load_harbor_task(multi_container_task(tmp_path / "ok"))
    assert check_task(task, backend, oracle=False, log=lambda s: None).reward == 0.0
    solved = check_task(task, backend, oracle=True, log=lambda s: None)
    assert solved.reward == 1.0, solved.output[-2000:]
    broken = multi_container_task(tmp_path / "broken", server="raise SystemExit('no config file: /srv/app.toml')\n")
    (broken / "environment" / "docker-compose.yaml").write_text(
        COMPOSE.replace("retries: 30", "retries: 2").replace("interval: 1s", "interval: 0.2s"))
    task = load_harbor_task(broken)
    snapshot = prepare_task(task, backend)
    before = subprocess.run([engine, "ps", "-aq"], capture_output=True, text=True).stdout.split()
    try:
        with pytest.raises(SandboxError) as e:
            backend.fork(snapshot)
    finally:
        snapshot.discard()
    (line,) = str(e.value).splitlines()
    assert "the service api did not become healthy" in line and "no config file: /srv/app.toml" in line, line
    after = subprocess.run([engine, "ps", "-aq"], capture_output=True, text=True).stdout.split()
    assert set(after) <= set(before)


ROOTLESS_USER = os.environ.get("MC_ROOTLESS_USER") or None  # `make test-podman` makes mc-rootless (on a root host)


def _rootless_problem() -> str | None:
    """Why podman cannot be tried rootless here: this test runs as root and becomes ROOTLESS_USER (with subuid
    ranges) for the engine, running check_task with the system's python3."""
    if ROOTLESS_USER is None:
        return "MC_ROOTLESS_USER names no user to try podman rootless as (make test-podman sets it)"
    if os.geteuid() != 0:
        return "the rootless test starts as root to become its user"
    try:
        pwd.getpwnam(ROOTLESS_USER)
    except KeyError:
        return f"no user {ROOTLESS_USER} (make test-podman makes it, with subuid ranges)"
    if engine_problem("podman") or build_problem():
        return engine_problem("podman") or build_problem()
    probe = _as_rootless(["/usr/bin/python3", "-c", "import rl.envs.check_task"])
    return None if probe.returncode == 0 else (f"{ROOTLESS_USER}'s python3 cannot import the checker: "
                                               f"{probe.stderr[-200:]}")


def _as_rootless(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", ROOTLESS_USER, "--", "env", f"PYTHONPATH={REPO}", "HOME=" +
                           pwd.getpwnam(ROOTLESS_USER).pw_dir, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.e2e
def test_rootless_podman_gives_the_same_rewards(tmp_path_factory):
    """podman as an ordinary user (subuid ranges, no root): a task whose ENTRYPOINT serves on port 80 and a
    multi-container task, untouched and solved, give the rewards the local backend and root podman give."""
    if (why := _rootless_problem()) is not None:
        pytest.skip(why)
    ImageBuilder().base_archive()  # root writes the base's archive once; the user's podman imports it
    shared = Path(tempfile.mkdtemp(prefix="mc-rootless-"))
    try:
        shared.chmod(0o755)
        tasks = [service_task(shared / "a"), multi_container_task(shared / "b")]
        for task_dir in tasks:
            for oracle in (False, True):
                res = _as_rootless(["/usr/bin/python3", "tools/check_task.py", str(task_dir), "--backend", "podman",
                                    "--local-base"] + (["--oracle"] if oracle else []))
                assert res.returncode == 0 and res.stdout.splitlines()[-1] == str(int(oracle)), (
                    task_dir.name, oracle, res.stdout[-1500:], res.stderr[-1500:])
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _image_ids(engine: str) -> set[str]:
    """Every image in the engine's store, intermediate ones included."""
    listed = subprocess.run([engine, "images", "-aq", "--no-trunc"], capture_output=True, text=True, check=True)
    return set(listed.stdout.split())


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_task_is_built_and_prepared_once_per_digest(engine, tmp_path):
    """The second prepare of a task finds its prepared image by digest: the engine's store is unchanged (nothing
    built, committed or left behind) and its forks give the same reward. A changed task tree is a new prepared image
    on the same task image; a changed file of the build context is a new task image. Discarding a prepared snapshot
    keeps it; discarding a sandbox's commit removes it."""
    backend = _backend(engine)
    if not backend.local_base:
        pytest.skip(f"no local base to build on: {build_problem()}")
    task_dir = built_task(tmp_path / "task", dockerfile="FROM ubuntu:24.04\nWORKDIR /opt/project\nCOPY data data\n"
                          "RUN echo built > /opt/built.txt\n")
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncd /opt/project\nif [ \"$(cat answer.txt 2>/dev/null)\" = 42 ] && [ \"$(cat /opt/built.txt)\" = "
        "built ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    (task_dir / "solution" / "solve.sh").write_text("#!/bin/bash\ncd /opt/project\necho 42 > answer.txt\n")
    task = load_harbor_task(task_dir)
    made = backend.cached_images(task)
    try:
        first = prepare_task(task, backend)
        first.discard()
        before = _image_ids(engine)
        assert not missing_images(engine, made), made
        second = prepare_task(task, backend)
        assert second.image == first.image == made[0] and not second.owned
        assert _image_ids(engine) == before
        assert check_task(task, backend, oracle=True, log=lambda s: None).reward == 1.0
        assert check_task(task, backend, oracle=False, log=lambda s: None).reward == 0.0
        with backend.fork(second) as sbx:
            assert sbx.exec("echo 42 > answer.txt").ok
            commit = sbx.snapshot()
        commit.discard()
        assert _image_ids(engine) == before

        (task_dir / "tests" / "extra.txt").write_text("a file of the task's tests, not its tree or build\n")
        assert backend.cached_images(load_harbor_task(task_dir)) == made
        (task_dir / "environment" / "data" / "more.json").write_text("[]\n")
        changed = backend.cached_images(load_harbor_task(task_dir))
        assert changed[0] != made[0] and changed[1] != made[1], (made, changed)
        made += changed
    finally:
        subprocess.run([engine, "rmi", "-f", *made], capture_output=True)


def test_digests_follow_names_modes_links_and_contents_not_times(tmp_path):
    """What a cached image is found by: the same files give the same digest whatever their times; a changed
    content, mode, name or link target does not."""
    def digest(path):
        h = hashlib.sha256()
        tree_digest(h, path)
        return h.hexdigest()

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.txt").write_text("a\n")
    (tree / "link").symlink_to("sub/a.txt")
    base = digest(tree)
    os.utime(tree / "sub" / "a.txt", (1, 1))
    assert digest(tree) == base
    changes = [lambda: (tree / "sub" / "a.txt").write_text("b\n"), lambda: (tree / "sub" / "a.txt").chmod(0o755),
               lambda: (tree / "sub" / "a.txt").rename(tree / "sub" / "b.txt"),
               lambda: ((tree / "link").unlink(), (tree / "link").symlink_to("sub"))]
    seen = {base}
    for change in changes:
        change()
        seen.add(digest(tree))
    assert len(seen) == len(changes) + 1


def test_a_containers_entrypoint_is_one_word_then_its_arguments():
    """docker takes one word as --entrypoint (podman a JSON list too): the rest of it goes before the command, and an
    empty one clears the image's."""
    assert entrypoint_argv(["/entrypoint.sh", "--fast"], "img", ["sh", "-c", "x"]) == [
        "--entrypoint", "/entrypoint.sh", "img", "--fast", "sh", "-c", "x"]
    assert entrypoint_argv([], "img", ["python3", "server.py"]) == ["--entrypoint", "", "img", "python3", "server.py"]


def test_a_copy_of_several_sources_goes_into_a_folder_on_every_engine():
    """Harbor's `COPY server.py persona.md .` (BuildKit reads the destination as a folder; docker's classic builder
    refuses it without its '/'): the destination gets its '/', in both forms, with flags; one source into a named
    file, a RUN line and a continued line stay as written."""
    text = ('FROM python:3.12-slim\nCOPY server.py persona.md .\nCOPY --chown=1:1 ["a b", "c", "/srv/x"]\n'
            "ADD x.tar .\nCOPY one.py /app/main.py\nRUN cp a b .\nCOPY a \\\n  b .\n")
    assert copy_into_folders(text).splitlines() == [
        "FROM python:3.12-slim", "COPY server.py persona.md ./", 'COPY --chown=1:1 ["a b", "c", "/srv/x/"]',
        "ADD x.tar ./", "COPY one.py /app/main.py", "RUN cp a b .", "COPY a \\", "  b ."]


def test_discarding_a_prepared_task_keeps_its_cached_images(monkeypatch):
    """A prepared task and its services' images are the cache's (found again by digest): discarding it removes
    nothing; a sandbox's commit goes."""
    from rl.sandbox import container

    removed = []
    monkeypatch.setattr(container.subprocess, "run", lambda argv, **kw: removed.append(argv[-1]))
    built = Service("api", dockerfile=Path("/task/environment/api/Dockerfile"))
    ContainerSnapshot("podman", "localhost/megatron-composer/prepared:1", "/app", owned=False,
                      services=[(built, "localhost/megatron-composer/task:2"),
                                (Service("db", image="postgres:16"), "postgres:16")]).discard()
    assert removed == []
    ContainerSnapshot("docker", "localhost/megatron-composer/snapshot:3", "/app").discard()
    assert removed == ["localhost/megatron-composer/snapshot:3"]
