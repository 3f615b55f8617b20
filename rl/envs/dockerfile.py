"""Read a task's environment/Dockerfile into what the local backend runs: setup steps on the host's system, or an
image it builds.

WORKDIR, ENV, ARG, COPY/ADD of the build context's own files and RUN (BuildKit heredocs included: a body that feeds
the command, or the script itself) become steps; `--platform` is read past. Two stand-ins for the FROM image:
- **The host's system**, when every step stays in the task tree /app: the steps run once when the task is prepared,
  on the read-only host system (no build, no network).
- **A built image**, when a step reaches further (it installs packages, downloads, or writes outside /app): a Debian
  root filesystem made from packages, plus what the FROM image's family implies (build-essential for gcc, nodejs for
  node ...), then the steps, with the network (rl/sandbox/image.py). Cached under a digest of everything it reads.
Both are stated in the task's notes. ENTRYPOINT starts every episode, as it starts a container (a service it leaves
running serves the agent and the verifier). Instructions that only describe a container (LABEL, EXPOSE, CMD, USER
...) are noted; anything else (multi-stage builds, COPY --from, a non-Debian base that must be built) is named in an
error that points to a container backend. ADD of a URL downloads it in the build.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rl.envs.task import CopyStep, RunStep, TaskError
from rl.sandbox.base import BASE_ENV
from rl.sandbox.image import ImageRecipe

TREE_ROOT = "/app"
NO_EFFECT = {"LABEL", "MAINTAINER", "EXPOSE", "STOPSIGNAL", "VOLUME", "HEALTHCHECK", "SHELL", "ONBUILD"}
# A RUN that reaches past the task tree: it installs, downloads, changes users or names a path outside /app and /tmp.
_REACHES_OUT = re.compile(
    r"(?:^|[\s;&|(`]|\bsudo\s)(?:apt-get|apt|aptitude|dpkg|apk|yum|dnf|microdnf|zypper|pacman|pip3?|pipx|uv|uvx|"
    r"conda|mamba|micromamba|npm|npx|yarn|pnpm|gem|cargo|rustup|go|curl|wget|git|useradd|adduser|groupadd|usermod|"
    r"update-alternatives|locale-gen|systemctl|service)(?=\s|$)"
    r"|(?<![\w.$}/-])/(?!app(?:/|\b)|tmp(?:/|\b)|dev/null\b)[A-Za-z_]")
# The Debian packages that stand in for what an image family adds to Debian (by the image's name).
FAMILY_PACKAGES = {
    "python": (), "debian": (), "ubuntu": (), "bash": (),
    "buildpack-deps": ("build-essential", "git", "wget"), "gcc": ("build-essential",),
    "node": ("nodejs", "npm"), "golang": ("golang-go",), "rust": ("rustc", "cargo"),
    "openjdk": ("default-jdk-headless",), "eclipse-temurin": ("default-jdk-headless",),
    "amazoncorretto": ("default-jdk-headless",), "maven": ("maven", "default-jdk-headless"),
    "gradle": ("gradle", "default-jdk-headless"), "ruby": ("ruby-full",), "php": ("php-cli",), "perl": ("perl",),
    "r-base": ("r-base",), "postgres": ("postgresql",), "redis": ("redis-server",), "nginx": ("nginx",),
    "mariadb": ("mariadb-server",), "mysql": ("mariadb-server",), "haskell": ("ghc", "cabal-install"),
    "swift": (), "julia": ("julia",),
}
# Bases whose packages are not Debian's: their Dockerfile steps cannot be stood in for by a Debian build.
NON_DEBIAN = ("alpine", "fedora", "centos", "rockylinux", "almalinux", "amazonlinux", "archlinux", "opensuse",
              "busybox", "ubi", "oraclelinux", "photon", "clearlinux", "nixos", "windows", "scratch")
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
    build_reason: str | None = None  # the first step that reaches past /app: the task needs a built image
    text: str = ""  # the Dockerfile as written (part of the image's digest)
    entrypoint: tuple[str, ...] = ()  # ENTRYPOINT: what each episode starts with, as a container does

    def task_parts(self, path: Path, timeout_s: float, verifier: tuple[str, list[str]] | None = None
                   ) -> tuple[list, ImageRecipe]:
        """(the setup steps to run on the host's system, the image to build), the steps empty when one reaches past
        /app and so the image must be built (a backend may build it anyway); the stand-in is stated in the notes.
        `verifier` is (its script's name, what it has uv or pip install): a verifier that installs tools needs the
        image too, which carries them (the verifier runs offline)."""
        where = f"{path}: FROM {self.base_image}"
        family = image_family(self.base_image or "")
        packages = FAMILY_PACKAGES.get(family, ())
        script, wanted = verifier or ("", [])
        if wanted and self.build_reason is None:
            self.build_reason = (f"{script} has uv or pip install {', '.join(wanted)}, which the image carries so that "
                                 "the verifier runs offline")
        recipe = ImageRecipe(key=self.digest(packages + tuple(wanted)), packages=packages, steps=list(self.steps),
                             timeout_s=timeout_s, what=f"{path.parent.name}/{path.name}", required=self.build_reason,
                             verifier_packages=tuple(wanted), dockerfile=self.text)
        if self.build_reason is None:
            self.notes.append(f"{where}: the host's system stands in for the image (every step stays in {TREE_ROOT})")
            return self.steps, recipe
        if family in NON_DEBIAN:
            raise UnsupportedDockerfile(f"{where}: a non-Debian base ({family}) must be built ({self.build_reason}); "
                                        f"the local backend builds on Debian: {CONTAINER_BACKENDS}")
        known = "" if family in FAMILY_PACKAGES else "; an image this backend does not know: only Debian's base"
        self.notes.append(f"{where}: built into an image on a Debian root filesystem from packages"
                          + (f" with {', '.join(packages)}" if packages else "") + f"{known} (because "
                          f"{self.build_reason})")
        return [], recipe

    def digest(self, packages: tuple[str, ...]) -> str:
        """Everything the build reads: the Dockerfile, the packages it adds and every file its COPY/ADD take."""
        h = hashlib.sha256(json.dumps([self.text, list(packages)]).encode())
        for step in self.steps:
            if isinstance(step, CopyStep):
                h.update(f"\0copy {step.dest} {step.unpack}\0".encode())
                files = [step.src] if step.src.is_file() else sorted(p for p in step.src.rglob("*"))
                for f in files:
                    rel = f.relative_to(step.src) if f != step.src else Path(f.name)
                    h.update(f"{rel} {os.lstat(f).st_mode:o}\0".encode())
                    if f.is_symlink():
                        h.update(os.readlink(f).encode())
                    elif f.is_file():
                        h.update(hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()


def image_family(image: str) -> str:
    """An image reference's family: `python` for python:3.11-slim or ghcr.io/org/python-3-13:tag, `alpine` for
    any *-alpine tag."""
    name, _, tag = image.rsplit("/", 1)[-1].partition(":")
    name = name.split("@")[0].lower()
    if "alpine" in tag.lower():
        return "alpine"
    for family in sorted(FAMILY_PACKAGES.keys() | set(NON_DEBIAN), key=len, reverse=True):
        if name == family or name.startswith(family + "-") or re.match(rf"{re.escape(family)}[0-9.]", name):
            return family
    return name


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
    plan.text = text

    def reaches_out(why: str) -> None:
        plan.build_reason = plan.build_reason or why
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
                reaches_out(f"{where}: WORKDIR {target} is outside {TREE_ROOT}")
            plan.workdir = target
        elif keyword in ("COPY", "ADD"):
            steps = _copy_steps(keyword, rest, where, context, plan, {**variables, **plan.env})
            for step in steps:
                if isinstance(step, RunStep):
                    reaches_out(f"{where}: ADD downloads {step.origin.rsplit(' ', 1)[-1]}")
                elif not _in_tree(step.dest):
                    reaches_out(f"{where}: {keyword} to {step.dest} is outside {TREE_ROOT}")
            plan.steps.extend(steps)
        elif keyword == "RUN":
            args = _args(rest) if rest.startswith("[") else None
            command = shlex.join(args) if args is not None else _heredoc_run(rest)
            while command.startswith("--"):  # BuildKit's RUN flags: a cache mount or a network only speed a build
                flag, _, command = command.partition(" ")
                if not re.fullmatch(r"--mount=(?:type=cache\b.*)|--network=\S+", flag):
                    raise UnsupportedDockerfile(f"{where}: RUN {flag.split(',')[0]} needs a container backend")
                plan.notes.append(f"{where}: RUN {flag.split(',')[0]} is ignored (the build runs without it)")
                command = command.lstrip()
            if _REACHES_OUT.search(command):
                reaches_out(f"{where}: RUN reaches past {TREE_ROOT} (it installs, downloads or names a system path)")
            plan.steps.append(RunStep(command=command, cwd=plan.workdir, env=dict(plan.env), origin=where))
        elif keyword == "ENTRYPOINT":
            args = _args(rest) if rest.startswith("[") else None
            plan.entrypoint = tuple(args) if args is not None else ("/bin/sh", "-c", rest)
        elif keyword == "CMD":
            plan.notes.append(f"{where}: CMD is replaced, as Harbor and Terminal-Bench replace it: the sandbox's "
                              "episode runs the agent's commands")
        elif keyword == "USER":
            plan.notes.append(f"{where}: USER is not honoured: the agent runs as the sandbox's own user")
        elif keyword in NO_EFFECT:
            plan.notes.append(f"{where}: {keyword} has no effect on a local task and is ignored")
        else:
            raise UnsupportedDockerfile(f"{where}: the local backend cannot honour {keyword}; it supports FROM, "
                                        "WORKDIR, ENV, ARG, USER, COPY/ADD of the task's own files and RUN. Use a "
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
    context_real = os.path.realpath(context)
    steps = []
    for src in sources:
        if re.match(r"^[a-z]+://", src):
            if keyword == "COPY" or not src.startswith(("http://", "https://")):
                raise UnsupportedDockerfile(f"{where}: {keyword} of {src} needs a container backend")
            # ADD of a URL: downloaded in the build (its network), to dest or into it by the URL's file name
            name = PurePosixPath(src.split("?", 1)[0]).name or "index.html"
            target = str(PurePosixPath(dest_abs) / name) if dest_is_dir else dest_abs
            fetch = ("import sys, os, urllib.request; os.makedirs(os.path.dirname(sys.argv[2]) or '.', exist_ok=True); "
                     "urllib.request.urlretrieve(sys.argv[1], sys.argv[2])")
            steps.append(RunStep(command=shlex.join(["python3", "-c", fetch, src, target]), cwd="/", env={},
                                 origin=f"{where}: ADD {src}"))
            continue
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
