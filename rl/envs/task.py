"""The task model: instruction, file tree, setup, verifier, reference solution, limits.

A task is backend-agnostic. `prepare_task` builds it once in a sandbox backend and returns a snapshot that a
pool forks per sample; `verify` runs the task's verifier in a sandbox after the agent finished and returns
the reward. Loaders for public formats (Harbor/Terminal-Bench folders, SWE-bench instances) produce Tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl.envs.network import unreached_hosts
from rl.envs.verdict import (
    VERIFIER_SITE,
    HostFault,
    host_shortage,
    one_line,
    site_files,
    verifier_env,
    why_runs_cannot_pass,
)
from rl.sandbox.base import BASE_ENV, ExecResult, Sandbox, SandboxError, SandboxLimits, Service
from rl.sandbox.image import ImageBuilder, ImageRecipe
from rl.sandbox.leftovers import held_dir


class TaskError(ValueError):
    """A task definition is invalid; the message names the file and the field."""


def read_utf8(path: Path) -> str:
    """A task file's text; TaskError in one line when it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path} is not UTF-8 text (byte {e.start}): a task's text files are UTF-8") from None


@dataclass
class TaskLimits:
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    setup_timeout_s: float = 600.0
    memory_mb: int = 2048
    cpus: float = 1.0
    storage_mb: int = 10240
    max_turns: int = 50

    def sandbox_limits(self, base: SandboxLimits | None = None) -> SandboxLimits:
        """The sandbox limits this task asks for, on top of a backend's defaults."""
        base = base or SandboxLimits()
        return dataclasses.replace(base, memory_mb=self.memory_mb, disk_mb=min(base.disk_mb, self.storage_mb),
                                   cpu_time_s=max(base.cpu_time_s, int(self.agent_timeout_s)))


# File trees ---------------------------------------------------------------------------------------------------
class TaskTree(Protocol):
    def materialize(self, dest: Path) -> None: ...


@dataclass
class DirectoryTree:
    path: Path

    def materialize(self, dest: Path) -> None:
        from rl.sandbox.layers import copy_tree

        copy_tree(self.path, dest)


@dataclass
class EmptyTree:
    def materialize(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)


@dataclass
class GitTree:
    """A repository checked out at a commit, holding only that commit's history: no branches, tags, remotes or
    reflog, and no object that commit cannot reach (the repository's future stays outside the sandbox)."""

    repo: Path
    commit: str

    def materialize(self, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        git = ["git", "-C", str(dest), "-c", "advice.detachedHead=false"]
        for argv in (["git", "init", "--quiet", str(dest)],
                     git + ["fetch", "--quiet", "--no-tags", "--no-recurse-submodules", str(Path(self.repo).resolve()),
                            self.commit],
                     git + ["checkout", "--quiet", "--detach", "FETCH_HEAD"]):
            res = subprocess.run(argv, capture_output=True, text=True)
            if res.returncode != 0:
                raise TaskError(f"cannot check out {self.repo} at {self.commit}: {' '.join(argv[3:6])}: "
                                f"{res.stderr.strip()}")
        for leftover in ("FETCH_HEAD", "ORIG_HEAD", "logs"):  # the fetch's record and the reflog
            path = dest / ".git" / leftover
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


# Setup steps --------------------------------------------------------------------------------------------------
@dataclass
class CopyStep:
    """Put a host file or directory's contents at `dest` (Dockerfile COPY/ADD)."""

    src: Path
    dest: str
    origin: str
    unpack: bool = False  # src is a tar archive whose members go to dest (Dockerfile ADD)

    def apply(self, sandbox: Sandbox, timeout: float) -> None:
        try:
            if not self.unpack:
                sandbox.copy_in(self.src, self.dest, merge=True)
                return
            with held_dir("add") as tmp:
                _safe_extract(self.src, Path(tmp))
                sandbox.copy_in(tmp, self.dest, merge=True)
        except (SandboxError, tarfile.TarError) as e:
            raise TaskError(f"{self.origin}: {e}") from None


def _safe_extract(archive: Path, dest: Path) -> None:
    """Unpack a tar archive whose members may not escape dest (no absolute paths, '..' or device files)."""
    with tarfile.open(archive) as tf:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tf.extractall(dest, filter="data")
            return
        for m in tf.getmembers():
            target = os.path.realpath(dest / m.name)
            if not target.startswith(os.path.realpath(dest) + os.sep) or not (m.isfile() or m.isdir()):
                raise tarfile.TarError(f"{archive.name}: member {m.name!r} is not a plain file inside the archive")
        tf.extractall(dest)


@dataclass
class RunStep:
    """Run a shell command once when the task is prepared (Dockerfile RUN, a setup command). A failure is one line
    (what the command lacked, or its last line of output) naming the file that keeps its whole log."""

    command: str
    cwd: str
    env: dict[str, str]
    origin: str

    def apply(self, sandbox: Sandbox, timeout: float) -> None:
        res = sandbox.exec(f"mkdir -p {shlex.quote(self.cwd)} && cd {shlex.quote(self.cwd)} && {self.command}",
                           cwd="/", env=self.env, timeout=timeout)
        earlier = getattr(sandbox, "outputs", None)  # an image build's steps so far
        if earlier is not None:
            earlier.append((self.origin, res.output))
        if not res.ok:
            if earlier is not None:  # an image's build has what it needs but the wider internet
                why = build_lacks(self.command, res.output) or next(  # a download an earlier step lost silently
                    (f"{lacks} (at {origin})" for origin, output in earlier[-2::-1]
                     if (lacks := build_lacks("", output))), None)
            else:
                why = (missing_tool(self.command, "this setup command", _INSTALLS)
                       or missing_tool(res.output, "this setup command"))
            last = last_meaningful_line(res.output)
            raise TaskError(f"{self.origin}: " + (why or f"setup command failed ({res.describe()}): {last[:200]}")
                            + f" (the whole log: {setup_log(self, res)})")


def build_lacks(command: str, output: str) -> str | None:
    """What a failed image build step needed that the build cannot have, in words with the way out, or None."""
    if ppa := re.search(r"add-apt-repository\s+(?:-\S+\s+)*(ppa:\S+)", command):
        return (f"it adds the Ubuntu archive {ppa.group(1)} (Launchpad), which the build cannot reach and a Debian "
                "stand-in cannot use: build the task on a container backend from its own image")
    if hosts := unreached_hosts(output, ignore=()):
        return (f"it downloads from {', '.join(hosts)}, which the build cannot reach (it reaches the package "
                "registries only): build the task on a container backend with internet, or put the download into the "
                "task")
    if package := _NO_PACKAGE.search(output):
        return (f"Debian's archive, which stands in for the FROM image's, has no package {package.group(1)}: build "
                "the task on a container backend from its own image")
    if pinned := _PINNED.search(output):
        return (f"it pins a package version ({pinned.group(0).strip()}) of the FROM image's archive; Debian's, which "
                "stands in for it, has another: build the task on a container backend from its own image")
    return None


def last_meaningful_line(output: str) -> str:
    """The last line of a failed command's output that is not a tool's routine notice (pip's warning about root,
    its upgrade notice), which would hide the error above it."""
    lines = [line for line in output.splitlines() if line.strip()]
    said = [line for line in lines if not _NOTICE.match(line.strip())]
    return (said or lines or ["no output"])[-1]


def setup_log(step: "RunStep", res: ExecResult) -> Path:
    """A failed setup command's command and output, kept in a file (under the temporary folder's
    megatron-composer-setup-logs/) for the one-line error."""
    folder = Path(tempfile.gettempdir()) / "megatron-composer-setup-logs"
    folder.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="setup-", suffix=".log", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(f"# {step.origin}\n# {res.describe()}\n$ {step.command}\n{res.output}")
    return Path(path)


# Verifiers ----------------------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    reward: float
    output: str
    details: dict = field(default_factory=dict)
    exec_result: ExecResult | None = None


class Verifier(Protocol):
    def verify(self, sandbox: Sandbox, task: "Task") -> VerifyResult: ...


# What a log says when the local backend (the read-only host system) lacks what a task needs, and the fix.
_MISSING_TOOLS = (  # the first that shows is named: a failed download comes before the tool it would have fetched
    # uv's installer (`curl ... astral.sh/uv/install.sh | sh`) is not counted: a built image carries uv offline, and
    # where uv is missing its own line below names it
    (re.compile(r"megatron-composer egress refuses (?!astral\.sh\b)([\w.-]+)"),
     "{0}, which the run's egress proxy does not allow (it reaches the package registries): add it to the run's "
     "egress hosts, or put what it downloads into the task"),
    (re.compile(r"Could not resolve host(?!: astral\.sh\b)|Temporary failure in name resolution|"
                r"Network is unreachable"),
     "the network, which sandboxes do not have: put what it downloads into the task or onto the host"),
    (re.compile(r"No module named '?pytest'?|pytest: (?:command )?not found"),
     "pytest, which this host lacks: install it for the host's python3 (apt-get install python3-pytest)"),
    (re.compile(r"\buvx?: (?:command )?not found"), "uv, which this host lacks: install uv on the host"),
    (re.compile(r"^uvx? \(megatron-composer image\): this image has no uv", re.MULTILINE),
     "uv, which the image's base lacks (it was built without a way to PyPI): rebuild it where the package index is "
     "reachable"),
    (re.compile(r"Because ([\w.\[\]-]+)\S* was not found in the cache"),
     "{0} in the image's uv cache (offline, a verifier's uv finds what the build cached of what tests/test.sh has uv "
     "or pip install): name it there or in the Dockerfile"),
    (re.compile(r"\b(make|cmake|gcc|g\+\+|cc|c\+\+|clang|git|javac?|mvn|gradle|node|npm|npx|yarn|go|cargo|rustc|"
                r"ruby|php|perl|dotnet|swift|ghc|Rscript): (?:command )?not found|no '(java)' command could be found"),
     "{0}, a build tool its FROM image has and the stand-in lacks"),
    (re.compile(r"pytest: error: unrecognized arguments: --"),
     "pytest plugins (pytest: error: unrecognized arguments) that its FROM image has and the stand-in lacks"),
    (re.compile(r"^E: .*(?:/var/lib/apt|/var/lib/dpkg|are you root)|^(?:yum|dnf|apk|microdnf): .*(?:denied|"
                r"Read-only|root)|error: externally-managed-environment", re.MULTILINE),
     "to install packages, which the local backend cannot (its system is the read-only host): install them on "
     "the host"),
    (re.compile(r"^judge: cannot isolate", re.MULTILINE),
     "a nested sandbox for `judge` (unprivileged user namespaces), which this host lacks: enable them "
     "(sysctl kernel.unprivileged_userns_clone=1)"),
)

_NO_PACKAGE = re.compile(r"^E: (?:Unable to locate package |Package ')([\w.+-]+)", re.MULTILINE)
# apt refusing a pinned version (`pkg=1.2-3`) that the stand-in's archive has not, or has newer already.
_PINNED = re.compile(r"^E: (?:Version '[^']+' for '[^']+' was not found|Packages were downgraded and -y was used "
                     r"without --allow-downgrades)", re.MULTILINE)
_NOTICE = re.compile(r"^(?:WARNING: Running pip as the 'root' user|\[notice\] |WARNING: You are using pip version)")

# A command that installs packages (a Dockerfile RUN line), which cannot work on the local backend.
_INSTALLS = (
    (re.compile(r"(?:^|[;&|(]\s*|\bsudo\s+)(?:apt-get|apt|aptitude|yum|dnf|microdnf|apk|zypper|pacman|"
                r"(?:python3?\s+-m\s+)?pip3?|uv\s+pip|conda|mamba|npm|yarn|pnpm)\s+(?:-\S+\s+)*"
                r"(?:install|add|update|upgrade|ci|-S)\b"),
     "to install packages, which the local backend cannot (its system is the read-only host, without network): "
     "install them on the host and drop the line"),
)


def missing_tool(log: str, what: str = "the verifier", patterns=_MISSING_TOOLS) -> str | None:
    """One line naming what `what` needed that the local backend lacks, and what fixes it; None if none shows."""
    for pattern, need in patterns:
        if found := pattern.search(log):
            named = [g for g in found.groups() if g]  # what the matching alternative captured
            return (f"{what} needs {need.format(*named)}, or run the task on a container backend (--backend docker, "
                    "podman or apptainer) whose image provides it")
    return None


REWARD_FILE_BYTES = 64 * 1024  # a reward file is a number or a small object of numbers
_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?", re.ASCII)


class RewardError(ValueError):
    """A reward file that is not a reward; its message is one line saying why."""


def _in_range(value: float, what: str, low: float, high: float) -> float:
    if not math.isfinite(value):
        raise RewardError(f"{what} is {value!r}, not a finite number")
    if not low <= value <= high:
        raise RewardError(f"{what} is {value!r}, outside the task's reward range [{low:g}, {high:g}]")
    return value


def parse_reward(name: str, raw: str, low: float = 0.0, high: float = 1.0) -> tuple[float, dict[str, float]]:
    """The reward in a verifier's reward file, read strictly, and every number it holds.

    reward.txt: one plain ASCII decimal number (`-?digits[.digits]`, no sign on zero, no exponent, no
    underscores or other digits), optionally followed by one newline. reward.json: an object of at most
    REWARD_FILE_BYTES, of finite numbers (no NaN or Infinity, no duplicate keys); its "reward" key when present,
    else the mean of its values. The reward must lie in [low, high] (the task's declared range). Anything else
    raises RewardError, whose one-line message the verifier records as its error."""
    if len(raw) > REWARD_FILE_BYTES:
        raise RewardError(f"{name} holds {len(raw)} characters; a reward file holds at most {REWARD_FILE_BYTES}")
    if name.endswith(".txt"):
        text = raw[:-1] if raw.endswith("\n") else raw
        if not _DECIMAL.fullmatch(text) or re.fullmatch(r"-0+(?:\.0+)?", text):
            raise RewardError(f"{name} must hold one plain decimal number (e.g. 1 or 0.25), got {raw[:60]!r}")
        value = _in_range(float(text), name, low, high)
        return value, {"reward": value}

    def no_constants(token: str):
        raise RewardError(f"{name} holds {token}, not a finite number")

    def unique(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise RewardError(f"{name} repeats a key ({sorted(k for k in keys if keys.count(k) > 1)[0]!r})")
        return dict(pairs)

    try:
        data = json.loads(raw, parse_constant=no_constants, object_pairs_hook=unique)
    except RecursionError:
        raise RewardError(f"{name} is nested too deeply; it must be a flat object of numbers") from None
    except RewardError:
        raise
    except ValueError as e:
        raise RewardError(f"{name} is not JSON: {str(e).splitlines()[0][:100]}") from None
    if not isinstance(data, dict) or not data:
        raise RewardError(f"{name} must be a non-empty object of numbers")
    bad = [k for k, v in data.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise RewardError(f"{name} values must be numbers; not: {', '.join(bad[:5])}")
    rewards = {}
    for k, v in data.items():
        try:
            rewards[k] = float(v)
        except OverflowError:
            raise RewardError(f"{name}: {k!r} is too large for a number") from None
        if not math.isfinite(rewards[k]):
            raise RewardError(f"{name}: {k!r} is {rewards[k]!r}, not a finite number")
    reward = rewards["reward"] if "reward" in rewards else sum(rewards.values()) / len(rewards)
    return _in_range(reward, f"{name}'s reward", low, high), rewards


# After the verifier ran: the reward folder and files are still the verifier's to write, not links elsewhere (the
# code under test runs as the verifier's user and could lock in a reward it wrote itself).
_REWARD_INTACT = ("cd /logs/verifier 2>/dev/null && [ -w . ] && [ ! -L . ] || { ls -ld /logs/verifier; exit 1; }; "
                  "for f in reward.txt reward.json; do if [ -e $f ] || [ -L $f ]; then "
                  "[ -f $f ] && [ ! -L $f ] && [ -w $f ] || { ls -l $f; exit 1; }; fi; done")


def verifier_anomaly(res: ExecResult, timeout_s: float | None = None) -> str | None:
    """What went wrong in a verifier's run that voids its verdict, or None; the same rule for every verifier. The code
    under test runs inside the verifier's run; whatever it did to the run's machinery (killed the verifier's shell
    after it wrote a reward, filled the disk so the honest reward could not be written) leaves one of these marks,
    and a verdict with any of them is not a verdict. (What it starts dies with the verifier's shell, the init of its
    namespace, before the host reads the exit status.)"""
    if res.timed_out:  # a verifier that hangs has not decided; whatever it wrote before hanging does not count
        return "the verifier timed out" + (f" after {timeout_s:g} s" if timeout_s is not None else "")
    if res.exit_code > 128:  # killed (by the code it tested, say, after that code wrote a reward)
        return f"the verifier was killed before it finished ({res.describe()})"
    if res.disk_exceeded:
        return f"the sandbox's disk limit was hit while the verifier ran ({res.describe()})"
    if res.memory_exceeded:
        return f"the sandbox's memory limit was hit while the verifier ran ({res.describe()})"
    if res.void:
        return res.void
    return None


def void_on_failure(verify):
    """Every verifier's `verify`: a failure entering or running the verifier phase (a folder the agent left where
    the phase's machinery writes, a sandbox the episode broke) is a void verdict with a one-line reason, never an
    exception, so that an episode's own doing scores 0 instead of being rerun. Only a shortage of the host itself
    (its disk or memory) raises, as HostFault: the episode is then run again."""

    @functools.wraps(verify)
    def guarded(self, sandbox: Sandbox, task: "Task") -> VerifyResult:
        try:
            return verify(self, sandbox, task)
        except HostFault:
            raise
        except Exception as e:  # any failure: the verdict says which, in one line
            if (short := host_shortage()) is not None:
                raise HostFault(f"{short} (the verifier phase failed: {one_line(str(e))})") from e
            said = str(e) if isinstance(e, (SandboxError, TaskError, OSError)) else f"{type(e).__name__}: {e}"
            return VerifyResult(0.0, "", {"error": f"the verifier phase failed, no verdict: {one_line(said)}"})

    return guarded


def verifier_phase(task: "Task") -> dict:
    """How a task's verifier phase is entered (`Sandbox.enter_verifier`'s keywords) beyond the default (the agent's
    frozen world, no network, root): Harbor's separate mode with the artifacts it declares, the verifier's network
    and user. Only what the task asks for is passed, so a backend that cannot give it says so in one line."""
    kwargs: dict = {}
    if task.verifier_mode == "separate":
        kwargs.update(separate=True, artifacts=[a.source for a in task.artifacts
                                                if getattr(a, "service", None) in (None, "main")])
    if task.verifier_network != "none":
        kwargs["network"] = task.verifier_network
    if task.verifier_user not in (None, "root", 0, "0"):
        kwargs["user"] = task.verifier_user
    return kwargs


@dataclass
class ScriptVerifier:
    """Harbor's verifier: tests/ copied to /tests after the agent finished, `bash /tests/test.sh` writes
    the reward to /logs/verifier/reward.txt (a number) or reward.json (an object of numbers: its "reward" key
    when present, else the mean of its values, which are all kept in details["rewards"])."""

    tests_dir: Path
    command: str = "bash /tests/test.sh"
    env: dict[str, str] = field(default_factory=dict)
    reward_range: tuple[float, float] = (0.0, 1.0)  # task.toml [verifier].reward_range
    judge_reads: tuple[str, ...] = ()  # task.toml [verifier].judge_reads: files of /tests visible inside `judge`
    shared_tests_dir: Path | None = None  # a multi-step task's tests/: in /tests under each step's own

    @void_on_failure
    def verify(self, sandbox: Sandbox, task: "Task") -> VerifyResult:
        # A reward the agent wrote itself must not count: the verifier gets a /logs/verifier (and /tmp, HOME)
        # the host made afresh, out of the agent's reach.
        sandbox.enter_verifier(**verifier_phase(task))
        if self.shared_tests_dir is not None:
            sandbox.copy_in(self.shared_tests_dir, "/tests")
        sandbox.copy_in(self.tests_dir, "/tests", merge=self.shared_tests_dir is not None)
        with tempfile.TemporaryDirectory() as tmp:
            sandbox.copy_in(site_files(Path(tmp) / "site"), VERIFIER_SITE)
        env = verifier_env(task.env, self.env, {"MC_JUDGE_READS": ":".join(self.judge_reads)})
        res = sandbox.exec(self.command, cwd=task.workdir, env=env, timeout=task.limits.verifier_timeout_s)
        details: dict = {"verifier": res.describe()}
        services = sandbox.end_episode()  # what the agent left running served the verifier; it is done now
        if services:
            details["background_processes"] = services

        def broken(why: str) -> VerifyResult:
            missing = missing_tool(res.output)
            details["error"] = f"{why}; {missing}" if missing else why
            return VerifyResult(0.0, res.output, details, res)

        if anomaly := verifier_anomaly(res, task.limits.verifier_timeout_s):
            return broken(f"{anomaly}; its reward does not count")
        tampered = sandbox.exec(_REWARD_INTACT, cwd="/", env={"PATH": BASE_ENV["PATH"]}, timeout=60)
        if tampered.exit_code != 0:
            return broken("the reward folder /logs/verifier was made unwritable or replaced during verification "
                          f"(by the code under test?); its reward does not count: {tampered.output.strip()[:200]}")
        # Read by the host from the verifier's folder (no link followed, a regular file, bounded), never parsed
        # beyond the strict formats of parse_reward.
        found = {}
        for name in ("reward.txt", "reward.json"):
            try:
                data = sandbox.read_file(f"/logs/verifier/{name}", REWARD_FILE_BYTES)
            except SandboxError as e:
                return broken(f"{e}; its reward does not count")
            if data is not None:
                found[name] = data
        if not found:
            return broken(f"the verifier wrote no /logs/verifier/reward.txt or reward.json ({res.describe()})")
        if len(found) > 1:
            return broken("the verifier's folder holds both reward.txt and reward.json; a verdict is one of them "
                          "(which one was the verifier's is not known), so neither counts")
        ((name, data),) = found.items()
        if len(data) > REWARD_FILE_BYTES:
            return broken(f"/logs/verifier/{name} holds more than {REWARD_FILE_BYTES} bytes; a reward file is a "
                          "number or a small object of numbers")
        try:
            reward, rewards = parse_reward(name, data.decode("utf-8"), *self.reward_range)
        except UnicodeDecodeError:
            return broken(f"/logs/verifier/{name} is not UTF-8 text")
        except RewardError as e:
            return broken(f"/logs/verifier/{e}")
        if name == "reward.json":
            details["rewards"] = rewards
        if reward > self.reward_range[0] and (why := why_runs_cannot_pass(res.output)):
            return broken(f"{why}; its reward ({reward:g}) does not count")
        missing = missing_tool(res.output) if reward == 0.0 else None
        if missing:  # a zero because the verifier could not run says nothing about the agent's work
            details["error"] = missing
        return VerifyResult(reward, res.output, details, res)


# Reference solutions ------------------------------------------------------------------------------------------
@dataclass
class ScriptSolution:
    """Harbor's solution/solve.sh, run from the task's working directory with the folder at /solution."""

    solution_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # task.toml [solution.env]

    def apply(self, sandbox: Sandbox, task: "Task") -> ExecResult:
        sandbox.copy_in(self.solution_dir, "/solution")
        return sandbox.exec("bash /solution/solve.sh", cwd=task.workdir, env=self.env,
                            timeout=task.limits.agent_timeout_s)

    def as_commands(self) -> list[str]:
        """The solution as shell commands an agent can send through the `run` tool."""
        others = [p.name for p in self.solution_dir.iterdir() if p.name != "solve.sh"]
        if others:
            raise TaskError(f"{self.solution_dir}: replaying through tools needs solve.sh alone, found {others}")
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env.items())
        return [exports + (self.solution_dir / "solve.sh").read_text()]


@dataclass
class PatchSolution:
    """A unified diff applied with git (SWE-bench's gold patch)."""

    patch: str

    def as_commands(self) -> list[str]:
        marker = "MC_PATCH_EOF"
        while marker in self.patch:
            marker += "_"
        return [f"git apply --whitespace=nowarn - <<'{marker}'\n{self.patch.rstrip(chr(10))}\n{marker}\n"]

    def apply(self, sandbox: Sandbox, task: "Task") -> ExecResult:
        return sandbox.exec(self.as_commands()[0], cwd=task.workdir, timeout=task.limits.agent_timeout_s)


# The task -----------------------------------------------------------------------------------------------------
@dataclass
class Task:
    name: str
    instruction: str
    tree: TaskTree
    verifier: Verifier
    workdir: str = "/app"
    env: dict[str, str] = field(default_factory=dict)
    setup: list = field(default_factory=list)  # CopyStep | RunStep, applied in order
    solution: ScriptSolution | PatchSolution | None = None
    limits: TaskLimits = field(default_factory=TaskLimits)
    source: Path | None = None
    # For container backends: the build context with a Dockerfile, or a prebuilt image.
    environment_dir: Path | None = None
    docker_image: str | None = None
    # Its Dockerfile as an image the local backend can build: built where `image.required` says the host's system
    # cannot stand in (`setup` is then empty), or where the backend builds every image (`setup` is then skipped).
    image: ImageRecipe | None = None
    entrypoint: tuple[str, ...] = ()  # its Dockerfile's ENTRYPOINT: every sandbox's episode starts with it
    services: list[Service] = field(default_factory=list)  # containers beside its own (a compose file's others)
    notes: list[str] = field(default_factory=list)  # what a backend could not honour, said once
    metadata: dict = field(default_factory=dict)  # free-form (Harbor's [metadata]): e.g. a generated task's tier
    # A multi-step task (Harbor's [[steps]]): its steps run in order in one sandbox (rl/envs/steps.py); the task's
    # own instruction, verifier and solution are its first step's.
    steps: list["TaskStep"] = field(default_factory=list)
    step_reward: str = "mean"  # multi_step_reward_strategy: "mean" of every step (0 for one not reached) or "final"
    # What Harbor's task.toml declares beyond limits (rl/envs/task_config.py), for the sandbox and the episode
    # (rl/envs/episode.py) to honour.
    agent_user: str | int | None = None  # who the agent's commands run as (None: the image's user, root)
    verifier_user: str | int | None = None
    agent_network: str = "none"  # the agent phase's network: "none" or "public"
    verifier_network: str = "none"
    verifier_mode: str = "shared"  # "shared" (the agent's sandbox) or "separate" (a container of its own)
    verifier_environment: object | None = None  # [verifier.environment] (task_config.EnvironmentConfig)
    collect: tuple = ()  # [[verifier.collect]] hooks (task_config.CollectHook): after the agent, before artifacts
    artifacts: tuple = ()  # task_config.Artifact: copied into the run folder after the agent's phase
    healthcheck: object | None = None  # task_config.Healthcheck: must pass before the agent starts
    mcp_servers: tuple = ()  # task_config.McpServer: offered to the agent
    skills_dir: str | None = None  # a folder of the image with skills for the agent


@dataclass
class TaskStep:
    """One step of a multi-step task: a task of its own (instruction, verifier, solution, limits) and what comes
    before its agent (files for the work dir, whose setup.sh runs once; a health check) and after its verifier (the
    reward it needs for the task to go on)."""

    name: str
    task: Task
    workdir_files: Path | None = None  # steps/<name>/workdir/
    healthcheck: object | None = None  # task_config.Healthcheck that must pass before the agent starts
    min_reward: float | dict[str, float] | None = None  # below it (or any key of reward.json below its value): stop


def prepare_task(task: Task, backend, limits: SandboxLimits | None = None):
    """Build the task once: materialise its tree, run its setup in a sandbox, and return a snapshot to fork."""
    build = getattr(backend, "build", None)
    if build is not None:  # container engines build the Dockerfile themselves
        return build(task)
    if task.docker_image is not None and task.environment_dir is None:
        raise TaskError(f"{task.name}: it runs on the prebuilt image {task.docker_image} (no Dockerfile beside it), "
                        f"which the {backend.name} backend cannot run: use a container backend whose engine has it")
    if task.services:
        raise TaskError(f"{task.name}: a multi-container task ({', '.join(s.name for s in task.services)} beside its "
                        f"own) runs on a container backend, not the {backend.name} backend: --backend podman "
                        "--local-base")
    limits = limits or task.limits.sandbox_limits(backend.limits)
    image, setup = None, task.setup
    if task.image is not None and (task.image.required or getattr(backend, "build_images", False)):
        # built once per host, cached by its digest
        if not getattr(backend, "runs_images", False):
            raise TaskError(f"{task.name}: its Dockerfile must be built into an image, which the {backend.name} "
                            "backend cannot run")
        try:
            image = ImageBuilder(backend.image_cache).build_recipe(task.image)
        except SandboxError as e:
            raise TaskError(f"{task.name}: {e}" + (f" (it must be built: {task.image.required})"
                                                   if task.image.required else "")) from None
        setup = []
    with held_dir("task") as tmp:
        tree_dir = Path(tmp) / "tree"
        task.tree.materialize(tree_dir)
        workdir = task.workdir if image is not None else "/app"
        on_image = {"image": image} if image is not None else {}
        if task.agent_user not in (None, "root", 0, "0"):  # the agent's folders are its user's from the start
            on_image["user"] = task.agent_user
        sandbox = backend.create(tree_dir, workdir=workdir, env=task.env, limits=limits, **on_image)
    try:
        for step in setup:
            step.apply(sandbox, task.limits.setup_timeout_s)
        if task.workdir != workdir:
            sandbox.exec(f"mkdir -p {shlex.quote(task.workdir)}", cwd="/", timeout=60)
        sandbox.end_episode()  # as after a Dockerfile's RUN: what setup left running is not part of the image
        snapshot = sandbox.snapshot()
        snapshot.workdir = task.workdir
        snapshot.env = dict(task.env)
        snapshot.limits = limits
        snapshot.entrypoint = tuple(task.entrypoint)  # not run by setup, as a Dockerfile's RUN steps do not
        if hasattr(snapshot, "network"):  # the agent's network and user, as the task declares them
            snapshot.network, snapshot.user = task.agent_network, on_image.get("user")
        return snapshot
    finally:
        sandbox.close()


def verify(task: Task, sandbox: Sandbox) -> VerifyResult:
    return task.verifier.verify(sandbox, task)
