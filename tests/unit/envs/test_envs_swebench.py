"""SWE-bench instances from a local clone: resolved only when FAIL_TO_PASS tests pass and PASS_TO_PASS still do."""

import json
import subprocess

import pytest

from megatron_composer.data.chat_template import format_tool_call
from rl.envs.agent import ScriptedPolicy, noop_policy, oracle_policy, run_episode
from rl.envs.swebench import load_swebench, parse_test_log, swebench_task
from rl.envs.task import TaskError, prepare_task
from rl.sandbox.local import LocalBackend, bwrap_problem

CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = ("import unittest\n\nfrom calc import sub\n\n\n# the expected result, away from the test patch's context\n"
         "EXPECTED_SUB = 2\n\n\nclass TestCalc(unittest.TestCase):\n"
         "    def test_sub(self):\n        self.assertEqual(sub(5, 3), EXPECTED_SUB)\n")


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def _diff(repo, path, new_text):
    old = (repo / path).read_text()
    (repo / path).write_text(new_text)
    d = subprocess.run(["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout
    (repo / path).write_text(old)
    return d


@pytest.fixture
def instance(tmp_path):
    repo = tmp_path / "repos" / "acme__calc"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    test_patch = _diff(repo, "tests/test_calc.py", TESTS.replace("from calc import sub", "from calc import add, sub")
                       + "\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    gold = _diff(repo, "calc.py", CALC.replace("return a - b", "return a + b", 1))
    (repo / "calc.py").write_text(CALC.replace("a - b", "a * b"))  # later history the task must not see
    _git(repo, "commit", "-qam", "later")
    record = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
              "problem_statement": "add() subtracts instead of adding.", "test_patch": test_patch, "patch": gold,
              "FAIL_TO_PASS": json.dumps(["test_add (tests.test_calc.TestCalc.test_add)"]),
              "PASS_TO_PASS": ["test_sub (tests.test_calc.TestCalc.test_sub)"], "test_cmd": "python3 -m unittest -v",
              "setup_cmd": "git rev-parse HEAD > .prepared_at"}
    jsonl = tmp_path / "instances.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    return jsonl, tmp_path / "repos", record


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_swebench_gold_patch_resolves_and_noop_does_not(instance):
    jsonl, repos, _ = instance
    (task,) = load_swebench(jsonl, repos)
    backend = LocalBackend()
    snap = prepare_task(task, backend)
    try:
        with backend.fork(snap) as sbx:
            assert "return a - b" in sbx.read_text("/app/calc.py")  # base commit, not later history
            assert sbx.read_text("/app/.prepared_at").strip() == task.verifier.base_commit  # setup ran once
            res = run_episode(task, sbx, noop_policy())
            assert res.reward == 0.0
            assert res.verify.details["FAIL_TO_PASS failing"] == ["test_add (tests.test_calc.TestCalc.test_add)"]
        with backend.fork(snap) as sbx:
            res = run_episode(task, sbx, oracle_policy(task))
            assert res.reward == 1.0, res.verify.output
        with backend.fork(snap) as sbx:  # breaking a PASS_TO_PASS test is not a resolution
            sbx.exec("git apply - <<'EOF'\n" + task.solution.patch + "EOF\nsed -i 's/return a - b/return 0/' calc.py")
            res = task.verifier.verify(sbx, task)
            assert res.reward == 0.0 and res.details["PASS_TO_PASS failing"]
        with backend.fork(snap) as sbx:  # editing the tests to pass trivially does not help either
            sbx.exec("printf 'import unittest\\n' > tests/test_calc.py")
            assert task.verifier.verify(sbx, task).reward == 0.0
    finally:
        snap.discard()


def test_swebench_missing_field_names_file_and_field(instance, tmp_path):
    jsonl, repos, record = instance
    del record["FAIL_TO_PASS"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n" + json.dumps(record) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:2: missing field\(s\) 'FAIL_TO_PASS'"):
        load_swebench(bad, repos)
    record["FAIL_TO_PASS"] = "not json"
    with pytest.raises(TaskError, match=r"field 'FAIL_TO_PASS' must be a list"):
        swebench_task(record, repos / "acme__calc", where="x.jsonl:1")
    with pytest.raises(TaskError, match=r"no local clone of acme/calc"):
        load_swebench(jsonl, tmp_path / "elsewhere")


def test_parse_test_log_formats():
    log = ("PASSED tests/test_a.py::test_one\nFAILED tests/test_a.py::test_two - assert 1 == 2\n"
           "test_x (pkg.tests.T.test_x) ... ok\ntest_y (pkg.tests.T) ... FAIL\n")
    assert parse_test_log(log) == {"tests/test_a.py::test_one": "PASSED", "tests/test_a.py::test_two": "FAILED",
                                   "test_x (pkg.tests.T.test_x)": "ok", "test_y (pkg.tests.T)": "FAIL"}


def _future(repo):
    """History the task must not see: the upstream fix on a branch and a tag, a reflog, an unreachable blob."""
    _git(repo, "checkout", "-qb", "upstream-fix")
    (repo / "calc.py").write_text(CALC.replace("return a - b", "return a + b  # FUTURE-FIX", 1))
    _git(repo, "commit", "-qam", "the upstream fix")
    _git(repo, "tag", "v2.0")
    fix = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    _git(repo, "checkout", "-q", "-")
    blob = subprocess.run(["git", "-C", str(repo), "hash-object", "-w", "--stdin"], input="UNREACHABLE-FUTURE\n",
                          capture_output=True, text=True, check=True).stdout.strip()
    return fix, blob


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_swebench_repo_holds_no_future(instance):
    jsonl, repos, record = instance
    fix, blob = _future(repos / "acme__calc")
    (task,) = load_swebench(jsonl, repos)
    backend = LocalBackend()
    snap = prepare_task(task, backend)
    probes = ("git log --all --format='%H %s'; git show master:calc.py; git show upstream-fix:calc.py; "
              "git show v2.0:calc.py; git reflog; git branch -a; git tag; git rev-list --all; "
              "git fsck --unreachable --no-reflogs 2>&1; git cat-file --batch-all-objects --batch-check; "
              "grep -ra FUTURE .git; ls .git")
    try:
        with backend.fork(snap) as sbx:
            out = sbx.exec(probes).output
            assert record["base_commit"] in out  # the base commit itself is there
            for future in (fix, blob, "FUTURE", "upstream fix", "later", "v2.0\n"):
                assert future not in out, (future, out)
            for obj in (fix, blob):  # not even by name
                assert sbx.exec(f"git cat-file -e {obj}").exit_code != 0
            assert sbx.exec("git rev-parse HEAD").output.strip() == record["base_commit"]
            assert run_episode(task, sbx, noop_policy()).reward == 0.0
        with backend.fork(snap) as sbx:
            assert run_episode(task, sbx, oracle_policy(task)).reward == 1.0
    finally:
        snap.discard()


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_check_task_reads_a_swebench_jsonl(instance, tmp_path):
    import sys
    from pathlib import Path

    jsonl, repos, record = instance
    other = dict(record, instance_id="acme__calc-2")
    jsonl.write_text(json.dumps(record) + "\n" + json.dumps(other) + "\n")
    repo_root = Path(__file__).resolve().parents[3]

    def cli(*args):
        return subprocess.run([sys.executable, "tools/check_task.py", str(jsonl), "--repos", str(repos), *args],
                              cwd=repo_root, capture_output=True, text=True, timeout=300)

    for flags, want in ((["--instance", "acme__calc-1"], "0"), (["--instance", "acme__calc-1", "--oracle"], "1")):
        res = cli(*flags)
        assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == want, res.stderr + res.stdout
    res = cli()
    assert res.returncode == 2 and "holds 2 instances (acme__calc-1, acme__calc-2); choose one with --instance" \
        in res.stderr
    res = cli("--instance", "nope")
    assert res.returncode == 2 and "has no instance 'nope'" in res.stderr


# The agent owns the repository's .git: what it can rewrite there must not reach the verdict --------------------
BROKEN_SUB = "sed -i 's/^    return a - b$/    return 0/' calc.py\n"  # sub() broken: PASS_TO_PASS must fail
WEAK_TEST = "sed -i 's/^EXPECTED_SUB = 2$/EXPECTED_SUB = 0/' tests/test_calc.py\n"  # the test that catches it, weakened
COMMIT = "git -c user.name=a -c user.email=a@a commit -qam weak\n"
ATTACKS = {
    # "restore the test files to base_commit" would restore the agent's commit
    "git-replace": WEAK_TEST + COMMIT + "git replace {base} HEAD\ngit reset -q --hard {base}\n",
    # a smudge filter, declared where the agent may write, weakens the test whenever git checks it out
    "smudge-filter": ("printf '* filter=weaken\\n' > .git/info/attributes\n"
                      "git config filter.weaken.smudge \"sh -c 'touch /app/filter-ran; "
                      "sed s/^EXPECTED_SUB\\ =\\ 2/EXPECTED_SUB\\ =\\ 0/'\"\n"
                      "rm tests/test_calc.py && git checkout -- tests/test_calc.py\n"),
}


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_swebench_verdict_ignores_what_the_agent_wrote_into_git(instance, attack):
    """Gold fix for add() with sub() broken: PASS_TO_PASS must catch it, whatever the agent did to .git to make
    the verifier restore a weakened test (a replace ref for the base commit, a smudge filter). The attack is
    real: git in the agent's tree shows the weakened test."""
    jsonl, repos, record = instance
    (task,) = load_swebench(jsonl, repos)
    backend = LocalBackend()
    snap = prepare_task(task, backend)
    try:
        with backend.fork(snap) as sbx:
            gold = "git apply - <<'EOF'\n" + task.solution.patch + "EOF\n"
            setup = sbx.exec(gold + BROKEN_SUB + ATTACKS[attack].format(base=record["base_commit"]))
            assert setup.exit_code == 0, setup.output
            shown = sbx.exec(f"git show {record['base_commit']}:tests/test_calc.py | "
                             "git -c core.hooksPath=/dev/null checkout -q -- tests/test_calc.py; "
                             "cat tests/test_calc.py").output
            assert "EXPECTED_SUB = 0" in shown, shown  # what git in the agent's tree restores
            sbx.exec("rm -f /app/filter-ran")
            res = run_episode(task, sbx, ScriptedPolicy([format_tool_call("submit", {})]))
            assert res.reward == 0.0, res.verify.output
            assert res.verify.details["PASS_TO_PASS failing"] == ["test_sub (tests.test_calc.TestCalc.test_sub)"]
            assert sbx.read_text("/app/filter-ran") is None  # no agent-declared filter ran in the verifier
    finally:
        snap.discard()


# The work tree is the agent's: nothing there may stand in for the test files or the test runner ----------------
PASSING_TESTS = ("import unittest\n\n\nclass TestCalc(unittest.TestCase):\n    def test_add(self):\n        pass\n\n"
                 "    def test_sub(self):\n        pass\n")
FAKE_RUN = ("import sys\nfor t in ('test_add', 'test_sub'):\n"
            "    print(f'{t} (tests.test_calc.TestCalc.{t}) ... ok', file=sys.stderr)\nprint('OK', file=sys.stderr)\n")
SHADOWS = {
    # a package of the test module's name is found before the test file rebuilt on the host
    "package-shadows-the-test-file": "mkdir -p tests/test_calc && cat > tests/test_calc/__init__.py <<'EOF'\n"
                                     + PASSING_TESTS + "EOF\n",
    # bytecode whose hash is never checked against the source, where Python looks for the test module's cache
    "unchecked-bytecode": "cat > /tmp/fake.py <<'EOF'\n" + PASSING_TESTS + "EOF\n"
                          "python3 -c \"import py_compile, sys; py_compile.compile('/tmp/fake.py', "
                          "cfile=f'tests/__pycache__/test_calc.{sys.implementation.cache_tag}.pyc', "
                          "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\"\n",
    # a `unittest` package in the working directory, which `python3 -m unittest` would run instead of the real one
    "runner-in-the-work-tree": "mkdir -p unittest && touch unittest/__init__.py && cat > unittest/__main__.py <<'EOF'\n"
                               + FAKE_RUN + "EOF\n",
}


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
@pytest.mark.parametrize("attack", sorted(SHADOWS))
def test_nothing_in_the_work_tree_stands_in_for_the_tests_or_their_runner(instance, attack):
    """add() is left broken; the agent plants what Python would load in place of the rebuilt test file or of the
    test runner. The verdict stays 0 with add()'s test failing, through the rollout path; the planted code is
    real (it passes when run the way the verifier would run it without its defences)."""
    jsonl, repos, _ = instance
    (task,) = load_swebench(jsonl, repos)
    backend = LocalBackend()
    snap = prepare_task(task, backend)
    try:
        with backend.fork(snap) as sbx:
            planted = sbx.exec(SHADOWS[attack])
            assert planted.exit_code == 0, planted.output
            res = run_episode(task, sbx, ScriptedPolicy([format_tool_call("submit", {})]))
            assert res.reward == 0.0, res.verify.output
            assert res.verify.details["FAIL_TO_PASS failing"] == ["test_add (tests.test_calc.TestCalc.test_add)"]
        with backend.fork(snap) as sbx:  # the same plant, run as the test command runs without the defences
            sbx.exec(SHADOWS[attack])
            naive = sbx.exec("python3 -m unittest -v tests.test_calc.TestCalc.test_add")
            assert "test_add (tests.test_calc.TestCalc.test_add) ... ok" in naive.output, naive.output
    finally:
        snap.discard()
