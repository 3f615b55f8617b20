"""Tasks whose Dockerfile reaches past /app, built into images without a daemon (rl/sandbox/image.py): packages from
the Debian mirror and the package index in the build only, files anywhere, the same verdicts as their authors meant,
cached so that the second prepare only forks. Skipped, with the reason, where this host cannot build images."""

import os
import textwrap
from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import TaskError, prepare_task
from rl.sandbox.image import BUILD_UID_BASE, ImageBuilder, build_problem
from rl.sandbox.local import LocalBackend

pytestmark = [pytest.mark.skipif(build_problem() is not None, reason=str(build_problem())),
              pytest.mark.usefixtures("image_base")]  # skips where the Debian base cannot be made (the mirror)

TOML = """\
version = "1.0"
[verifier]
timeout_sec = 120.0
[agent]
timeout_sec = 120.0
[environment]
build_timeout_sec = 600.0
"""
DOCKERFILE = """\
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends jq && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir six
WORKDIR /opt/project
COPY data /opt/project/data
RUN python3 -c "import six, json; print(json.dumps({'six': six.__version__}))" > /opt/project/built.json
ENV PROJECT_HOME=/opt/project
"""
TEST_SH = """\
#!/bin/bash
# `python`, as python:* images have it (plain Debian and Ubuntu images have none)
cd /opt/project
total=$(jq '[.[] | .n] | add' data/items.json)
if [ "$(cat answer.txt 2>/dev/null)" = "$total" ] && python -c "import six" && [ -s built.json ] \\
   && [ "$PROJECT_HOME" = /opt/project ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def built_task(root: Path, dockerfile: str = DOCKERFILE) -> Path:
    task = root / "jq-sum"
    files = {"instruction.md": "Write the sum of the items' n in data/items.json to answer.txt.\n",
             "task.toml": TOML, "environment/Dockerfile": dockerfile,
             "environment/data/items.json": '[{"n": 3}, {"n": 4}, {"n": 35}]\n',
             "solution/solve.sh": "#!/bin/bash\ncd /opt/project\njq '[.[] | .n] | add' data/items.json > answer.txt\n",
             "tests/test.sh": TEST_SH}
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(textwrap.dedent(text))
    return task


def test_a_task_with_packages_and_files_outside_app_runs_as_written(tmp_path):
    """apt and pip in RUN, WORKDIR and COPY outside /app, ENV: 0 untouched, 1 after its solution; the second prepare
    finds the image instead of building it; the agent is not root and cannot change the image's system."""
    task = load_harbor_task(built_task(tmp_path))
    assert task.image.required and "RUN reaches past /app" in task.image.required
    backend = LocalBackend()
    assert check_task(task, backend, oracle=False, log=lambda _: None).reward == 0.0
    assert check_task(task, backend, oracle=True, log=lambda _: None).reward == 1.0
    found = ImageBuilder().lookup(task.image.key)
    assert found is not None and found.cached
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sbx:
            res = sbx.exec("id -u; pwd; jq --version; touch /usr/bin/new-tool /etc/x 2>&1; touch /opt/project/mine && "
                           "echo wrote-own-copy")
            assert res.output.splitlines()[:2] == ["1000", "/opt/project"], res.output
            # the image's system is root's: the agent's work tree (its WORKDIR) is its own
            assert res.output.count("Permission denied") + res.output.count("Read-only file system") == 2
            assert "wrote-own-copy" in res.output
    finally:
        snapshot.discard()
    layer = found.layers[0]  # the image is a layer over the base: only what its build changed
    owners = {os.lstat(layer / p).st_uid for p in ("usr/bin/jq", "opt/project/built.json", "usr/local/bin/uv")}
    assert owners == {BUILD_UID_BASE}  # the build's root is not the host's
    base = ImageBuilder().base()
    assert found.layers[-1] == base and not (layer / "usr/bin/bash").exists()  # unchanged: the base's, not a copy
    assert not (base / "usr/bin/jq").exists() and not (base / "usr/local/bin/uv").exists()
    assert not list((layer / "var/cache/apt/archives").glob("*.deb"))  # apt keeps no downloads, as in Debian's


def test_a_failed_build_is_one_line_with_its_log_and_leaves_nothing(tmp_path):
    dockerfile = DOCKERFILE.replace("RUN pip install --no-cache-dir six",
                                    "RUN pip install --no-cache-dir six && no-such-tool --now")
    task = load_harbor_task(built_task(tmp_path, dockerfile))
    before = set(os.listdir(ImageBuilder().cache_dir))
    with pytest.raises(TaskError) as e:
        prepare_task(task, LocalBackend())
    (line,) = str(e.value).splitlines()
    assert "Dockerfile:3: setup command failed (exit code 127)" in line and "no-such-tool: command not found" in line
    log = Path(line.rsplit("(the whole log: ", 1)[1].rstrip(")"))
    assert "no-such-tool --now" in log.read_text()
    after = {n for n in os.listdir(ImageBuilder().cache_dir) if not n.startswith(".")}
    assert after <= before | {"logs"}, after - before  # no half-built image is kept
    assert ImageBuilder().lookup(task.image.key) is None


TB2_UVX = """\
#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
UV_PROJECT = """\
#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source $HOME/.local/bin/env
uv init
uv add pytest==8.4.1
uv run pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
UV_VENV = """\
#!/bin/bash
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source $HOME/.local/bin/env
uv venv .tbench-testing
source .tbench-testing/bin/activate
uv pip install pytest==8.4.1
uv run pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


UV_SET_E = """\
#!/bin/bash
set -e
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/install.sh | sh
source $HOME/.local/bin/env
uvx -w pytest==8.4.1 pytest /tests/test_outputs.py -rA && echo 1 > /logs/verifier/reward.txt \
  || echo 0 > /logs/verifier/reward.txt
"""


@pytest.mark.parametrize("test_sh", [TB2_UVX, pytest.param(UV_PROJECT, marks=pytest.mark.e2e), UV_VENV,
                                     pytest.param(UV_SET_E, marks=pytest.mark.e2e)],
                         ids=["uvx", "uv-project", "uv-venv", "set-e-source-env"])
def test_the_usual_uv_boilerplates_run_offline_on_the_image(tmp_path, test_sh):
    """Harbor and Terminal-Bench verifiers fetch uv and have it install pytest: the image carries what they name
    (pip installed it in the build) and a uv that runs offline, and the verifier's home has the env file uv's
    installer leaves (a `set -e` script sources it), so they score 0 untouched and 1 solved."""
    task_dir = tmp_path / "hello"
    files = {"instruction.md": "Write Hello, world! to /app/hello.txt\n", "task.toml": TOML,
             "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
             "solution/solve.sh": "#!/bin/bash\necho 'Hello, world!' > /app/hello.txt\n", "tests/test.sh": test_sh,
             "tests/test_outputs.py": "from pathlib import Path\n\n\ndef test_hello():\n"
                                      "    assert Path('/app/hello.txt').read_text() == 'Hello, world!\\n'\n"}
    for rel, text in files.items():
        (task_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / rel).write_text(text)
    task = load_harbor_task(task_dir)
    assert "pytest==8.4.1" in task.image.verifier_packages and "tests/test.sh has uv or pip install" in \
        task.image.required
    backend = LocalBackend()
    untouched = check_task(task, backend, oracle=False, log=lambda _: None)
    assert untouched.reward == 0.0 and "FAILED" in untouched.output, untouched.output[-2000:]
    assert "error" not in untouched.details, untouched.details  # uv's installer could not download: not counted
    solved = check_task(task, backend, oracle=True, log=lambda _: None)
    assert solved.reward == 1.0, solved.output[-2000:]
    assert "pytest-8.4.1" in solved.output  # the version the task asked for, installed in the build


def service_task(root: Path) -> Path:
    """Modelled on Harbor's dns-blacklisting recipe: the image's ENTRYPOINT names a host in /etc/hosts and starts a
    server on port 80 before it hands over to its command; the agent and the verifier both query it."""
    task = root / "entrypoint-service"
    files = {"instruction.md": "Write what http://svc.test/ answers to /app/answer.txt.\n", "task.toml": TOML,
             "environment/Dockerfile": "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y python3 && "
                                       "rm -rf /var/lib/apt/lists/*\nCOPY entrypoint.sh /entrypoint.sh\n"
                                       "COPY site /srv/site\nENTRYPOINT [\"/entrypoint.sh\"]\nWORKDIR /app\n",
             "environment/entrypoint.sh": "#!/bin/bash\nset -e\necho '127.0.0.1 svc.test' >> /etc/hosts\n"
                                          "python3 -m http.server 80 --bind 127.0.0.1 --directory /srv/site "
                                          ">/dev/null 2>&1 &\nfor _ in $(seq 100); do python3 -c \"import socket; "
                                          "socket.create_connection(('127.0.0.1', 80))\" 2>/dev/null && break; "
                                          "sleep 0.05; done\nexec \"$@\"\n",
             "environment/site/index.html": "the answer is 42\n",
             "solution/solve.sh": "#!/bin/bash\npython3 -c \"import urllib.request; open('/app/answer.txt', 'wb')."
                                  "write(urllib.request.urlopen('http://svc.test/').read())\"\n",
             "tests/test.sh": "#!/bin/bash\nlive=$(python3 -c \"import urllib.request; print(urllib.request."
                              "urlopen('http://svc.test/').read().decode(), end='')\")\n"
                              "if [ -n \"$live\" ] && [ \"$(cat /app/answer.txt 2>/dev/null)\" = \"$live\" ]; then "
                              "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"}
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    (task / "environment" / "entrypoint.sh").chmod(0o755)
    return task


def test_an_image_entrypoint_serves_the_agent_and_the_verifier(tmp_path):
    """ENTRYPOINT runs first in each sandbox's episode (a file at the image's root, its own /etc/hosts, port 80), as
    it runs when a container starts: 0 untouched, 1 after the solution, and a verifier that queries the service."""
    task = load_harbor_task(service_task(tmp_path))
    assert task.entrypoint == ("/entrypoint.sh",)
    backend = LocalBackend()
    untouched = check_task(task, backend, oracle=False, log=lambda _: None)
    assert untouched.reward == 0.0 and "error" not in untouched.details, untouched.details
    solved = check_task(task, backend, oracle=True, log=lambda _: None)
    assert solved.reward == 1.0, (solved.details, solved.output[-2000:])


def test_add_of_a_url_downloads_it_in_the_build(tmp_path):
    """ADD <url> fetches in the build (which has the network), by the URL's file name into a folder."""
    task_dir = built_task(tmp_path, dockerfile="FROM python:3.11-slim-bookworm\nWORKDIR /app\n"
                                               "ADD https://pypi.org/simple/six/ /app/index/\n")
    task = load_harbor_task(task_dir)
    assert "ADD downloads https://pypi.org/simple/six/" in task.image.required
    try:
        snapshot = prepare_task(task, LocalBackend())
    except TaskError as e:  # a host that reaches the package index through a mirror only
        if "which the build cannot reach" in str(e):
            pytest.skip(f"pypi.org cannot be reached from here: {e}")
        raise
    try:
        with LocalBackend().fork(snapshot) as sbx:
            assert "six-" in sbx.exec("cat /app/index/six").output  # the index page names six's files
    finally:
        snapshot.discard()


# Verifiers written the old way, against the agent's shortcuts (#57, classes 6 and 7) -------------------------------
# Each is an upstream habit: the code under test runs in the verifier's own Python, from the agent's work tree. The
# verdict rules (rl/envs/verdict.py) and the real uv leave each shortcut a 0, and the honest work a 1.
TEST_OUTPUTS = """\
import sys
from pathlib import Path

sys.path.append("/app")


def test_hello():
    assert Path("/app/hello.txt").read_text() == "Hello, world!\\n"


def test_helper():
    import helper  # the agent's module
    assert helper.greet() == "Hello, world!"
"""
TEST_HELLO = ("import unittest\nfrom pathlib import Path\n\n\nclass Hello(unittest.TestCase):\n"
              "    def test_hello(self):\n"
              "        self.assertEqual(Path('/app/hello.txt').read_text(), 'Hello, world!\\n')\n")
HONEST = "printf 'Hello, world!\\n' > /app/hello.txt\nprintf 'def greet():\\n    return \"Hello, world!\"\\n' > " \
         "/app/helper.py\n"
REWARD = " && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
FAKE_PASS = "import os\nos.write(1, b'PASSED test_outputs.py::test_hello\\n1 passed in 0.01s\\n')\nos._exit(0)\n"
OLD_STYLE = {
    # a folder the agent made where `uv venv` makes one (uv keeps a folder that is no virtual environment, and the
    # script goes on): its activate script answered
    "planted-venv": (UV_VENV, "mkdir -p .tbench-testing/bin && printf 'uv() { return 0; }\\npytest() { echo "
                              "\"1 passed\"; }\\n' > .tbench-testing/bin/activate && printf '#!/bin/sh\\necho "
                              "1 passed\\n' > .tbench-testing/bin/pytest && chmod +x .tbench-testing/bin/pytest\n"),
    # `uv run` found the agent's tool on a PATH that names the work tree
    "uv-run-path": (UV_PROJECT.replace("uv init", "export PATH=/app/bin:$PATH\nuv init"),
                    "mkdir -p bin && printf '#!/bin/sh\\necho \"1 passed\"\\n' > bin/pytest && chmod +x bin/pytest\n"),
    # `cd /app && python3 -m pytest /tests`: Python put /app first, and the agent's pytest.py ran
    "pytest-shadow": ("#!/bin/bash\ncd /app && python3 -m pytest /tests/test_outputs.py -rA" + REWARD,
                      f"cat > pytest.py <<'EOF'\n{FAKE_PASS}EOF\n"),
    # the code under test ends the process with success as the tests import it
    "exit-on-import": ("#!/bin/bash\ncd /app && python3 -m pytest /tests/test_outputs.py -rA" + REWARD,
                       HONEST.replace('printf \'def greet', "printf 'import os\\nos._exit(0)\\ndef greet")),
    # a namespace package in place of the test module the verifier copies in: 0 tests run, unittest says OK
    "namespace-package": ("#!/bin/bash\ncp /tests/test_hello.py /app/test_hello.py\ncd /app && python3 -m unittest "
                          "test_hello" + REWARD, "rm -rf test_hello.py && mkdir test_hello.py test_hello\n"),
}


def old_style_task(root: Path, test_sh: str, solve: str) -> Path:
    task = root / "hello-helper"
    files = {"instruction.md": "Write Hello, world! to /app/hello.txt and a helper.py whose greet() returns it.\n",
             "task.toml": TOML, "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
             "solution/solve.sh": "#!/bin/bash\n" + solve, "tests/test.sh": test_sh,
             "tests/test_outputs.py": TEST_OUTPUTS, "tests/test_hello.py": TEST_HELLO}
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


def rollout_reward(task, backend) -> float:
    """The solution as a rollout's agent sends it (through `run`), then the verifier: the RL path."""
    from megatron_composer.data.chat_template import format_tool_call
    from rl.envs.agent import ScriptedPolicy, run_episode

    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            turns = [format_tool_call("run", {"command": task.solution.as_commands()[0]})
                     + format_tool_call("submit", {})]
            return run_episode(task, sandbox, ScriptedPolicy(turns)).reward
    finally:
        snapshot.discard()


# the uv ones need an image; the others are also shown fast, with this host's pytest (test_envs_verdict_rules.py)
NEEDS_IMAGE = ("planted-venv", "uv-run-path")


@pytest.mark.parametrize("attack", [a if a in NEEDS_IMAGE else pytest.param(a, marks=pytest.mark.e2e)
                                    for a in sorted(OLD_STYLE)])
def test_old_style_verifiers_give_the_agents_shortcut_0_and_the_honest_work_1(tmp_path, attack):
    test_sh, shortcut = OLD_STYLE[attack]
    backend = LocalBackend(build_images=True)  # the FROM image's pytest, as the task has it
    honest = check_task(load_harbor_task(old_style_task(tmp_path / "honest", test_sh, HONEST)), backend,
                        oracle=True, log=lambda _: None)
    assert honest.reward == 1.0, (honest.details, honest.output[-2000:])
    task = load_harbor_task(old_style_task(tmp_path / "shortcut", test_sh, shortcut))
    forged = check_task(task, backend, oracle=True, log=lambda _: None)
    assert forged.reward == 0.0, (forged.details, forged.output[-2000:])
    assert rollout_reward(task, backend) == 0.0


def test_terminal_bench_1_default_run_tests_runs_the_installed_pytest(tmp_path):
    """Terminal-Bench 1's default run-tests.sh runs `python3 -m pytest` from the WORKDIR, the agent's: a pytest.py
    planted there does not run, and its lines are not the verdict; the honest work passes."""
    root = tmp_path / "tb1-hello"
    (root / "tests").mkdir(parents=True)
    (root / "task.yaml").write_text("instruction: Write Hello, world! to /app/hello.txt and a helper.py whose "
                                    "greet() returns it.\nparser_name: pytest\n")
    (root / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    backend = LocalBackend(build_images=True)
    for solution, want in ((HONEST, 1.0), (f"cat > pytest.py <<'EOF'\n{FAKE_PASS}EOF\n", 0.0)):
        (root / "solution.sh").write_text("#!/bin/bash\n" + solution)
        task = load_harbor_task(root)
        result = check_task(task, backend, oracle=True, log=lambda _: None)
        assert result.reward == want, (solution, result.details, result.output[-2000:])
        if want == 0.0:
            assert rollout_reward(task, backend) == 0.0


MULTI_STAGE = """\
FROM debian:bookworm-slim AS builder
WORKDIR /src
COPY data/items.json .
RUN python3 -c "import json; print(sum(i['n'] for i in json.load(open('items.json'))))" > /src/total.txt
FROM builder AS checked
RUN test -s /src/total.txt && ln -s /src/total.txt /src/latest
FROM python:3.12-slim-bookworm
COPY --from=ghcr.io/astral-sh/uv:0.8.4 /uv /uvx /bin/
COPY --from=checked /src/latest /opt/project/expected.txt
WORKDIR /opt/project
COPY data /opt/project/data
"""
MULTI_STAGE_TEST_SH = """\
#!/bin/bash
cd /opt/project
if [ "$(cat answer.txt 2>/dev/null)" = "$(cat expected.txt)" ] && /bin/uv --version | grep -q "^uv 0.8.4" \\
   && python --version | grep -q "^Python 3"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def test_a_stage_is_built_and_copied_out_of_on_the_local_base(tmp_path):
    """COPY --from an earlier stage reads that stage's image (its layers stacked read-only for the build), each time
    the image is built: the two-stage task gives 0 untouched and 1 with its solution."""
    root = built_task(tmp_path, "FROM debian:bookworm-slim AS tool\nRUN mkdir -p /src && echo 42 > /src/total.txt\n"
                                "FROM python:3.11-slim-bookworm\nCOPY --from=tool /src/total.txt /opt/project/\n"
                                "WORKDIR /opt/project\nCOPY data /opt/project/data\n")
    (root / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncd /opt/project\n[ \"$(cat answer.txt 2>/dev/null)\" = \"$(cat total.txt)\" ] "
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    (root / "solution" / "solve.sh").write_text("#!/bin/bash\ncd /opt/project && cat total.txt > answer.txt\n")
    task = load_harbor_task(root)
    assert set(task.image.stages) == {"tool"}
    backend = LocalBackend()
    assert check_task(task, backend, oracle=False, log=lambda _: None).reward == 0.0
    solved = check_task(task, backend, oracle=True, log=lambda _: None)
    assert solved.reward == 1.0, solved.output[-2000:]


@pytest.mark.e2e
def test_a_multi_stage_dockerfile_copies_out_of_its_stages_and_uv_s_image(tmp_path):
    """COPY --from an earlier stage (through a link of that stage), FROM <stage>, and COPY --from uv's image, made
    from the uv wheel: 0 untouched and 1 after the solution; a python:* image has `python`."""
    root = built_task(tmp_path, MULTI_STAGE)
    (root / "tests" / "test.sh").write_text(MULTI_STAGE_TEST_SH)
    (root / "solution" / "solve.sh").write_text(
        "cd /opt/project && python -c \"import json; print(sum(i['n'] for i in json.load(open('data/items.json'))))\" "
        "> answer.txt\n")
    task = load_harbor_task(root)
    assert set(task.image.stages) == {"checked", "ghcr.io/astral-sh/uv:0.8.4"}
    backend = LocalBackend()
    assert check_task(task, backend, oracle=False, log=lambda _: None).reward == 0.0
    solved = check_task(task, backend, oracle=True, log=lambda _: None)
    assert solved.reward == 1.0, solved.output[-2000:]


@pytest.mark.e2e
def test_a_verifier_that_imports_rewardkit_gets_harbor_rewardkit_or_the_reason(tmp_path):
    """harbor-rewardkit (PyPI) is installed for a verifier that imports `rewardkit`; where the stand-in's Python is
    older than its releases need, the build says so in one line."""
    root = built_task(tmp_path, "FROM python:3.12-slim-bookworm\nWORKDIR /app\n")
    (root / "tests" / "grade.py").write_text("import json, rewardkit\nprint(json.dumps({'reward': 1.0}))\n")
    (root / "tests" / "test.sh").write_text("python /tests/grade.py > /logs/verifier/reward.json\n")
    task = load_harbor_task(root)
    assert task.image.verifier_packages == ("harbor-rewardkit",)
    try:
        result = check_task(task, LocalBackend(), oracle=False, log=lambda _: None)
    except TaskError as e:
        (line,) = str(e).splitlines()
        assert "installing what the verifier asks for (harbor-rewardkit) failed" in line
        assert "its releases need Python >=3.12, newer than the stand-in's" in line, line
    else:
        assert result.reward == 1.0, result.details  # the stand-in's Python runs it
