"""The loader reads before it builds: Harbor's task.toml (every key up to schema 1.4, defaults and deprecated
spellings) and Terminal-Bench 1's task.yaml into one typed description, refused in one line where a key cannot be
honoured; multi-stage Dockerfiles and COPY --from; the stand-in follows the FROM image; check_task gives no verdict
without a reason."""

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from rl.envs.check_task import check_task, explain, missing_command, network_failure, partial_credit, verdict_problem
from rl.envs.dockerfile import StageCopyStep, UnsupportedDockerfile, _in_stage, host_lacks, parse_dockerfile
from rl.envs.harbor import TaskFormatWarning, load_harbor_task, read_task_folder, verifier_packages
from rl.envs.task import TaskError, VerifyResult, prepare_task
from rl.envs.task_config import read_harbor_config
from rl.sandbox.base import ExecResult
from rl.sandbox.local import LocalBackend, bwrap_problem

REPO = Path(__file__).resolve().parents[3]
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

SCHEMA_1_4 = """\
schema_version = "1.4"
source = "example-dataset"
artifacts = ["/app/out.txt", { source = "/app/logs", destination = "logs", exclude = ["*.tmp"] }]

[task]
name = "example/full"
version = "1.0.0"
description = "every key"
authors = [{ name = "A", email = "a@example.com" }]
keywords = ["demo"]

[metadata]
difficulty = "easy"

[agent]
timeout_sec = 300.0
user = "agent"
network_mode = "no-network"

[verifier]
timeout_sec = 120.0
user = "root"
network_mode = "public"
env = { MODE = "strict" }

[[verifier.collect]]
command = "cp /app/out.txt /logs/artifacts/ || true"
timeout_sec = 30.0

[environment]
build_timeout_sec = 900.0
os = "Linux"
cpus = 2
memory_mb = 4096
storage_mb = 8192
gpus = 0
network_mode = "public"
env = { GREETING = "hi" }
skills_dir = "/opt/skills"
workdir = "/app/src"

[environment.healthcheck]
command = "test -f /app/ready"
interval_sec = 0.5
timeout_sec = 10.0
start_period_sec = 2.0
start_interval_sec = 0.25
retries = 4

[[environment.mcp_servers]]
name = "tools"
transport = "stdio"
command = "python3"
args = ["/opt/tools/server.py"]

[solution]
env = { SOLVER = "1" }
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def harbor(root: Path, toml: str, dockerfile: str = "FROM ubuntu:24.04\nWORKDIR /app\n",
           test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", extra: dict | None = None) -> Path:
    return write(root / "task", {"task.toml": toml, "instruction.md": "Do it.\n",
                                 "environment/Dockerfile": dockerfile, "tests/test.sh": test_sh,
                                 "solution/solve.sh": "touch /app/out.txt\n", **(extra or {})})


def test_every_key_of_schema_1_4_is_read_into_the_task(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskFormatWarning)  # nothing unknown, nothing ignored
        task = load_harbor_task(harbor(tmp_path, SCHEMA_1_4))
    assert (task.agent_user, task.verifier_user) == ("agent", "root")
    assert (task.agent_network, task.verifier_network, task.verifier_mode) == ("none", "public", "shared")
    assert task.workdir == "/app/src" and task.env["GREETING"] == "hi" and task.skills_dir == "/opt/skills"
    assert (task.limits.agent_timeout_s, task.limits.verifier_timeout_s, task.limits.setup_timeout_s) == (300, 120, 900)
    assert (task.limits.memory_mb, task.limits.storage_mb, task.limits.cpus) == (4096, 8192, 2)
    hc = task.healthcheck
    assert (hc.command, hc.interval_s, hc.timeout_s, hc.start_period_s, hc.start_interval_s, hc.retries) == (
        "test -f /app/ready", 0.5, 10.0, 2.0, 0.25, 4)
    (mcp,) = task.mcp_servers
    assert (mcp.name, mcp.transport, mcp.command, mcp.args) == ("tools", "stdio", "python3", ("/opt/tools/server.py",))
    (hook,) = task.collect
    assert (hook.command, hook.service, hook.timeout_s) == ("cp /app/out.txt /logs/artifacts/ || true", "main", 30.0)
    assert [(a.source, a.destination, a.exclude) for a in task.artifacts] == [
        ("/app/out.txt", None, ()), ("/app/logs", "logs", ("*.tmp",))]
    assert task.verifier.env == {"MODE": "strict"} and task.solution.env == {"SOLVER": "1"}
    assert task.metadata == {"difficulty": "easy"}


def test_harbor_defaults_and_deprecated_spellings(tmp_path):
    cfg = read_harbor_config(write(tmp_path, {"task.toml": 'version = "1.0"\nmulti_step_reward_mode = "mean"\n'
                                                           '[environment]\nmemory = "3G"\nstorage = "512M"\n'
                                                           "allow_internet = false\n"}) / "task.toml")
    assert cfg.schema_version == "1.0" and cfg.environment.memory_mb == 3072 and cfg.environment.storage_mb == 512
    assert cfg.environment.network == "no-network"  # allow_internet = false, the spelling before network_mode
    assert any("multi_step_reward_mode (before schema 1.3) is dropped" in n for n in cfg.notes)
    bare = read_harbor_config(write(tmp_path / "b", {"task.toml": "[verifier]\n[agent]\n"}) / "task.toml")
    assert (bare.agent.timeout_s, bare.verifier.timeout_s, bare.environment.build_timeout_s) == (600, 600, 600)
    assert bare.environment.network == "public" and bare.verifier.mode == "shared"  # Harbor's defaults
    separate = read_harbor_config(write(tmp_path / "c", {"task.toml": "[verifier.environment]\ncpus = 2\n"})
                                  / "task.toml")
    assert separate.verifier.mode == "separate" and separate.verifier.environment.cpus == 2


@pytest.mark.parametrize("toml, says", [
    ('[environment]\nos = "windows"\n', r"\[environment\].os = 'windows': the sandboxes here are Linux"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["api.example.com"]\n',
     r"\[environment\].network_mode = \"allowlist\" \(api.example.com\) cannot be honoured"),
    ('[agent]\nnetwork_mode = "intranet"\n', r"\[agent\].network_mode must be one of public, no-network, allowlist"),
    ("[environment]\ngpus = 1\n", r"needs 1 GPU"),
    ('[environment.tpu]\ntype = "v6e"\ntopology = "2x4"\n', r"\[environment\].tpu: the task needs a TPU slice"),
    ('[environment]\nmemory = "2G"\nmemory_mb = 1024\n', r"memory = '2G' \(2048 MB\) and memory_mb = 1024 disagree"),
    ('[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n', r"contradict each other"),
    ('[verifier]\nenvironment_mode = "remote"\n', r"environment_mode must be \"shared\" or \"separate\""),
    ('[[verifier.collect]]\nservice = "db"\ncommand = "pg_dump > /tmp/x"\n', r"names service 'db'"),
    ('[[environment.mcp_servers]]\nname = "web"\ntransport = "sse"\nurl = "https://mcp.example.com/sse"\n',
     r"MCP server 'web' is at https://mcp.example.com/sse, which is neither a service"),
    ('[[environment.mcp_servers]]\nname = "x"\ntransport = "stdio"\n', r"transport stdio needs a command"),
    ('artifacts = [{ source = "/app/../etc/passwd" }]\n', r"\[artifacts\[1\]\].source must be a path without '..'"),
    ('[environment.healthcheck]\ninterval_sec = 1\n', r"\[environment.healthcheck\].command must be a shell"),
    ('[agent]\nuser = true\n', r"\[agent\].user must be a user name or uid"),
])
def test_a_key_that_cannot_be_honoured_is_refused_in_one_line(tmp_path, toml, says):
    with pytest.raises(TaskError) as e:
        load_harbor_task(harbor(tmp_path, toml))
    (line,) = str(e.value).splitlines()
    assert re.search(says, line), line


def test_unknown_keys_are_named_and_steps_fall_back_to_the_task(tmp_path):
    toml = SCHEMA_1_4.replace('[agent]\n', '[agent]\nsetup_timeout_sec = 60\nflavour = "x"\n') + """
[[steps]]
name = "one"
min_reward = { tests = 1.0 }
artifacts = ["/app/one.txt"]
[steps.agent]
timeout_sec = 30.0
[steps.verifier]
user = "checker"
env = { STEP = "1" }
[steps.healthcheck]
command = "true"

[[steps]]
name = "two"
"""
    root = harbor(tmp_path, toml, extra={f"steps/{n}/{f}": "echo 1 > /logs/verifier/reward.txt\n"
                                         for n in ("one", "two") for f in ("instruction.md", "tests/test.sh")})
    with pytest.warns(TaskFormatWarning, match=r"unknown key \[agent\].flavour is ignored"):
        task = load_harbor_task(root)
    one, two = (s.task for s in task.steps)
    assert one.limits.agent_timeout_s == 30 and two.limits.agent_timeout_s == 300  # the task's [agent]
    assert (one.verifier_user, two.verifier_user, one.agent_user) == ("checker", "root", "agent")
    assert one.verifier.env == {"MODE": "strict", "STEP": "1"} and two.verifier.env == {"MODE": "strict"}
    assert task.steps[0].min_reward == {"tests": 1.0} and task.steps[0].healthcheck.command == "true"
    assert [a.source for a in one.artifacts] == ["/app/out.txt", "/app/logs", "/app/one.txt"]


def test_the_dockerfile_user_is_the_phases_user_unless_the_task_names_one(tmp_path):
    task = load_harbor_task(harbor(tmp_path, "[verifier]\nuser = 0\n",
                                   dockerfile="FROM python:3.12-slim\nRUN useradd -m dev\nUSER dev\nWORKDIR /app\n"))
    assert (task.agent_user, task.verifier_user) == ("dev", 0)


def test_a_workdir_outside_app_is_built_and_tb1_reads_its_yaml(tmp_path):
    task = load_harbor_task(harbor(tmp_path, '[environment]\nworkdir = "/srv/project"\n'))
    assert task.workdir == "/srv/project" and "[environment].workdir /srv/project is outside /app" in (
        task.image.required)
    tb1 = write(tmp_path / "tb1", {"task.yaml": "instruction: Say hi.\nmax_agent_timeout_sec: 99\nauthor_x: 1\n",
                                   "Dockerfile": "FROM python:3.11\nWORKDIR /app\nUSER runner\n",
                                   "run-tests.sh": "pytest $TEST_DIR/test_outputs.py -rA\n"})
    task = load_harbor_task(tb1)
    assert task.instruction == "Say hi." and task.limits.agent_timeout_s == 99 and task.agent_user == "runner"
    assert read_task_folder(tb1).format == "Terminal-Bench 1"
    assert any("unknown key author_x is ignored" in n for n in task.notes)


def test_a_verifier_that_imports_rewardkit_gets_harbor_rewardkit(tmp_path):
    root = harbor(tmp_path, "[verifier]\n", test_sh="python3 /tests/grade.py\n",
                  extra={"tests/grade.py": "from rewardkit import Rubric\n"})
    assert verifier_packages(read_task_folder(root)) == ["harbor-rewardkit"]
    task = load_harbor_task(root)
    assert task.image.verifier_packages == ("harbor-rewardkit",) and "harbor-rewardkit" in task.image.required
    (root / "tests" / "test.sh").write_text("uvx --from harbor-rewardkit==0.2.0 rewardkit /tests\n")
    assert verifier_packages(read_task_folder(root)) == ["harbor-rewardkit==0.2.0"]  # not twice


# Dockerfiles --------------------------------------------------------------------------------------------------
def test_multi_stage_dockerfiles_copy_out_of_earlier_stages_and_uv_s_image(tmp_path):
    ctx = write(tmp_path / "ctx", {"main.c": "int main(void) { return 0; }\n", "Dockerfile": """\
        ARG BASE=debian:bookworm-slim
        FROM gcc:12 AS builder
        WORKDIR /src
        COPY main.c .
        RUN gcc -o /src/hello main.c
        FROM builder AS tested
        RUN ./hello
        FROM ${BASE}
        COPY --from=ghcr.io/astral-sh/uv:0.8.4 /uv /uvx /bin/
        COPY --from=tested /src/hello /usr/local/bin/hello
        COPY --from=0 /src/main.c /app/
        WORKDIR /app
        """})
    plan = parse_dockerfile(ctx / "Dockerfile", ctx)
    assert plan.base_image == "debian:bookworm-slim" and plan.workdir == "/app"
    uv, hello, source = plan.steps
    assert isinstance(uv, StageCopyStep) and (uv.sources, uv.dest, uv.dest_is_dir) == (["/uv", "/uvx"], "/bin", True)
    assert (hello.stage, hello.dest, source.stage) == ("tested", "/usr/local/bin/hello", "builder")
    assert "uv==0.8.4" in plan.stages[uv.stage].steps[0].command
    tested = plan.stages["tested"]  # FROM builder: the builder's steps, then its own
    assert [s.command for s in tested.steps if hasattr(s, "command")] == ["gcc -o /src/hello main.c", "./hello"]
    _, recipe = plan.task_parts(ctx / "Dockerfile", 60.0)
    assert set(recipe.stages) == {"ghcr.io/astral-sh/uv:0.8.4", "tested", "builder"}
    assert recipe.stages["builder"].packages == ("build-essential",)
    assert "COPY --from=ghcr.io/astral-sh/uv:0.8.4 copies out of another image" in recipe.required
    (ctx / "main.c").write_text("int main(void) { return 1; }\n")  # a stage's file changed: the image did too
    assert parse_dockerfile(ctx / "Dockerfile", ctx).task_parts(ctx / "Dockerfile", 60.0)[1].key != recipe.key


def test_empty_and_comment_lines_inside_a_continuation_are_dropped_as_docker_drops_them(tmp_path):
    ctx = write(tmp_path, {"Dockerfile": "FROM debian\nRUN apt-get install -y \\\n    curl \\\n\n"
                                         "    # a comment between the packages\n    jq\nWORKDIR /app\n"})
    plan = parse_dockerfile(ctx / "Dockerfile", ctx)
    assert plan.workdir == "/app" and plan.runs == ["apt-get install -y curl jq"], plan.runs


def test_a_failed_build_step_says_what_failed_not_a_routine_notice():
    """A pinned package version the stand-in's archive lacks is named as such; pip's warning about root, printed
    after the error, does not stand in for it."""
    from rl.envs.task import build_lacks, last_meaningful_line

    downgrade = ("The following packages will be DOWNGRADED:\n  ca-certificates\n"
                 "E: Packages were downgraded and -y was used without --allow-downgrades.\n")
    why = build_lacks("apt-get install -y ca-certificates=20230311+deb12u1", downgrade)
    assert why.startswith("it pins a package version (E: Packages were downgraded") and "container backend" in why
    missing = "E: Version '1.2-3' for 'jq' was not found\n"
    assert "it pins a package version (E: Version '1.2-3' for 'jq' was not found)" in build_lacks("", missing)
    output = ("Successfully installed pytest-8.3.0\nAssertionError: pytest must not be importable\n"
              "WARNING: Running pip as the 'root' user can result in broken permissions\n"
              "[notice] A new release of pip is available: 24.0 -> 25.1\n")
    assert last_meaningful_line(output) == "AssertionError: pytest must not be importable"
    assert last_meaningful_line("") == "no output"
    assert last_meaningful_line("[notice] only a notice\n") == "[notice] only a notice"


def test_buildkit_s_platform_arguments_have_this_host_s_values(tmp_path):
    ctx = write(tmp_path, {"Dockerfile": "ARG TARGETARCH\nFROM debian\nARG TARGETARCH\nARG TARGETOS\nARG OTHER\n"
                                         "RUN echo uv-${TARGETOS}-${TARGETARCH}-${OTHER}.tgz\n"})
    (run,) = parse_dockerfile(ctx / "Dockerfile", ctx).steps  # ARGs are the RUN step's environment, as in a build
    assert run.env["TARGETOS"] == "linux" and run.env["TARGETARCH"] in ("amd64", "arm64") and run.env["OTHER"] == ""


def test_copy_from_a_stage_follows_links_inside_that_stage_only(tmp_path):
    root = tmp_path / "stage"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "tool").write_text("x")
    (root / "bin").symlink_to("usr/bin")
    (root / "usr" / "bin" / "alias").symlink_to("/usr/bin/tool")
    (root / "escape").symlink_to("/etc")
    assert _in_stage(root, "/bin/alias") == [root / "usr" / "bin" / "tool"]
    assert _in_stage(root, "/escape/passwd") == []  # /etc of the stage, which has none
    assert _in_stage(root, "/../../etc/passwd") == []
    assert _in_stage(root, "/usr/bin/*") == [root / "usr" / "bin" / "tool"]


def test_the_stand_in_follows_what_the_from_image_has(tmp_path):
    if host_lacks("python", {"test.sh": "python x.py"}) is None:
        pytest.skip("this host's system has `python`")
    task = load_harbor_task(harbor(tmp_path, "[verifier]\n", dockerfile="FROM python:3.12-slim\nWORKDIR /app\n",
                                   test_sh="python /tests/check.py\n"))
    assert "tests/test.sh calls `python`, which FROM python images have" in task.image.required
    assert task.image.stand_in == ("ln -sfn /usr/bin/python3 /usr/local/bin/python",)
    plain = load_harbor_task(harbor(tmp_path / "u", "[verifier]\n", dockerfile=(
        "FROM ubuntu:24.04\nRUN ln -s /usr/bin/python3 /usr/bin/python\nWORKDIR /app\n")))
    assert plain.image.stand_in == () and plain.image.packages == ()  # the Dockerfile's own link has its place
    assert load_harbor_task(harbor(tmp_path / "v", "[verifier]\n", dockerfile="FROM python:3.12-slim\n",
                                   test_sh="python3 x.py\n")).image.required is None  # python3 the host has


def test_copy_from_an_image_this_machine_cannot_make_is_refused_naming_it(tmp_path):
    with pytest.raises(UnsupportedDockerfile, match=r"COPY --from=node:20 needs that image"):
        load_harbor_task(harbor(tmp_path, "[verifier]\n", dockerfile="FROM debian\nCOPY --from=node:20 /x /y\n"))


# No verdict without a reason ----------------------------------------------------------------------------------
@pytest.mark.parametrize("output, host", [
    ("curl: (6) Could not resolve host: files.example.org\n", "files.example.org"),
    ("  File \"/tests/t.py\", line 3, in <module>\n    urllib.request.urlopen('https://data.example.net/x.csv')\n"
     "urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>\n", "data.example.net"),
    ("requests.exceptions.ConnectionError: HTTPSConnectionPool(host='huggingface.co', port=443): Max retries "
     "exceeded with url: /api/models (Caused by NameResolutionError(\"<urllib3.connection.HTTPSConnection object>: "
     "Failed to resolve 'huggingface.co' ([Errno -3] Temporary failure in name resolution)\"))\n", "huggingface.co"),
    ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
     "cached files.\n", "huggingface.co"),
    ("W: Failed to fetch http://ppa.launchpad.net/x  Temporary failure resolving 'ppa.launchpad.net'\n",
     "ppa.launchpad.net"),
    ("WARNING: Retrying ... Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')"
     ": /simple/notebook/\nERROR: Could not find a version; HTTPSConnectionPool(host='pypi.org', port=443)\n",
     "pypi.org"),
    ("npm ERR! request to https://registry.npmjs.org/x failed, reason: getaddrinfo ENOTFOUND registry.npmjs.org\n",
     "registry.npmjs.org"),
    ("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/datasets/x/resolve/"
     "main/a.mp4\nRetrying in 1s [Retry 1/5].\n    HF download failed: An error happened\n", "huggingface.co"),
    ("WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError('<HTTPSConnection>: Failed to "
     "establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/datasets/\n"
     "ERROR: No matching distribution found for datasets==4.0.0\n", "pypi.org"),  # pip names the project only
    ("curl: (6) Could not resolve host: astral.sh\n", None),  # uv's installer: every image has uv
    ("requests.exceptions.ConnectionError: HTTPConnectionPool(host='localhost', port=8000): Failed to establish "
     "a new connection: [Errno 111] Connection refused\n", None),  # the agent's own server, not the network
])
def test_every_network_failure_names_its_host(output, host):
    said = network_failure(output)
    assert (said is None) if host is None else (said == f"it asked for {host}, beyond the sandbox's network"), said


def test_a_missing_command_and_a_network_failure_are_named_in_the_verdict(tmp_path):
    task = load_harbor_task(harbor(tmp_path, "[verifier]\n"))
    res = ExecResult(exit_code=127, output="/tests/test.sh: line 2: python: command not found\n", output_bytes=9,
                     duration_s=0.1)
    assert missing_command(res.output) == "python" and missing_command("sh: 1: uvx: not found") == "uvx"
    broken = explain(VerifyResult(0.0, res.output, {"error": "the verifier wrote no reward (exit code 127)"}, res),
                     task)
    assert broken.details["error"].endswith("(the command `python` is missing: exit status 127)")
    silent = explain(VerifyResult(0.0, "curl: (6) Could not resolve host: example.com\n", {}, res), task)
    assert silent.details["error"] == ("the verifier needs the network, which the sandbox did not give it: it asked "
                                       "for example.com, beyond the sandbox's network")


def test_an_untouched_task_that_scores_the_reference_s_reward_is_flagged_and_partial_credit_said():
    full, partial, ref = VerifyResult(1.0, ""), VerifyResult(0.65, "", {"rewards": {"a": 1.0, "b": 0.3}}), \
        VerifyResult(1.0, "")
    assert verdict_problem(full, None) == ("the verifier does not depend on the agent's work: the untouched task "
                                           "scores 1")
    assert verdict_problem(partial, ref) is None and verdict_problem(VerifyResult(0.0, ""), ref) is None
    assert "as much as the reference solution (0.65)" in verdict_problem(partial, VerifyResult(0.65, ""))
    assert partial_credit(partial) == ("partial credit: the untouched task scores 0.65 (a 1, b 0.3), which its "
                                       "verifier gives for work already there")


@needs_bwrap
def test_check_task_gives_no_verdict_without_a_reason(tmp_path):
    """A reference solution whose commands failed voids the verdict (exit 2, its last line); an untouched task
    that scores 1 exits 1; partial credit is one line; a task's health check runs before the agent and its
    artifacts are collected."""
    def run(task_dir, *flags):
        return subprocess.run([sys.executable, "tools/check_task.py", str(task_dir), *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    root = harbor(tmp_path, 'artifacts = ["/app/out.txt"]\n[environment.healthcheck]\ncommand = "test -f /tmp/up"\n'
                  "start_period_sec = 5\nstart_interval_sec = 0.2\n",
                  dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nENTRYPOINT [\"sh\", \"-c\", \"(sleep 1; touch "
                             "/tmp/up) & exec \\\"$@\\\"\", \"sh\"]\n",
                  test_sh="[ -f /app/out.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > "
                          "/logs/verifier/reward.txt\n",
                  extra={"solution/solve.sh": "echo done > /app/out.txt\nmkdir -p /logs/artifacts && echo log > "
                                              "/logs/artifacts/solver.log\n"})
    res = run(root, "--oracle", "--artifacts", str(tmp_path / "run"))
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "1", res.stdout + res.stderr
    assert (tmp_path / "run" / "app" / "out.txt").read_text() == "done\n"
    assert (tmp_path / "run" / "logs" / "artifacts" / "solver.log").read_text() == "log\n"  # Harbor's convention
    (root / "solution" / "solve.sh").write_text("echo done > /app/out.txt\npip install notebook\n")
    res = run(root, "--oracle")
    assert res.returncode == 2 and "the reference solution failed (exit code" in res.stderr, res.stderr
    assert "so its verdict is void" in res.stderr
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    res = run(root)
    assert res.returncode == 1 and "the verifier does not depend on the agent's work" in res.stderr, res.stderr
    (root / "tests" / "test.sh").write_text("echo '{\"a\": 1, \"b\": 0}' > /logs/verifier/reward.json\n")
    (root / "solution" / "solve.sh").write_text("echo done > /app/out.txt\n")
    res = run(root)
    assert res.returncode == 1 and "as much as the reference solution (0.5)" in res.stderr, res.stderr
    (root / "task.toml").write_text("[environment.healthcheck]\ncommand = 'false'\ninterval_sec = 0.1\n")
    res = run(root)
    assert res.returncode == 2 and "the health check `false` failed 3 times in a row" in res.stderr, res.stderr


@needs_bwrap
def test_a_partially_credited_untouched_task_says_so(tmp_path):
    root = harbor(tmp_path, "[verifier]\n", test_sh=(
        "b=0; [ -f /app/out.txt ] && b=1\n"
        "echo \"{\\\"style\\\": 1, \\\"works\\\": $b}\" > /logs/verifier/reward.json\n"),
        extra={"solution/solve.sh": "echo ok > /app/out.txt\n"})
    res = subprocess.run([sys.executable, "tools/check_task.py", str(root)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "0.5", res.stdout + res.stderr
    assert "partial credit: the untouched task scores 0.5 (style 1, works 0)" in res.stderr
    assert check_task(load_harbor_task(root), LocalBackend(), oracle=True, log=lambda _: None).reward == 1.0


@needs_bwrap
def test_a_prebuilt_image_alone_is_refused_naming_it_where_the_backend_cannot_run_it(tmp_path):
    root = harbor(tmp_path, '[environment]\ndocker_image = "ghcr.io/example/task:1.0"\n')
    (root / "environment" / "Dockerfile").unlink()
    task = load_harbor_task(root)
    assert task.docker_image == "ghcr.io/example/task:1.0" and task.environment_dir is None
    with pytest.raises(TaskError, match=r"runs on the prebuilt image ghcr.io/example/task:1.0 \(no Dockerfile beside "
                                        r"it\), which the local backend cannot run"):
        check_task(task, LocalBackend(), oracle=False, log=lambda _: None)
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    assert any("is built from environment/Dockerfile here" in n for n in load_harbor_task(root).notes)


def test_environment_variables_come_from_this_host_as_harbor_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MC_TEST_TOKEN", "t-1")
    task = load_harbor_task(harbor(tmp_path, '[environment.env]\nTOKEN = "${MC_TEST_TOKEN}"\nURL = "${MC_NOT_SET:-'
                                   'http://x}"\nLITERAL = "a ${B} c"\n[verifier.env]\nV = "${MC_TEST_TOKEN}"\n'))
    assert (task.env["TOKEN"], task.env["URL"], task.env["LITERAL"]) == ("t-1", "http://x", "a ${B} c")
    assert task.verifier.env == {"V": "t-1"}
    with pytest.raises(TaskError, match=r"KEY = \$\{MC_NOT_SET\} needs the variable MC_NOT_SET in this host's env"):
        load_harbor_task(harbor(tmp_path / "b", '[environment.env]\nKEY = "${MC_NOT_SET}"\n'))


@needs_bwrap
def test_a_reference_solution_short_of_the_network_its_task_declares_is_no_verdict(tmp_path):
    root = harbor(tmp_path, '[environment]\nnetwork_mode = "public"\n',
                  test_sh="[ -s /app/page.html ] && echo 1 > /logs/verifier/reward.txt || echo 0 > "
                          "/logs/verifier/reward.txt\n",
                  extra={"solution/solve.sh": "python3 -c 'import urllib.request as u; u.urlretrieve(\"http://example"
                                              ".com/\", \"/app/page.html\")' 2>/dev/null || true\n"})
    task = load_harbor_task(root)
    backend = LocalBackend()
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as box:
            given = getattr(box, "network", "none")
    finally:
        snapshot.discard()
    result = check_task(task, backend, oracle=True, log=lambda _: None)
    if given == "public":  # the sandbox gives the agent what the task declares: the reference solution's verdict
        assert "error" not in result.details or "network" not in result.details["error"]
    else:
        assert result.details["error"] == (
            "the task gives its agent the network (network_mode \"public\"), which this sandbox did not, and its "
            "reference solution reaches for it (http://example.com): it scores 0 without it")
    (root / "solution" / "solve.sh").write_text("echo offline > /app/other.txt\n")  # no reach: a plain wrong verdict
    assert "error" not in check_task(load_harbor_task(root), backend, oracle=True, log=lambda _: None).details


def test_a_task_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    root = harbor(tmp_path, "[verifier]\n")
    (root / "instruction.md").write_bytes(b"caf\xe9\n")
    with pytest.raises(TaskError, match=r"instruction.md is not UTF-8 text \(byte 3\)"):
        load_harbor_task(root)


@needs_bwrap
def test_a_stdio_mcp_server_the_sandbox_lacks_stops_the_episode_before_the_agent(tmp_path):
    toml = '[[environment.mcp_servers]]\nname = "tools"\ntransport = "stdio"\ncommand = "{}"\n'
    root = harbor(tmp_path, toml.format("no-such-mcp-server"))
    with pytest.raises(TaskError, match=r"MCP server 'tools' starts with `no-such-mcp-server`, which the sandbox does "
                                        r"not have"):
        check_task(load_harbor_task(root), LocalBackend(), oracle=False, log=lambda _: None)
    (root / "task.toml").write_text(toml.format("sh"))
    assert check_task(load_harbor_task(root), LocalBackend(), oracle=False, log=lambda _: None).reward == 1.0


def test_a_verdict_names_the_host_that_matters_not_the_verifier_s_package_retries(tmp_path):
    task = load_harbor_task(harbor(tmp_path, "[verifier]\n"))
    apt = "W: Temporary failure resolving 'deb.debian.org'\n"
    res = explain(VerifyResult(0.0, apt + "curl: (6) Could not resolve host: github.com\n", {"error": "broken"}), task)
    assert res.details["error"] == "broken (it asked for github.com, beyond the sandbox's network)"
    res = explain(VerifyResult(0.0, apt, {"error": "void (it asked for pypi.org, beyond the sandbox's network)"}), task)
    assert res.details["error"] == "void (it asked for pypi.org, beyond the sandbox's network)"
    assert "error" not in explain(VerifyResult(0.0, apt + "FAILED test_x\n", {}), task).details  # apt alone: a verdict
