"""Read a task's environment/Dockerfile into setup steps a local sandbox can honour.

The host's system stands in for the FROM image (`--platform` is read past). WORKDIR, ENV, ARG, COPY/ADD of the
build context's own files and RUN (BuildKit heredocs included: a body that feeds the command, or the script itself)
become setup steps run once when the task is prepared. Instructions that only describe a container
(LABEL, EXPOSE, CMD, ...) have no effect on a task and are noted; anything else (USER, VOLUME, multi-stage
builds, COPY --from, ADD of a URL, files placed outside /app) is named in an error that points to a container
backend.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rl.envs.task import CopyStep, RunStep, TaskError
from rl.sandbox.base import BASE_ENV

TREE_ROOT = "/app"
NO_EFFECT = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "STOPSIGNAL", "HEALTHCHECK"}
_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
CONTAINER_BACKENDS = "use a container backend (--backend docker, podman or apptainer)"



class UnsupportedDockerfile(TaskError):
    """The Dockerfile needs a container engine; the message names the instruction and line."""


@dataclass
class DockerfilePlan:
    base_image: str | None = None
    workdir: str = TREE_ROOT
    env: dict[str, str] = field(default_factory=dict)
    steps: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# A BuildKit heredoc: <<EOF, <<-EOF, <<"EOF" or <<'EOF' in a RUN, COPY or ADD line; its body follows the line.
_HEREDOC_RE = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def _logical_lines(text: str, path: Path) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuations joined and comments dropped. The bodies of a RUN,
    COPY or ADD line's heredocs follow it verbatim, each line after a newline, through its terminator."""
    lines = text.splitlines()
    out, buf, start, i = [], [], 0, 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = i
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        instruction = " ".join(s.strip() for s in buf)
        buf = []
        if instruction.split(" ", 1)[0].upper() in ("RUN", "COPY", "ADD"):
            for strip_tabs, _, word in _HEREDOC_RE.findall(instruction):
                body = []
                while i < len(lines):
                    raw = lines[i]
                    i += 1
                    raw = raw.lstrip("\t") if strip_tabs else raw  # <<-: leading tabs go, as in the shell
                    if raw == word:
                        break
                    body.append(raw)
                else:
                    raise TaskError(f"{path}:{start}: the heredoc <<{word} has no closing {word} line")
                instruction += "\n" + "\n".join(body + [word])
        out.append((start, instruction))
    if buf:
        out.append((start, " ".join(s.strip() for s in buf)))
    return out


def _heredoc_run(rest: str) -> str:
    """The shell command of `RUN <<EOF ... EOF` (BuildKit runs the body as a script; a #! line names its
    interpreter); a RUN line whose heredocs feed a command (`RUN cat > f <<EOF`) is already one for bash."""
    head, _, body = rest.partition("\n")
    if not _HEREDOC_RE.fullmatch(head.strip()):
        return rest
    script = body.rsplit("\n", 1)[0] if "\n" in body else ""
    if script.startswith("#!"):
        return f"cat > /tmp/mc-run <<'MC_RUN_EOF'\n{script}\nMC_RUN_EOF\nchmod +x /tmp/mc-run && /tmp/mc-run"
    return script


def _substitute(text: str, variables: dict[str, str]) -> str:
    def repl(m):
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        return m.group(2) if m.group(2) is not None else ""

    return _VAR_RE.sub(repl, text)


def _args(rest: str) -> list[str]:
    rest = rest.strip()
    if rest.startswith("["):
        try:
            value = json.loads(rest)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
        except json.JSONDecodeError:
            pass
    return shlex.split(rest)


def _in_tree(path: str) -> bool:
    return path == TREE_ROOT or path.startswith(TREE_ROOT + "/")


def parse_dockerfile(path: Path, context: Path) -> DockerfilePlan:
    plan = DockerfilePlan()
    variables: dict[str, str] = {}
    seen_from = False
    text = path.read_text()
    for lineno, line in _logical_lines(text, path):
        where = f"{path}:{lineno}"
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword in ("COPY", "ADD") and _HEREDOC_RE.search(rest):
            raise UnsupportedDockerfile(f"{where}: {keyword} of an inline file (a heredoc) is not supported by the "
                                        "local backend; write the file with RUN, or use a container backend")
        if keyword == "FROM":
            if seen_from:
                raise UnsupportedDockerfile(f"{where}: multi-stage builds (a second FROM) need a container backend")
            seen_from = True
            image = [w for w in rest.split() if not w.startswith("--")]  # --platform=...: the host's is used
            plan.base_image = image[0] if image else None
            plan.notes.append(f"{where}: FROM {plan.base_image}: the host's system stands in for the image")
        elif keyword == "ARG":
            name, eq, default = rest.partition("=")
            variables.setdefault(name.strip(), _substitute(default.strip().strip('"'), variables) if eq else "")
        elif keyword == "ENV":
            parts = shlex.split(rest)
            if parts and "=" not in parts[0]:  # legacy form: ENV KEY value with spaces
                key, value = rest.split(None, 1) if len(rest.split(None, 1)) == 2 else (rest, "")
                pairs = [(key, value.strip())]
            else:
                pairs = []
                for p in parts:
                    if "=" not in p:
                        raise TaskError(f"{where}: ENV entry {p!r} needs KEY=VALUE")
                    k, _, v = p.partition("=")
                    pairs.append((k, v))
            for k, v in pairs:
                # ${PATH} and friends come from the base environment (the host standing in for the image).
                v = _substitute(v, {**BASE_ENV, **variables, **plan.env})
                plan.env[k] = v
                variables[k] = v
        elif keyword == "WORKDIR":
            target = _substitute(rest, {**variables, **plan.env}).strip().strip('"')
            target = str(PurePosixPath(plan.workdir) / target) if not target.startswith("/") else target
            target = os.path.normpath(target)
            if not _in_tree(target):
                raise UnsupportedDockerfile(f"{where}: WORKDIR {target} is outside the task tree {TREE_ROOT}; the "
                                            f"local backend keeps all task files under /app: {CONTAINER_BACKENDS}")
            plan.workdir = target
        elif keyword in ("COPY", "ADD"):
            plan.steps.extend(_copy_steps(keyword, rest, where, context, plan, {**variables, **plan.env}))
        elif keyword == "RUN":
            args = _args(rest) if rest.startswith("[") else None
            command = shlex.join(args) if args is not None else _heredoc_run(rest)
            if command.startswith("--"):
                raise UnsupportedDockerfile(f"{where}: RUN flags ({command.split()[0]}) need a container backend")
            plan.steps.append(RunStep(command=command, cwd=plan.workdir, env=dict(plan.env), origin=where))
        elif keyword in NO_EFFECT:
            plan.notes.append(f"{where}: {keyword} has no effect on a local task and is ignored")
        else:
            raise UnsupportedDockerfile(f"{where}: the local backend cannot honour {keyword}; it supports FROM, "
                                        "WORKDIR, ENV, ARG, COPY/ADD of the task's own files and RUN. Use a "
                                        "container backend (docker, podman, apptainer) for this task")
    return plan


def _copy_steps(keyword: str, rest: str, where: str, context: Path, plan: DockerfilePlan,
                variables: dict[str, str]) -> list[CopyStep]:
    parts = _args(rest)
    flags = [p for p in parts if p.startswith("--")]
    parts = [_substitute(p, variables) for p in parts if not p.startswith("--")]
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in ("--chown", "--chmod", "--link"):
            plan.notes.append(f"{where}: {keyword} {name} ignored: files belong to the sandbox user")
        else:
            raise UnsupportedDockerfile(f"{where}: {keyword} {name} needs a container backend")
    if len(parts) < 2:
        raise TaskError(f"{where}: {keyword} needs at least one source and a destination")
    *sources, dest = parts
    dest_abs = dest if dest.startswith("/") else str(PurePosixPath(plan.workdir) / dest)
    dest_is_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
    dest_abs = os.path.normpath(dest_abs)
    if not _in_tree(dest_abs):
        raise UnsupportedDockerfile(f"{where}: {keyword} to {dest_abs} is outside the task tree {TREE_ROOT}; the "
                                    "local backend's system is read-only (use a container backend)")
    context_real = os.path.realpath(context)
    steps = []
    for src in sources:
        if re.match(r"^[a-z]+://", src):
            raise UnsupportedDockerfile(f"{where}: {keyword} of a URL ({src}) needs network; not supported locally")
        matches = sorted(glob.glob(str(context / src))) if any(c in src for c in "*?[") else [str(context / src)]
        if not matches or not os.path.exists(matches[0]):
            raise TaskError(f"{where}: {keyword} source {src!r} does not exist in the build context {context}")
        for m in matches:
            real = os.path.realpath(m)
            if not (real == context_real or real.startswith(context_real + "/")):
                raise TaskError(f"{where}: {keyword} source {src!r} is outside the build context {context}")
            host = Path(m)
            if keyword == "ADD" and host.is_file() and host.name.endswith(_ARCHIVE_SUFFIXES):
                steps.append(CopyStep(host, dest_abs, where, unpack=True))
            elif host.is_dir():
                steps.append(CopyStep(host, dest_abs, where))
            else:
                target = str(PurePosixPath(dest_abs) / host.name) if dest_is_dir else dest_abs
                steps.append(CopyStep(host, target, where))
    return steps
