"""Tasks in the Harbor / Terminal-Bench 2 layout as they are written outside this repo, rebuilt in a temp dir:
untouched they score 0, after their solution 1; what the local backend cannot honour ends in one line that
says why and what fixes it."""

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from rl.envs.check_task import check_task
from rl.envs.harbor import TaskFormatWarning, load_harbor_task
from rl.envs.task import RewardError, RunStep, TaskError, missing_tool, parse_reward, prepare_task
from rl.sandbox.base import BASE_ENV, ExecResult
from rl.sandbox.local import LocalBackend, bwrap_problem

REPO = Path(__file__).resolve().parents[3]
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

# Terminal-Bench 2's task.toml, field for field.
TB2_TOML = """\
version = "1.0"

[metadata]
author_name = "Example Author"
author_email = "author@example.com"
difficulty = "easy"
category = "{category}"
tags = ["{tag}"]

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 600.0
docker_image = "ghcr.io/example/{name}:latest"
cpus = 1
memory = "2G"
storage = "10G"
"""
# Upstream test.sh files install uv and run pytest; these look-alikes run the same pytest-style test file with
# a small runner on the host's python3 (the task needs no package installs).
RUNNER = """\
import importlib.util, sys, traceback
spec = importlib.util.spec_from_file_location("test_outputs", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
failed = 0
for name, fn in vars(mod).items():
    if name.startswith("test_") and callable(fn):
        try:
            fn(); print("PASSED", name)
        except Exception:
            failed += 1; print("FAILED", name); traceback.print_exc()
sys.exit(1 if failed else 0)
"""
TB2_TEST_SH = """\
#!/bin/bash
# Terminal-Bench 2 layout: run the tests, then write the reward.
cd /app
python3 /tests/run_tests.py /tests/test_outputs.py
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_task(root: Path, name: str, files: dict[str, str]) -> Path:
    task = root / name
    for rel, text in files.items():
        path = task / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if rel.endswith((".sh", ".py")) else text)
    return task


def hello_world(root: Path) -> Path:
    return write_task(root, "hello-world", {
        "instruction.md": 'Create a file called hello.txt in the current directory. Write "Hello, world!" to it.\n',
        "task.toml": TB2_TOML.format(category="file-operations", tag="file-operations", name="hello-world"),
        "environment/Dockerfile": "FROM ubuntu:24.04\n\nWORKDIR /app\n",
        "solution/solve.sh": "#!/bin/bash\necho \"Hello, world!\" > hello.txt\n",
        "tests/test.sh": TB2_TEST_SH,
        "tests/run_tests.py": RUNNER,
        "tests/test_outputs.py": """\
            from pathlib import Path


            def test_hello_file_exists():
                assert Path("/app/hello.txt").exists(), "File /app/hello.txt does not exist"


            def test_hello_file_content():
                assert Path("/app/hello.txt").read_text().strip() == "Hello, world!"
            """,
    })


ACCESS_LOG = "".join(f'10.0.0.{i % 7} - - [01/Jan/2025:00:00:{i:02d} +0000] "GET /p{i % 3} HTTP/1.1" '
                     f'{[200, 200, 404, 500, 200, 301][i % 6]} {100 + i}\n' for i in range(40))


def log_summary(root: Path) -> Path:
    """A log-analysis task whose verifier writes a multi-key reward.json (Harbor's rewards dictionary)."""
    return write_task(root, "log-status-summary", {
        "instruction.md": "Count the requests per HTTP status code in /app/access.log and write them to "
                          "/app/summary.json as an object mapping the status code (a string) to its count.\n",
        "task.toml": TB2_TOML.format(category="data-processing", tag="logs", name="log-status-summary"),
        "environment/Dockerfile": "FROM python:3.13-slim-bookworm\nWORKDIR /app\nCOPY access.log /app/access.log\n",
        "environment/access.log": ACCESS_LOG,
        "solution/solve.sh": """\
            #!/bin/bash
            awk '{print $9}' /app/access.log | sort | uniq -c | \\
              python3 -c 'import json, sys; print(json.dumps({s: int(n) for n, s in map(str.split, sys.stdin)}))' \\
              > /app/summary.json
            """,
        "tests/test.sh": """\
            #!/bin/bash
            python3 /tests/grade.py > /logs/verifier/reward.json
            """,
        "tests/grade.py": """\
            import collections, json
            want = collections.Counter(line.split()[8] for line in open("/app/access.log"))
            try:
                got = json.load(open("/app/summary.json"))
                shape = float(isinstance(got, dict) and all(isinstance(v, int) for v in got.values()))
                counts = float(got == dict(want))
            except (OSError, ValueError):
                shape = counts = 0.0
            print(json.dumps({"counts_correct": counts, "format_correct": shape}))
            """,
    })


def path_task(root: Path) -> Path:
    """ENV PATH="/app/bin:${PATH}": the task's own tools come first, the system's stay reachable."""
    return write_task(root, "path-tools", {
        "instruction.md": "The `slugify` tool in /app/bin must turn 'Hello World' into 'hello-world'. Fix it.\n",
        "task.toml": TB2_TOML.format(category="software-engineering", tag="shell", name="path-tools"),
        "environment/Dockerfile": ('FROM ubuntu:24.04\nENV PATH="/app/bin:${PATH}"\nWORKDIR /app\n'
                                   "COPY slugify /app/bin/slugify\nRUN chmod +x /app/bin/slugify\n"),
        "environment/slugify": "#!/bin/bash\necho \"$*\" | tr ' ' '-'\n",
        "solution/solve.sh": "#!/bin/bash\nprintf '#!/bin/bash\\necho \"$*\" | tr A-Z a-z | tr \" \" -\\n' "
                             "> /app/bin/slugify\n",
        "tests/test.sh": """\
            #!/bin/bash
            if [ "$(slugify Hello World)" = hello-world ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
            """,
    })


@needs_bwrap
@pytest.mark.parametrize("make", [hello_world, log_summary, path_task], ids=lambda f: f.__name__)
def test_real_format_task_untouched_zero_solution_one(tmp_path, make):
    task = load_harbor_task(make(tmp_path))
    backend = LocalBackend()
    untouched = check_task(task, backend, oracle=False, log=lambda s: None)
    solved = check_task(task, backend, oracle=True, log=lambda s: None)
    assert (untouched.reward, solved.reward) == (0.0, 1.0), (untouched.details, solved.output[-2000:])
    assert "error" not in untouched.details and "error" not in solved.details
    if make is log_summary:  # every key of a multi-key reward.json is kept; the reward is their mean
        assert solved.details["rewards"] == {"counts_correct": 1.0, "format_correct": 1.0}


def test_env_path_expands_from_the_base_environment(tmp_path):
    with pytest.warns(TaskFormatWarning, match=r"puts /app/bin on PATH, which the agent can write"):
        task = load_harbor_task(path_task(tmp_path))
    assert task.env["PATH"] == "/app/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert any("/app/bin on PATH" in note for note in task.notes)


def test_reward_json_key_or_mean():
    assert parse_reward("reward.json", '{"reward": 0.25, "style": 1}') == (0.25, {"reward": 0.25, "style": 1.0})
    assert parse_reward("reward.json", '{"a": 1, "b": 0}') == (0.5, {"a": 1.0, "b": 0.0})
    for bad in ('{"a": "yes"}', "{}", "[1]", '{"a": true}'):
        with pytest.raises(RewardError):
            parse_reward("reward.json", bad)


@pytest.mark.parametrize("raw", ["1", "1\n", "0", "0.5\n", "1.000"])
def test_plain_decimal_rewards_are_read(raw):
    assert parse_reward("reward.txt", raw)[0] == float(raw)


@pytest.mark.parametrize("name, raw, why", [
    ("reward.txt", "nan", "plain decimal"), ("reward.txt", "inf\n", "plain decimal"),
    ("reward.txt", "1e309", "plain decimal"), ("reward.txt", "-0", "plain decimal"),
    ("reward.txt", "1_0", "plain decimal"), ("reward.txt", "\u0661", "plain decimal"),
    ("reward.txt", " 1\n1", "plain decimal"), ("reward.txt", "1\n\n", "plain decimal"),
    ("reward.txt", "", "plain decimal"), ("reward.txt", "+1", "plain decimal"),
    ("reward.txt", "2", r"outside the task's reward range \[0, 1\]"), ("reward.txt", "-1", "outside"),
    ("reward.txt", "1" * 70000, "at most"),
    ("reward.json", '{"reward": NaN}', "NaN, not a finite number"),
    ("reward.json", '{"reward": Infinity}', "Infinity, not a finite number"),
    ("reward.json", '{"reward": 1e309}', "inf, not a finite number"),
    ("reward.json", '{"reward": 1' + "0" * 400 + '}', "too large|not a finite"),
    ("reward.json", '{"reward": 0, "reward": 1}', "repeats a key"),
    ("reward.json", '{"reward": 3}', "outside the task's reward range"),
    ("reward.json", "[" * 200000 + "]" * 200000, "at most|nested too deeply"),
    ("reward.json", "[" * 20000 + "]" * 20000, "nested too deeply|must be a non-empty object"),
    ("reward.json", '{"reward": 1', "not JSON"),
])
def test_a_reward_file_that_is_not_a_plain_finite_number_in_range_is_refused(name, raw, why):
    with pytest.raises(RewardError, match=why):
        parse_reward(name, raw)


def test_a_declared_reward_range_is_honoured():
    assert parse_reward("reward.txt", "-1", -1.0, 1.0)[0] == -1.0
    with pytest.raises(RewardError, match=r"\[-1, 1\]"):
        parse_reward("reward.txt", "1.5", -1.0, 1.0)


@needs_bwrap
def test_broken_reward_json_is_an_error_and_exit_2(tmp_path):
    task_dir = hello_world(tmp_path)
    (task_dir / "tests" / "test.sh").write_text('echo \'{"score": "high"}\' > /logs/verifier/reward.json\n')
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "reward.json values must be numbers; not: score" in res.stderr


@needs_bwrap
def test_verifier_that_cannot_run_is_an_error(tmp_path):
    """A task whose PATH loses bash (the old ${PATH} bug) does not pass the check with a silent 0."""
    task_dir = hello_world(tmp_path)
    with open(task_dir / "environment" / "Dockerfile", "a") as f:
        f.write('ENV PATH="/nowhere"\n')
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task_dir)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    # the verifier's shell cannot start (bubblewrap finds no bash): no reward, an error, exit status 2
    assert res.returncode == 2 and "error: the verifier wrote no /logs/verifier/reward.txt" in res.stderr


# What the local backend cannot honour: one line naming why and the fix -------------------------------------------
@needs_bwrap
def test_a_task_that_must_be_built_says_why_where_this_host_cannot_build(tmp_path, monkeypatch):
    task_dir = hello_world(tmp_path)
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && apt-get install -y curl\n")
    monkeypatch.setattr("rl.sandbox.image.build_problem", lambda: "building a task's image needs mmdebstrap, which "
                        "this host lacks: apt-get install mmdebstrap")
    task = load_harbor_task(task_dir)
    assert any("built into an image on a Debian root filesystem" in note for note in task.notes)
    with pytest.raises(TaskError) as e:
        prepare_task(task, LocalBackend(image_cache=str(tmp_path / "images")))
    (line,) = str(e.value).splitlines()
    assert line == ("hello-world: building a task's image needs mmdebstrap, which this host lacks: apt-get install "
                    f"mmdebstrap (it must be built: {task_dir}/environment/Dockerfile:3: RUN reaches past /app (it "
                    "installs, downloads or names a system path))"), line


@needs_bwrap
def test_buildkit_heredocs_and_from_platform_are_read_as_docker_reads_them(tmp_path):
    """`FROM --platform=... IMAGE` names IMAGE; a heredoc feeding a RUN command and a RUN whose body is the script
    (plain or with a #! line) run as BuildKit runs them; their bodies are not read as instructions."""
    task_dir = hello_world(tmp_path)
    (task_dir / "environment" / "Dockerfile").write_text(textwrap.dedent("""\
        FROM --platform=linux/amd64 python:3.12-slim AS base
        WORKDIR /app
        RUN cat > notes.txt <<'EOF'
        NAME: not an instruction
        $HOME stays as written
        EOF
        RUN <<EOF
        echo from-script > script.txt
        EOF
        RUN <<-PY
        \t#!/usr/bin/env python3
        \topen("/app/python.txt", "w").write("from-python")
        \tPY
        """))
    task = load_harbor_task(task_dir)
    assert any("FROM python:3.12-slim" in note for note in task.notes)
    snapshot = prepare_task(task, LocalBackend())
    try:
        app = snapshot.layers[0] / "app"  # the prepared task's own layer (its setup ran on the host's system)
        files = {p.name: p.read_text() for p in app.iterdir() if p.suffix == ".txt"}
    finally:
        snapshot.discard()
    assert files == {"notes.txt": "NAME: not an instruction\n$HOME stays as written\n", "script.txt": "from-script\n",
                     "python.txt": "from-python"}, files
    (task_dir / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nRUN cat <<EOF\nnever closed\n")
    with pytest.raises(TaskError, match=r"Dockerfile:2: the heredoc <<EOF has no closing EOF line"):
        load_harbor_task(task_dir)


def test_entrypoint_and_cmd_are_read_as_a_container_engine_reads_them(tmp_path):
    """ENTRYPOINT (exec or shell form) is what each episode starts with; CMD is replaced (Harbor and Terminal-Bench
    give the main container their own command), which the notes say."""
    task_dir = hello_world(tmp_path)
    dockerfile = task_dir / "environment" / "Dockerfile"
    dockerfile.write_text('FROM python:3.12-slim\nWORKDIR /app\nENTRYPOINT ["/app/start.sh", "--quiet"]\n'
                          'CMD ["python3", "server.py"]\n')
    task = load_harbor_task(task_dir)
    assert task.entrypoint == ("/app/start.sh", "--quiet")
    assert any("CMD is replaced" in note for note in task.notes), task.notes
    dockerfile.write_text("FROM python:3.12-slim\nWORKDIR /app\nENTRYPOINT service-start --now\n")
    assert load_harbor_task(task_dir).entrypoint == ("/bin/sh", "-c", "service-start --now")
    snapshot = prepare_task(load_harbor_task(task_dir), LocalBackend()) if bwrap_problem() is None else None
    if snapshot is not None:  # setup does not run it (a Dockerfile's build does not); the forks do
        try:
            assert snapshot.entrypoint == ("/bin/sh", "-c", "service-start --now")
        finally:
            snapshot.discard()


class _FailingBuild:
    builds_image = True

    def __init__(self, output: str):
        self.output = output
        self.outputs = []  # the build's earlier steps (BuildRoot.outputs)

    def exec(self, command, **kwargs):
        return ExecResult(exit_code=100, output=self.output, output_bytes=len(self.output), duration_s=0.1)


@pytest.mark.parametrize("output,says", [
    ("curl: (6) Could not resolve host: golang.org\n", "it downloads from golang.org, which the build cannot reach"),
    ("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/datasets/m/x.mp4\n",
     "it downloads from huggingface.co, which the build cannot reach"),
    ("W: Failed to fetch http://ppa.launchpad.net/x  Temporary failure resolving 'ppa.launchpad.net'\n"
     "E: Unable to locate package python3.11\n", "it downloads from ppa.launchpad.net"),
    ("Reading package lists...\nE: Unable to locate package openjdk-21-jdk\n",
     "Debian's archive, which stands in for the FROM image's, has no package openjdk-21-jdk"),
    ("make: *** [all] Error 2\n", "setup command failed (exit code 100): make: *** [all] Error 2"),
    ("AttributeError: 'NoneType' object has no attribute 'people'\n",
     "it adds the Ubuntu archive ppa:deadsnakes/ppa (Launchpad), which the build cannot reach")])
def test_a_failed_image_build_says_what_it_lacked(output, says):
    command = "add-apt-repository -y ppa:deadsnakes/ppa" if "people" in output else "make"
    step = RunStep(command=command, cwd="/", env={}, origin="Dockerfile:7")
    with pytest.raises(TaskError) as e:
        step.apply(_FailingBuild(output), timeout=10)
    (line,) = str(e.value).splitlines()
    assert line.startswith("Dockerfile:7: ") and says in line and "(the whole log: " in line, line


def test_a_build_step_that_fails_for_a_download_an_earlier_step_lost_names_it():
    """`curl ... | sh` loses its download quietly (the pipe's status is sh's); the step that needs it fails later."""
    build = _FailingBuild("bash: line 1: rustc: command not found\n")
    build.outputs.append(("Dockerfile:15", "curl: (6) Could not resolve host: sh.rustup.rs\n"))
    with pytest.raises(TaskError, match=r"Dockerfile:21: it downloads from sh\.rustup\.rs, which the build cannot "
                                        r"reach .* \(at Dockerfile:15\)"):
        RunStep(command="rustc --version", cwd="/", env={}, origin="Dockerfile:21").apply(build, timeout=10)


@needs_bwrap
def test_terminal_bench_1_tests_that_fail_before_naming_a_test_score_0(tmp_path):
    """A run-tests.sh that stops before pytest names any test (the untouched code does not compile) is a failed
    run, as Terminal-Bench counts a log it cannot parse: reward 0 without an error."""
    task_dir = tb1_task(tmp_path)
    (task_dir / "run-tests.sh").write_text("#!/bin/bash\necho 'CMake build failed'\nexit 1\n")
    result = check_task(load_harbor_task(task_dir), LocalBackend(), oracle=False, log=lambda s: None)
    assert result.reward == 0.0 and "error" not in result.details, result.details
    assert result.details["failing"] == ["(no test ran)"]
    (task_dir / "run-tests.sh").write_text(  # a judge beyond the sandbox (LiveCodeBench Pro's) cannot be reached
        "#!/bin/bash\necho 'E   OSError: [Errno 101] Network is unreachable'\n"
        "echo 'FAILED test_outputs.py::test_judge'\nexit 1\n")
    result = check_task(load_harbor_task(task_dir), LocalBackend(), oracle=True, log=lambda s: None)
    assert result.reward == 0.0 and "the test script needs the network" in result.details["error"], result.details


@needs_bwrap
def test_missing_pytest_is_named_with_its_fix(tmp_path):
    probe = subprocess.run(["python3", "-c", "import pytest"], capture_output=True, env={"PATH": BASE_ENV["PATH"]})
    if probe.returncode == 0:
        pytest.skip("the host's python3 has pytest: nothing is missing here")
    task_dir = hello_world(tmp_path)
    (task_dir / "tests" / "test.sh").write_text(
        "cd /app\nif python3 -m pytest /tests/test_outputs.py -rA; then echo 1; else echo 0; fi "
        "> /logs/verifier/reward.txt\n")
    for flag in ([], ["--oracle"]):  # both would score a silent 0
        res = subprocess.run([sys.executable, "tools/check_task.py", str(task_dir), *flag], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stdout
        error = res.stderr.strip().splitlines()[-1]
        assert "the verifier needs pytest, which this host lacks" in error and "python3-pytest" in error
        assert "--backend docker, podman or apptainer" in error


def test_unknown_task_toml_keys_warn(tmp_path):
    task_dir = hello_world(tmp_path)
    with open(task_dir / "task.toml", "a") as f:
        f.write("gpu_count = 1\n[agent.extra]\nx = 1\n")
    with pytest.warns(TaskFormatWarning) as record:
        task = load_harbor_task(task_dir)
    messages = [str(w.message) for w in record]
    assert any("unknown key [environment].gpu_count is ignored" in m for m in messages), messages
    assert any("unknown key [agent].extra is ignored" in m for m in messages), messages
    assert messages == [n for n in task.notes if "unknown key" in n]  # check_task prints the notes too


@needs_bwrap
def test_check_task_says_each_note_once_and_a_missing_solution_before_setup(tmp_path):
    task_dir = hello_world(tmp_path)
    with open(task_dir / "task.toml", "a") as f:
        f.write("gpu_count = 1\n")
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert (res.stdout + res.stderr).count("unknown key [environment].gpu_count") == 1, res.stdout + res.stderr
    (task_dir / "solution" / "solve.sh").unlink()
    (task_dir / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nRUN exit 7\n")
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task_dir), "--oracle"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "has no reference solution" in res.stderr and "setup" not in res.stderr, res.stderr


def test_a_compose_file_is_read_not_ignored(tmp_path, monkeypatch):
    """Terminal-Bench's one-service compose file is a note. A multi-container task's other services are read as
    compose reads them (build, environment from this host's variables, command, healthcheck durations), the local
    backend refuses the task in one line before any work, and what a service cannot have here is named."""
    task_dir = hello_world(tmp_path)
    compose = task_dir / "environment" / "docker-compose.yaml"
    compose.write_text("services:\n  client:\n    build: .\n    environment:\n      - TEST_DIR=/tests\n")
    task = load_harbor_task(task_dir)
    assert any(f"{compose}: the compose file's settings of the task's own container" in n for n in task.notes)
    assert task.services == []
    (task_dir / "environment" / "api").mkdir()
    (task_dir / "environment" / "api" / "Dockerfile").write_text("FROM python:3.12-slim\nCMD [\"python3\"]\n")
    compose.write_text(textwrap.dedent("""\
        services:
          main:
            depends_on:
              api:
                condition: service_healthy
          api:
            build:
              context: ./api
            command: python3 -m http.server 5000
            environment:
              - KEY=${MC_TEST_KEY}
              - MODEL=${MC_TEST_MODEL:-small}
            expose: ["5000"]
            healthcheck:
              test: ["CMD-SHELL", "python3 -c 'import socket; socket.create_connection((\\"localhost\\", 5000))'"]
              interval: 1m30s
              timeout: 500ms
              retries: 4
              start_period: 2s
        """))
    monkeypatch.setenv("MC_TEST_KEY", "k-123")
    task = load_harbor_task(task_dir)
    (api,) = task.services
    assert (api.name, api.dockerfile, api.command) == ("api", task_dir / "environment" / "api" / "Dockerfile",
                                                       ["python3", "-m", "http.server", "5000"])
    assert api.env == {"KEY": "k-123", "MODEL": "small"} and api.recipe is not None
    hc = api.healthcheck
    assert hc.test[:2] == ["sh", "-c"] and (hc.interval_s, hc.timeout_s, hc.retries, hc.start_period_s) == (
        90.0, 0.5, 4, 2.0)
    if bwrap_problem() is None:
        with pytest.raises(TaskError) as e:
            prepare_task(task, LocalBackend())
        (line,) = str(e.value).splitlines()
        assert "a multi-container task (api beside its own) runs on a container backend" in line, line
    compose.write_text("services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n    privileged: true\n")
    with pytest.raises(TaskError, match=r"services\.db\.privileged is not supported here"):
        load_harbor_task(task_dir)
    compose.write_text("services:\n  web:\n    build: .\n  db:\n    image: postgres:16\n")
    with pytest.raises(TaskError, match=r"none of the services \(db, web\) is the task's own container"):
        load_harbor_task(task_dir)


# Terminal-Bench 1 folders ---------------------------------------------------------------------------------------
TB1_YAML = """\
instruction: |-
  Create the file /app/hello.txt containing "Hello, world!".
author_email: author@example.com
difficulty: easy
category: file-operations
tags:
  - file-operations
parser_name: pytest
max_agent_timeout_sec: 120.0
max_test_timeout_sec: 60.0
run_tests_in_same_shell: false
"""
TB1_COMPOSE = """\
services:
  client:
    build:
      dockerfile: Dockerfile
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
"""


def tb1_task(tmp_path: Path, solution: str = "solution.sh") -> Path:
    """A Terminal-Bench 1 task as its registry holds them; run-tests.sh runs the pytest-style test file with the
    small runner above (upstream's installs pytest with uv, which needs the network)."""
    root = tmp_path / "hello-world-tb1"
    (root / "tests").mkdir(parents=True)
    (root / "task.yaml").write_text(TB1_YAML)
    (root / "Dockerfile").write_text("FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nWORKDIR /app\n")
    (root / "docker-compose.yaml").write_text(TB1_COMPOSE)
    (root / "tests" / "runner.py").write_text(RUNNER)
    (root / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\n\ndef test_hello_file_exists():\n    assert Path('/app/hello.txt').exists()\n\n\n"
        "def test_hello_file_content():\n    assert Path('/app/hello.txt').read_text().strip() == 'Hello, world!'\n")
    (root / "run-tests.sh").write_text("#!/bin/bash\npython3 -I $TEST_DIR/runner.py $TEST_DIR/test_outputs.py\n")
    if solution == "solution.sh":
        (root / "solution.sh").write_text("#!/bin/bash\necho 'Hello, world!' > /app/hello.txt\n")
    else:
        (root / "solution.yaml").write_text("- command: echo 'Hello, world!' > hello.txt\n  min_timeout_sec: 0.1\n"
                                            "- command: cat hello.txt\n")
    return root


@needs_bwrap
@pytest.mark.parametrize("solution", ["solution.sh", "solution.yaml"])
def test_a_terminal_bench_1_task_runs_as_written(tmp_path, solution):
    task_dir = tb1_task(tmp_path, solution)
    task = load_harbor_task(task_dir)
    assert task.instruction.startswith("Create the file /app/hello.txt") and task.limits.verifier_timeout_s == 60
    assert any("compose file's settings of the task's own container beyond the build" in n for n in task.notes)
    backend = LocalBackend()
    untouched = check_task(task, backend, oracle=False, log=lambda s: None)
    solved = check_task(task, backend, oracle=True, log=lambda s: None)
    assert (untouched.reward, solved.reward) == (0.0, 1.0), (untouched.details, solved.output[-2000:])
    assert untouched.details["failing"] == ["test_hello_file_content", "test_hello_file_exists"]


def test_terminal_bench_1_folders_that_cannot_run_say_why(tmp_path):
    task_dir = tb1_task(tmp_path)
    (task_dir / "task.yaml").write_text("descriptions:\n  - key: base\n    description: From the old field.\n")
    assert load_harbor_task(task_dir).instruction == "From the old field."
    (task_dir / "task.yaml").write_text("difficulty: easy\n")
    with pytest.raises(TaskError, match=r"task.yaml has no instruction"):
        load_harbor_task(task_dir)
    (task_dir / "task.yaml").write_text(TB1_YAML.replace("parser_name: pytest", "parser_name: swebench"))
    with pytest.raises(TaskError, match=r"parser_name 'swebench' is not supported"):
        load_harbor_task(task_dir)


@needs_bwrap
def test_terminal_bench_1_tests_that_report_nothing_are_an_error(tmp_path):
    task_dir = tb1_task(tmp_path)
    (task_dir / "run-tests.sh").write_text("#!/bin/bash\necho 'all good'\n")
    result = check_task(load_harbor_task(task_dir), LocalBackend(), oracle=True, log=lambda s: None)
    assert result.reward == 0.0 and "printed no pytest -rA summary" in result.details["error"], result.details


def test_harbor_1_1_keys_are_read_and_a_gpu_task_is_refused_in_one_line(tmp_path):
    task_dir = hello_world(tmp_path)
    toml = (task_dir / "task.toml").read_text().replace('version = "1.0"', 'schema_version = "1.1"')
    (task_dir / "task.toml").write_text(toml + '\n[task]\nname = "example/hello-world"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskFormatWarning)  # nothing unknown
        load_harbor_task(task_dir)
    (task_dir / "task.toml").write_text(toml.replace("cpus = 1", "cpus = 1\ngpus = 2"))
    with pytest.raises(TaskError, match=r"the task needs 2 GPU\(s\) \(\[environment\].gpus\); the sandboxes here"):
        load_harbor_task(task_dir)


@needs_bwrap
def test_a_verifier_that_downloads_its_tools_is_told_about_the_network(tmp_path):
    """A verifier that downloads what it needs beyond what uv and pip install (which a built image carries: see
    test_envs_images.py) is told about the network it lacked, not (only) about the file that never arrived."""
    task_dir = hello_world(tmp_path)
    (task_dir / "tests" / "test.sh").write_text(
        "python3 -c 'import urllib.request; urllib.request.urlretrieve(\"https://example.com/expected.txt\", "
        "\"/tmp/expected.txt\")'\n"
        "cmp /tmp/expected.txt /app/hello.txt && echo 1 > /logs/verifier/reward.txt "
        "|| echo 0 > /logs/verifier/reward.txt\n")
    task = load_harbor_task(task_dir)
    result = check_task(task, LocalBackend(), oracle=True, log=lambda s: None)  # the network the task declares
    assert task.verifier_network == "public" and result.reward == 0.0, result.details
    assert "the verifier needs example.com, which the run's egress proxy does not allow" in result.details["error"]
    result = check_task(task, LocalBackend(network="none"), oracle=True, log=lambda s: None)  # a run without any
    assert result.reward == 0.0 and "example.com" in result.details["error"], result.details


MULTI_STEP_TOML = """\
schema_version = "1.1"
multi_step_reward_strategy = "{strategy}"
artifacts = ["/app/greet.sh"]

[agent]
timeout_sec = 60.0

[verifier]
timeout_sec = 60.0

[[steps]]
name = "scaffold"
min_reward = 1.0

[[steps]]
name = "implement"
min_reward = 0.5
[steps.verifier]
env = {{ EXPECTED_GREETING = "Hello, Ada!" }}
[steps.healthcheck]
command = "test -x /app/greet.sh"
interval_sec = 0.2

[[steps]]
name = "document"
"""
HELPERS = "check() {{ if eval \"$1\"; then echo 1; else echo 0; fi > /logs/verifier/reward.txt; }}\n"


def multi_step_task(root: Path, strategy: str = "mean") -> Path:
    """Harbor's multi-step recipe: scaffold -> implement -> document against one sandbox, shared test helpers,
    a step's workdir files with their setup.sh, a health check, a step's verifier env, min_reward."""
    return write_task(root, "multi-step", {
        "task.toml": MULTI_STEP_TOML.format(strategy=strategy),
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
        "tests/helpers.sh": HELPERS.format(),
        "steps/scaffold/instruction.md": "Create /app/greet.sh that prints hello.\n",
        "steps/scaffold/tests/test.sh": "source /tests/helpers.sh\ncheck '[ \"$(bash /app/greet.sh)\" = hello ]'\n",
        "steps/scaffold/solution/solve.sh": "printf 'echo hello\\n' > /app/greet.sh && chmod +x /app/greet.sh\n",
        "steps/implement/instruction.md": "Make greet.sh print Hello, <name>! with the name in config.txt.\n",
        "steps/implement/workdir/config.txt": "Ada\n",
        "steps/implement/workdir/setup.sh": "echo prepared > /app/.prepared\n",
        "steps/implement/tests/test.sh": "source /tests/helpers.sh\n"
                                         "check '[ \"$(bash /app/greet.sh)\" = \"$EXPECTED_GREETING\" ] && "
                                         "[ -f /app/.prepared ] && [ ! -e /app/setup.sh ]'\n",
        "steps/implement/solution/solve.sh": "printf 'echo \"Hello, $(cat /app/config.txt)!\"\\n' > /app/greet.sh\n",
        "steps/document/instruction.md": "Describe greet.sh in /app/README.md.\n",
        "steps/document/tests/test.sh": "source /tests/helpers.sh\ncheck 'grep -q greet.sh /app/README.md'\n",
        "steps/document/solution/solve.sh": "echo 'greet.sh greets' > /app/README.md\n",
    })


@needs_bwrap
@pytest.mark.parametrize("strategy", ["mean", "final"])
def test_a_multi_step_task_runs_its_steps_in_order(tmp_path, strategy):
    """Harbor 1.1's [[steps]]: each step's files, setup.sh and health check before its work, its verifier (its
    tests over the shared ones, its env) after; min_reward stops the task; the reward is the mean or the final's."""
    task = load_harbor_task(multi_step_task(tmp_path, strategy))
    assert [s.name for s in task.steps] == ["scaffold", "implement", "document"] and task.step_reward == strategy
    assert task.instruction.startswith("Create /app/greet.sh")
    assert task.steps[1].healthcheck.command == "test -x /app/greet.sh"
    backend = LocalBackend()
    solved = check_task(task, backend, oracle=True, log=lambda s: None, artifacts_dir=tmp_path / "run")
    assert solved.reward == 1.0 and [s["reward"] for s in solved.details["steps"]] == [1.0, 1.0, 1.0], solved.details
    for step, text in (("scaffold", "echo hello\n"), ("document", 'echo "Hello, $(cat /app/config.txt)!"\n')):
        assert (tmp_path / "run" / "steps" / step / "artifacts" / "app" / "greet.sh").read_text() == text
    untouched = check_task(task, backend, oracle=False, log=lambda s: None)
    (first,) = untouched.details["steps"]  # scaffold's 0 is below its min_reward: the task stops there
    assert untouched.reward == 0.0 and first["stopped"] == "below its min_reward 1.0"
    # implement's solution fails (greet.sh gone): its health check stops the task after scaffold's 1
    (task.source / "steps" / "implement" / "workdir" / "setup.sh").write_text("rm -f /app/greet.sh\n")
    (task.source / "steps" / "implement" / "solution" / "solve.sh").write_text("true\n")
    task = load_harbor_task(task.source)
    partial = check_task(task, backend, oracle=True, log=lambda s: None)
    assert partial.reward == (1 / 3 if strategy == "mean" else 0.0), partial.details
    assert "step implement: its health check `test -x /app/greet.sh` failed" in partial.details["error"]


def test_a_multi_step_task_names_what_it_lacks(tmp_path):
    task_dir = multi_step_task(tmp_path)
    (task_dir / "steps" / "document" / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"task.toml: step 'document' has no steps/document/tests/test.sh"):
        load_harbor_task(task_dir)
    (task_dir / "task.toml").write_text(MULTI_STEP_TOML.format(strategy="best"))
    with pytest.raises(TaskError, match=r"multi_step_reward_strategy 'best' is not one of \['mean', 'final'\]"):
        load_harbor_task(task_dir)


@pytest.mark.parametrize("log,says", [
    ("/tests/run-tests.sh: line 27: make: command not found\n", "needs make, a build tool its FROM image has"),
    ("ERROR: JAVA_HOME is not set and no 'java' command could be found in your PATH.\n", "needs java, a build tool"),
    ("ERROR: usage: pytest\npytest: error: unrecognized arguments: --cov=. --json-report\n", "needs pytest plugins"),
    ("requests.exceptions.ConnectionError: [Errno 101] Network is unreachable\n", "needs the network"),
    ("curl: (6) Could not resolve host: astral.sh\n", None),  # uv's installer: the image has uv
    ("bash: line 1: ./wordcount: No such file or directory\nbash: wordcount: command not found\n", None)])
def test_what_a_zero_verdict_could_not_run_is_named(log, says):
    """A zero that the verifier could not have given otherwise names what was missing; the agent's own missing
    program (a build it was asked for) is a plain zero."""
    found = missing_tool(log, "the test script")
    assert (found is None) if says is None else (says in found), found


def test_buildkit_run_flags_and_volume_are_read_past_or_refused_in_one_line(tmp_path):
    """A cache mount or a network flag on RUN only speeds a build and VOLUME only describes the container: noted,
    the command still runs. A secret or bind mount and COPY of a URL need a container engine: one line each."""
    task_dir = hello_world(tmp_path)
    dockerfile = task_dir / "environment" / "Dockerfile"
    dockerfile.write_text("FROM python:3.12-slim\nWORKDIR /app\nRUN --mount=type=cache,target=/root/.cache/pip "
                          "--network=default echo built > built.txt\nVOLUME /data\n")
    task = load_harbor_task(task_dir)
    assert [step.command for step in task.setup] == ["echo built > built.txt"]
    assert sum("RUN --" in n and "is ignored" in n for n in task.notes) == 2, task.notes
    assert any("VOLUME has no effect" in n for n in task.notes), task.notes
    for line, says in (("RUN --mount=type=secret,id=token cat /run/secrets/token", "RUN --mount=type=secret"),
                       ("COPY https://example.com/a.txt /app/", "COPY of https://example.com/a.txt")):
        dockerfile.write_text(f"FROM python:3.12-slim\nWORKDIR /app\n{line}\n")
        with pytest.raises(TaskError, match=f"Dockerfile:3: {says}.* needs a container backend"):
            load_harbor_task(task_dir)
