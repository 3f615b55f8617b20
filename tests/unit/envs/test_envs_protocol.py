"""The agent protocol: tool calls in the chat template's format, malformed calls counted, observations truncated
with a marker, budgets, self-summarisation segments; and the Dockerfile subset the local backend honours."""

import re

import pytest

from megatron_composer.data.chat_template import format_tool_call, render_text
from rl.envs.agent import EpisodeConfig, ScriptedPolicy, run_episode
from rl.envs.dockerfile import UnsupportedDockerfile, image_family, parse_dockerfile
from rl.envs.task import CopyStep, DirectoryTree, RunStep, ScriptVerifier, Task, TaskError, TaskLimits
from rl.envs.task_folder import verifier_requirements
from rl.envs.tools import TRUNCATION_MARKER, ToolBox, truncate
from rl.sandbox import LocalSandbox
from rl.sandbox.local import bwrap_problem

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


def _task(tmp_path, max_turns=50) -> Task:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / "hello.py").write_text("print('hello')\n")
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test.sh").write_text("mkdir -p /logs/verifier\n"
                                   "grep -q 'goodbye' /app/hello.py && echo 1 > /logs/verifier/reward.txt "
                                   "|| echo 0 > /logs/verifier/reward.txt\n")
    return Task(name="t", instruction="Make hello.py say goodbye.", tree=DirectoryTree(tree),
                verifier=ScriptVerifier(tests), limits=TaskLimits(max_turns=max_turns))


def call(name, **args):
    return format_tool_call(name, args)


def test_truncate_keeps_head_and_tail_with_marker():
    text = "a" * 100 + "b" * 100
    out, cut = truncate(text, 30)
    assert cut and out.startswith("a" * 20) and out.endswith("b" * 10)
    assert TRUNCATION_MARKER.format(n=170) in out
    assert truncate("short", 30) == ("short", False)


@needs_bwrap
def test_episode_tools_edit_and_reward(tmp_path):
    task = _task(tmp_path)
    turns = [
        "I'll look." + call("list_dir") + call("read_file", path="hello.py"),
        call("edit_file", path="hello.py", old_string="hello", new_string="goodbye"),
        call("search", pattern="good", glob="*.py") + call("run", command="python3 hello.py"),
        call("todo", action="add", text="check") + call("submit", summary="done"),
    ]
    with LocalSandbox(tmp_path / "tree") as sbx:
        res = run_episode(task, sbx, ScriptedPolicy(turns))
    assert res.reward == 1.0 and res.stop_reason == "submitted" and res.turns == 4
    assert res.malformed_tool_calls == 0 and res.open_todos == 1
    tool_msgs = [m["content"] for m in res.messages if m["role"] == "tool"]
    assert tool_msgs[0].strip() == "hello.py" and tool_msgs[1] == "print('hello')\n"
    assert "hello.py:1:print('goodbye')" in tool_msgs[3] and "goodbye\n[exit code 0]" in tool_msgs[4]
    # The transcript renders with the project's chat template, tool calls included.
    text = render_text(res.messages)
    assert '<tool_call>{"name": "edit_file"' in text and "<|im_start|>tool\n" in text


@needs_bwrap
def test_malformed_calls_are_error_observations_and_counted(tmp_path):
    task = _task(tmp_path)
    turns = [
        "<tool_call>{not json}</tool_call>",
        call("frobnicate", x=1) + call("read_file") + call("read_file", path=3) + call("run", command="x", cwd="/"),
        "<tool_call>{\"name\": \"run\", \"arguments\": {\"command\": \"ls\"}}",  # unterminated
        call("todo", action="explode") + call("read_file", path="nope.txt"),
        call("submit"),
    ]
    with LocalSandbox(tmp_path / "tree") as sbx:
        res = run_episode(task, sbx, ScriptedPolicy(turns))
    assert res.malformed_tool_calls == 7
    assert res.tool_errors == 1  # reading a missing file is a tool error, not a malformed call
    errors = [m["content"] for m in res.messages if m["role"] == "tool"]
    assert "not valid JSON" in errors[0] and "unknown tool 'frobnicate'" in errors[1]
    assert "needs argument(s) path" in errors[2] and "must be str" in errors[3] and "no argument 'cwd'" in errors[4]
    assert "unterminated" in errors[5] and "no such file" in errors[7]
    assert res.reward == 0.0


@needs_bwrap
def test_long_observation_truncated(tmp_path):
    with LocalSandbox(None) as sbx:
        tools = ToolBox(sbx, max_observation_chars=500)
        obs = tools.call("run", {"command": "seq 1 10000"})
    assert obs.truncated and "characters truncated" in obs.text and len(obs.text) < 600
    assert obs.text.startswith("1\n2\n") and "[exit code 0]" in obs.text


@needs_bwrap
def test_edit_file_exact_match_rules(tmp_path):
    with LocalSandbox(None) as sbx:
        tools = ToolBox(sbx)
        tools.call("write_file", {"path": "d/f.txt", "content": "x = 1\nx = 1\n"})
        assert "occurs 2 times" in tools.call("edit_file", {"path": "d/f.txt", "old_string": "x = 1",
                                                            "new_string": "y"}).text
        assert "not found" in tools.call("edit_file", {"path": "d/f.txt", "old_string": "zz", "new_string": "y"}).text
        assert not tools.call("edit_file", {"path": "d/f.txt", "old_string": "x = 1", "new_string": "y = 2",
                                            "replace_all": True}).error
        assert sbx.read_text("/app/d/f.txt") == "y = 2\ny = 2\n"


@needs_bwrap
def test_turn_and_token_budgets(tmp_path):
    task = _task(tmp_path, max_turns=3)
    looping = ScriptedPolicy([call("run", command="true")] * 10)
    with LocalSandbox(tmp_path / "tree") as sbx:
        res = run_episode(task, sbx, looping, verify=False)
        assert res.stop_reason == "max_turns" and res.turns == 3
        res = run_episode(_task(tmp_path), sbx, ScriptedPolicy([call("run", command="true")] * 10),
                          EpisodeConfig(max_generated_tokens=25), count_tokens=lambda s: 10, verify=False)
        assert res.stop_reason == "token_budget" and res.turns == 3 and res.generated_tokens == 30
        res = run_episode(task, sbx, ScriptedPolicy(["I am done."]), verify=False)
        assert res.stop_reason == "no_tool_call"


@needs_bwrap
def test_self_summarisation_starts_new_segments(tmp_path):
    task = _task(tmp_path)
    seen = []

    def summarize(messages):
        seen.append(messages[-1]["content"])
        return f"summary {len(seen)}: edited nothing yet"

    turns = [call("run", command="seq 1 200")] * 3 + [
        call("edit_file", path="hello.py", old_string="hello", new_string="goodbye") + call("submit")]
    with LocalSandbox(tmp_path / "tree") as sbx:
        res = run_episode(task, sbx, ScriptedPolicy(turns), EpisodeConfig(summary_trigger_tokens=300),
                          summarize=summarize)
    assert len(res.segments) == 4 and res.summaries[0].startswith("summary 1")
    assert "Summarise" in seen[0]
    assert res.segments[1][1]["role"] == "user" and "summary 1" in res.segments[1][1]["content"]
    assert res.segments[1][1]["content"].startswith(task.instruction)
    assert res.reward == 1.0  # the episode's reward covers all segments


# Dockerfile subset -------------------------------------------------------------------------------------------
def _dockerfile(tmp_path, text, files=("a.py",)):
    ctx = tmp_path / "environment"
    ctx.mkdir(exist_ok=True)
    for f in files:
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        (ctx / f).write_text("x\n")
    (ctx / "Dockerfile").write_text(text)
    return ctx / "Dockerfile", ctx


def test_dockerfile_plan(tmp_path):
    path, ctx = _dockerfile(tmp_path, "# comment\nFROM python:3.11 AS base\nARG VER=1.2\nWORKDIR /app\n"
                                      "ENV A=1 B=\"two words\"\nENV LEGACY value with spaces\n"
                                      "COPY a.py ./\nCOPY [\"src\", \"/app/src\"]\nWORKDIR sub\n"
                                      "RUN echo $A \\\n && echo v${VER}\nEXPOSE 80\nCMD [\"bash\"]\n",
                            files=("a.py", "src/m.py"))
    plan = parse_dockerfile(path, ctx)
    assert plan.base_image == "python:3.11" and plan.workdir == "/app/sub"
    assert plan.env == {"A": "1", "B": "two words", "LEGACY": "value with spaces"}
    copy_a, copy_src, run = plan.steps
    assert isinstance(copy_a, CopyStep) and copy_a.dest == "/app/a.py" and copy_src.dest == "/app/src"
    assert isinstance(run, RunStep) and run.cwd == "/app/sub" and run.command == "echo $A && echo v${VER}"
    assert any("EXPOSE" in n for n in plan.notes) and any("CMD" in n for n in plan.notes)


@pytest.mark.parametrize("line, match", [
    ("RUN --mount=type=secret,id=token cat /run/secrets/token", r"Dockerfile:3: RUN --mount=type=secret needs"),
    ("COPY --from=builder /x /app/x", r"COPY --from=builder needs that image, which this machine cannot make"),
    ("COPY --from=docker.io/library/golang:1.22 /usr/local/go /usr/local/go",
     r"COPY --from=docker.io/library/golang:1.22 needs that image"),
    ("ADD ftp://example.com/x.tgz /app/", r"ADD of ftp://example.com/x.tgz needs a container backend"),
])
def test_dockerfile_unsupported_instructions_are_named(tmp_path, line, match):
    path, ctx = _dockerfile(tmp_path, f"FROM debian\nWORKDIR /app\n{line}\n")
    with pytest.raises(UnsupportedDockerfile, match=match):
        parse_dockerfile(path, ctx)


@pytest.mark.parametrize("lines, reason", [
    ("RUN chmod +x /app/a.py && python3 /app/a.py > /app/out.txt 2>/dev/null", None),
    ("RUN mkdir -p sub && cp a.py sub/ && echo ${HOME}/x ./y", None),
    ("RUN apt-get update && apt-get install -y jq", r"Dockerfile:3: RUN reaches past /app"),
    ("RUN pip install --no-cache-dir requests==2.31", r"RUN reaches past /app"),
    ("RUN python3 -m pip install numpy", r"RUN reaches past /app"),
    ("RUN curl -LsSf https://astral.sh/uv/install.sh | sh", r"RUN reaches past /app"),
    ("RUN ln -s /app/a.py /usr/local/bin/a", r"RUN reaches past /app"),
    ("RUN mkdir -p /data", r"RUN reaches past /app"),
    ("COPY a.py /opt/a.py", r"Dockerfile:3: COPY to /opt/a.py is outside /app"),
    ("WORKDIR /srv", r"Dockerfile:3: WORKDIR /srv is outside /app"),
])
def test_dockerfile_steps_that_reach_past_the_tree_need_an_image(tmp_path, lines, reason):
    """Steps that stay in /app run on the host's system; the first that reaches further makes the task an image."""
    path, ctx = _dockerfile(tmp_path, f"FROM python:3.11-slim\nWORKDIR /app\n{lines}\nUSER nobody\n",
                            files=("a.py",))
    plan = parse_dockerfile(path, ctx)
    assert plan.user == "nobody" and any("USER nobody is the image's user" in n for n in plan.notes)
    setup, image = plan.task_parts(path, 60.0)
    if reason is None:
        assert plan.build_reason is None and image.required is None and setup == plan.steps
        assert any("the host's system stands in" in n for n in plan.notes)
    else:
        assert re.search(reason, image.required) and setup == [] and image.steps == plan.steps
        assert image.stand_in == ("ln -sfn /usr/bin/python3 /usr/local/bin/python",)  # python:* images have python
        assert image.packages == () and image.timeout_s == 60.0
        assert any("built into an image on a Debian root filesystem" in n for n in plan.notes)


def test_image_digest_follows_what_the_build_reads(tmp_path):
    path, ctx = _dockerfile(tmp_path, "FROM gcc:12-bookworm\nCOPY src /opt/src\nRUN make -C /opt/src\n",
                            files=("src/m.c",))

    def recipe():
        return parse_dockerfile(path, ctx).task_parts(path, 60.0)[1]

    first = recipe()
    assert first.packages == ("build-essential",) and recipe().key == first.key
    (ctx / "src" / "m.c").write_text("int main(void) { return 0; }\n")
    assert recipe().key != first.key  # a copied file changed
    changed = recipe().key
    path.write_text(path.read_text() + "ENV A=1\n")
    assert recipe().key != changed


@pytest.mark.parametrize("image, family", [
    ("python:3.11-slim-bookworm", "python"), ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "python"),
    ("ubuntu:24.04", "ubuntu"), ("node:20", "node"), ("gcc:12-bookworm", "gcc"), ("python:3.12-alpine", "alpine"),
    ("docker.io/library/alpine:3.19", "alpine"), ("golang1.22", "golang"), ("mcr.microsoft.com/foo/bar:1", "bar"),
])
def test_image_family(image, family):
    assert image_family(image) == family


def test_a_non_debian_base_that_must_be_built_is_refused(tmp_path):
    path, ctx = _dockerfile(tmp_path, "FROM alpine:3.19\nRUN apk add --no-cache bash\n")
    with pytest.raises(UnsupportedDockerfile, match=r"a non-Debian base \(alpine\) must be built .*container backend"):
        parse_dockerfile(path, ctx).task_parts(path, 60.0)
    path.write_text("FROM alpine:3.19\nCOPY a.py /app/\n")
    (ctx / "a.py").write_text("x")
    assert parse_dockerfile(path, ctx).task_parts(path, 60.0)[1].required is None  # the host can stand in


def test_dockerfile_copy_source_must_exist_in_context(tmp_path):
    path, ctx = _dockerfile(tmp_path, "FROM debian\nCOPY ../secret /app/\n")
    with pytest.raises(TaskError, match=r"Dockerfile:2: COPY source '../secret'"):
        parse_dockerfile(path, ctx)


@needs_bwrap
def test_reward_written_by_the_agent_does_not_count(tmp_path):
    task = _task(tmp_path)
    hack = (call("run", command="ls /tests") + call("run", command="mkdir -p /tests")
            + call("run", command="mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt") + call("submit"))
    with LocalSandbox(tmp_path / "tree") as sbx:
        res = run_episode(task, sbx, ScriptedPolicy([hack]))
        assert res.reward == 0.0
        ls_tests, mkdir_tests = [m["content"] for m in res.messages if m["role"] == "tool"][:2]
        assert "No such file or directory" in ls_tests  # tests arrive only after the agent finished
        assert "Read-only file system" in mkdir_tests or "Permission denied" in mkdir_tests  # / is root's
        (tmp_path / "tests" / "test.sh").write_text("echo lots > /logs/verifier/reward.txt\n")
        res = task.verifier.verify(sbx, task)
    assert res.reward == 0.0 and "must hold one plain decimal number" in res.details["error"]


def test_dockerfile_add_unpacks_local_archives(tmp_path):
    import tarfile

    path, ctx = _dockerfile(tmp_path, "FROM debian\nWORKDIR /app\nADD src.tar.gz lib/\nADD a.py /app/b.py\n")
    member = tmp_path / "m.txt"
    member.write_text("inside\n")
    with tarfile.open(ctx / "src.tar.gz", "w:gz") as tf:
        tf.add(member, arcname="pkg/m.txt")
    unpack, plain = parse_dockerfile(path, ctx).steps
    assert unpack.dest == "/app/lib" and unpack.unpack and not plain.unpack
    assert plain.dest == "/app/b.py" and plain.src == ctx / "a.py"
    if bwrap_problem() is None:
        with LocalSandbox(None) as sbx:
            for step in (unpack, plain):
                step.apply(sbx, timeout=60)
            assert sbx.exec("cat lib/pkg/m.txt b.py").output == "inside\nx\n"


@pytest.mark.parametrize("script, wanted", [
    ("uvx \\\n  -p 3.13 \\\n  -w pytest==8.4.1 \\\n  -w pytest-json-ctrf==0.3.5 \\\n"
     "  pytest --ctrf /logs/x.json /tests -rA\n",
     ["pytest==8.4.1", "pytest-json-ctrf==0.3.5", "pytest"]),
    ("uv init\nuv add pytest==8.4.1 requests  # comment\nuv run pytest /tests/test_outputs.py -rA\n",
     ["pytest==8.4.1", "requests"]),
    ("uv venv .t && source .t/bin/activate && uv pip install 'numpy>=1.26' $EXTRA -r /tests/req.txt\n",
     ["numpy>=1.26"]),
    ("FOO=1 sudo python3 -m pip install --no-cache-dir -q pandas==2.2.2; pip3 install --target /x six\n",
     ["pandas==2.2.2", "six"]),
    ("uv tool run --from black==24.1 black --check .\nuvx --with=a==1 ruff check .\n", ["black==24.1", "a==1", "ruff"]),
    ("uvx --from harbor-rewardkit==0.2.0 rewardkit /tests\n", ["harbor-rewardkit==0.2.0"]),  # the command is no package
    ("#!/bin/bash\n# uvx --with not-this pytest\npython3 -m pytest /tests -rA\n", []),
])
def test_verifier_requirements(script, wanted):
    """What a verifier script has uv or pip install, so that a built image can carry it."""
    assert verifier_requirements(script) == wanted
