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
running serves the agent and the verifier). USER is the image's user, which the task's phases run as unless
task.toml names another. Instructions that only describe a container (LABEL, EXPOSE, CMD ...) are noted. ADD of a
URL downloads it in the build. Multi-stage builds: each stage is read as its own plan (`FROM <earlier stage>`
starts from that stage's steps); `COPY --from=<stage>` copies out of that stage's image, built first
(`StageCopyStep`); `COPY --from=<image>` works for images this machine can make (`ghcr.io/astral-sh/uv`, from uv's
wheel on the package index); any other image, and a non-Debian base that must be built, is named in an error that
points to a container backend.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rl.envs.task import CopyStep, RunStep, TaskError, read_utf8
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
# What an image family has at a path of its own that Debian's packages put elsewhere: python:* images have
# /usr/local/bin/python (plain Debian and Ubuntu images have no `python`, so a Dockerfile may link one itself).
FAMILY_LINKS = {"python": (("/usr/local/bin/python", "/usr/bin/python3"),)}
# Commands an image family has that the host's system may lack: a task that calls one (its verifier, its solution,
# its Dockerfile's RUN steps) is built with the family's packages rather than stood in for by the host.
FAMILY_COMMANDS = {"python": ("python",), "node": ("node", "npm", "npx"), "gcc": ("gcc", "g++", "make"),
                   "golang": ("go",), "rust": ("cargo", "rustc"), "openjdk": ("java", "javac"),
                   "eclipse-temurin": ("java", "javac"), "amazoncorretto": ("java", "javac"), "maven": ("mvn",),
                   "gradle": ("gradle",), "ruby": ("ruby", "gem"), "php": ("php",), "r-base": ("Rscript",),
                   "haskell": ("ghc", "cabal"), "julia": ("julia",)}
# Images a `COPY --from=<image>` may name that this machine makes itself: uv's (its binaries from the uv wheel).
UV_IMAGE = re.compile(r"^(?:ghcr\.io/)?astral-sh/uv(?::(?P<tag>[^@\s]+))?(?:@\S+)?$")
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
    user: str | None = None  # USER: who the image's processes run as (None: root)
    name: str | None = None  # the stage's name (FROM ... AS name)
    stages: dict[str, "DockerfilePlan"] = field(default_factory=dict)  # stages its COPY --from names, by key
    runs: list[str] = field(default_factory=list)  # its RUN steps' commands

    def set_workdir(self, workdir: str, origin: str) -> None:
        """[environment].workdir: the working directory instead of the Dockerfile's WORKDIR."""
        if not _in_tree(workdir):
            self.build_reason = self.build_reason or f"{origin} {workdir} is outside {TREE_ROOT}"
        self.workdir = workdir

    def stage_recipes(self, timeout_s: float) -> dict[str, ImageRecipe]:
        return {key: stage.recipe(Path(f"stage {key}"), timeout_s, (), f"stage {key} of the Dockerfile")
                for key, stage in self.stages.items()}

    def recipe(self, path: Path, timeout_s: float, wanted: tuple[str, ...], required: str | None) -> ImageRecipe:
        family = image_family(self.base_image or "")
        packages = FAMILY_PACKAGES.get(family, ())
        stand_in = tuple(f"ln -sfn {shlex.quote(target)} {shlex.quote(link)}"
                         for link, target in FAMILY_LINKS.get(family, ()))
        stages = self.stage_recipes(timeout_s)
        return ImageRecipe(key=self.digest(packages + tuple(wanted) + stand_in, stages), packages=packages,
                           steps=list(self.steps), timeout_s=timeout_s, what=f"{path.parent.name}/{path.name}",
                           required=required, verifier_packages=tuple(wanted), dockerfile=self.text, stages=stages,
                           stand_in=stand_in)

    def task_parts(self, path: Path, timeout_s: float, verifier: tuple[str, list[str]] | None = None,
                   scripts: dict[str, str] | None = None) -> tuple[list, ImageRecipe]:
        """(the setup steps to run on the host's system, the image to build), the steps empty when one reaches past
        /app and so the image must be built (a backend may build it anyway); the stand-in is stated in the notes.
        `verifier` is (its script's name, what it has uv or pip install): a verifier that installs tools needs the
        image too, which carries them (the verifier runs offline). `scripts` (name -> text: the verifier's, the
        solution's) are read for commands the FROM image has and the host's system lacks."""
        where = f"{path}: FROM {self.base_image}"
        family = image_family(self.base_image or "")
        packages = FAMILY_PACKAGES.get(family, ())
        script, wanted = verifier or ("", [])
        if wanted and self.build_reason is None:
            self.build_reason = (f"{script} has uv or pip install {', '.join(wanted)}, which the image carries so that "
                                 "the verifier runs offline")
        if self.build_reason is None:
            lacking = host_lacks(family, {"the Dockerfile's RUN steps": "\n".join(self.runs),
                                          **(scripts or {})})
            if lacking:
                self.build_reason = lacking
        recipe = self.recipe(path, timeout_s, tuple(wanted), self.build_reason)
        if self.build_reason is None:
            self.notes.append(f"{where}: the host's system stands in for the image (every step stays in {TREE_ROOT})")
            return self.steps, recipe
        for plan in [self, *self.stages.values()]:
            stage_family = image_family(plan.base_image or "")
            if stage_family in NON_DEBIAN:
                raise UnsupportedDockerfile(f"{path}: FROM {plan.base_image}: a non-Debian base ({stage_family}) must "
                                            f"be built ({self.build_reason}); the local backend builds on Debian: "
                                            f"{CONTAINER_BACKENDS}")
        known = "" if family in FAMILY_PACKAGES else "; an image this backend does not know: only Debian's base"
        self.notes.append(f"{where}: built into an image on a Debian root filesystem from packages"
                          + (f" with {', '.join(packages)}" if packages else "") + f"{known} (because "
                          f"{self.build_reason})")
        return [], recipe

    def digest(self, packages: tuple[str, ...], stages: dict[str, ImageRecipe] | None = None) -> str:
        """Everything the build reads: the Dockerfile, the packages it adds, every file its COPY/ADD take and the
        stages it copies from."""
        h = hashlib.sha256(json.dumps([self.text, self.name, list(packages),
                                       sorted((k, r.key) for k, r in (stages or {}).items())]).encode())
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


def host_lacks(family: str, scripts: dict[str, str]) -> str | None:
    """Why the host's system cannot stand in for an image of `family`: a command the family's images have, which
    one of `scripts` (name -> text) calls and the host lacks; None when it can."""
    for command in FAMILY_COMMANDS.get(family, ()):
        if shutil.which(command, path=BASE_ENV["PATH"]) is not None:
            continue
        call = re.compile(rf"(?:^|[\s;&|(`]){re.escape(command)}(?=[\s;&|)`]|$)", re.MULTILINE)
        for name, text in scripts.items():
            if call.search(text):
                return (f"{name} calls `{command}`, which FROM {family} images have and this host's system lacks")
    return None


_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(platform.machine(), platform.machine())
# The platform arguments BuildKit gives every build (their value once a stage declares them): this host's.
PLATFORM_ARGS = {**{f"{w}PLATFORM": f"linux/{_ARCH}" for w in ("TARGET", "BUILD")},
                 **{f"{w}OS": "linux" for w in ("TARGET", "BUILD")}, **{f"{w}ARCH": _ARCH for w in ("TARGET", "BUILD")},
                 "TARGETVARIANT": "", "BUILDVARIANT": ""}


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
        if buf and (not line.strip() or line.lstrip().startswith("#")):
            continue  # docker drops empty and comment lines inside a continuation (an empty one with a warning)
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
    """The Dockerfile's last stage as a plan (the stages it copies from in `plan.stages`)."""
    text = read_utf8(path)
    plan = DockerfilePlan(text=text)
    stages: list[DockerfilePlan] = []  # the stages before this one, in order
    global_args: dict[str, str] = {}  # ARG before the first FROM: usable in FROM lines
    variables: dict[str, str] = {}
    seen_from = False

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
            words = [w for w in _substitute(rest, global_args).split() if not w.startswith("--")]  # --platform
            if not words:
                raise TaskError(f"{where}: FROM names no image")
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            if seen_from:
                stages.append(plan)
                earlier = _stage(stages, words[0])
                plan = (DockerfilePlan(base_image=earlier.base_image, workdir=earlier.workdir, env=dict(earlier.env),
                                       steps=list(earlier.steps), build_reason=earlier.build_reason, text=text,
                                       entrypoint=earlier.entrypoint, user=earlier.user, stages=dict(earlier.stages),
                                       runs=list(earlier.runs))
                        if earlier is not None else DockerfilePlan(base_image=words[0], text=text))
                variables = dict(global_args)
            else:
                plan.base_image = words[0]
                variables = dict(global_args)
            plan.name, seen_from = name, True
        elif keyword == "ARG":
            name, eq, default = rest.partition("=")
            scope = variables if seen_from else global_args
            scope.setdefault(name.strip(), _substitute(default.strip().strip('"'), scope) if eq
                             else PLATFORM_ARGS.get(name.strip(), ""))
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
            steps = _copy_steps(keyword, rest, where, context, plan, {**variables, **plan.env}, stages)
            for step in steps:
                if isinstance(step, StageCopyStep):
                    reaches_out(f"{where}: {keyword} --from={step.stage} copies out of another image")
                elif isinstance(step, RunStep):
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
            plan.runs.append(command)
            # a RUN step's environment holds the stage's ARGs too, as in a build
            plan.steps.append(RunStep(command=command, cwd=plan.workdir, env={**variables, **plan.env}, origin=where))
        elif keyword == "ENTRYPOINT":
            args = _args(rest) if rest.startswith("[") else None
            plan.entrypoint = tuple(args) if args is not None else ("/bin/sh", "-c", rest)
        elif keyword == "CMD":
            plan.notes.append(f"{where}: CMD is replaced, as Harbor and Terminal-Bench replace it: the sandbox's "
                              "episode runs the agent's commands")
        elif keyword == "USER":
            plan.user = _substitute(rest, {**variables, **plan.env}).strip() or None
        elif keyword in NO_EFFECT:
            plan.notes.append(f"{where}: {keyword} has no effect on a local task and is ignored")
        else:
            raise UnsupportedDockerfile(f"{where}: the local backend cannot honour {keyword}; it supports FROM, "
                                        "WORKDIR, ENV, ARG, USER, COPY/ADD of the task's own files and RUN. Use a "
                                        "container backend (docker, podman, apptainer) for this task")
    if plan.user is not None:
        plan.notes.append(f"{path}: USER {plan.user} is the image's user: the task's phases run as it unless "
                          "task.toml names another ([agent].user, [verifier].user)")
    return plan


def _stage(stages: list[DockerfilePlan], ref: str) -> DockerfilePlan | None:
    """The earlier stage `ref` names (its AS name, or its index), or None."""
    for n, stage in enumerate(stages):
        if ref == str(n) or (stage.name is not None and ref.lower() == stage.name.lower()):
            return stage
    return None


@dataclass
class StageCopyStep:
    """`COPY --from=<stage or image> SRC... DEST`: files out of another image this machine builds first (an earlier
    stage of the Dockerfile, or an image it can make), copied in as COPY copies them. Runs in an image's build
    (its BuildRoot holds the roots of the stages it copies from in `stage_roots`)."""

    stage: str  # the key of the stage in the recipe's stages
    sources: list[str]
    dest: str  # absolute
    dest_is_dir: bool
    origin: str

    def apply(self, root, timeout: float) -> None:
        stage_root = getattr(root, "stage_roots", {}).get(self.stage)
        if stage_root is None:
            raise TaskError(f"{self.origin}: COPY --from={self.stage} runs only in an image's build")
        for src in self.sources:
            found = _in_stage(Path(stage_root), src)
            if not found:
                raise TaskError(f"{self.origin}: COPY --from={self.stage}: {src} does not exist in that image")
            for host in found:
                target = (str(PurePosixPath(self.dest) / host.name) if self.dest_is_dir and not host.is_dir()
                          else self.dest)
                root.copy_in(host, target, merge=True)


def _in_stage(stage_root: Path, src: str) -> list[Path]:
    """The paths `src` names inside a stage's root filesystem (a glob may name several), every link on the way
    followed inside that root, never out of it."""
    root = os.path.realpath(stage_root)
    if any(c in src for c in "*?["):
        matches = sorted(glob.glob(os.path.join(root, src.lstrip("/"))))
        return [Path(m) for m in matches if not os.path.islink(m) and os.path.realpath(m).startswith(root + "/")]
    parts, current, hops = list(PurePosixPath("/" + src).parts[1:]), root, 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current) if current != root else root
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                return []
            target = os.readlink(candidate)
            current = root if target.startswith("/") else current
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
            continue
        current = candidate
    return [Path(current)] if os.path.lexists(current) else []


def uv_stage(ref: str, origin: str) -> DockerfilePlan | None:
    """The plan of an image `COPY --from=<ref>` names that this machine can make: uv's image (/uv, /uvx and
    /usr/local/bin/uv{,x}, from the uv wheel of the tag's version); None for any other image."""
    m = UV_IMAGE.match(ref)
    if m is None:
        return None
    tag = (m.group("tag") or "latest").split("-", 1)[0]
    version = ("" if tag in ("latest", "") or not re.fullmatch(r"\d+(?:\.\d+){0,2}", tag)
               else f"=={tag}" if tag.count(".") == 2 else f"=={tag}.*")
    command = (f"python3 -m pip install --no-cache-dir -q --only-binary=:all: {shlex.quote('uv' + version)} && "
               "for b in uv uvx; do cp \"$(command -v $b)\" /$b; done")
    return DockerfilePlan(base_image="debian", text=f"# uv's image {ref} made from the uv wheel\n{command}\n",
                          steps=[RunStep(command=command, cwd="/", env={}, origin=f"{origin}: uv's image {ref}")],
                          build_reason=f"{origin}: COPY --from={ref}", name=ref)


def _copy_steps(keyword: str, rest: str, where: str, context: Path, plan: DockerfilePlan,
                variables: dict[str, str], stages: list[DockerfilePlan]) -> list:
    parts = _args(rest)
    flags = [p for p in parts if p.startswith("--")]
    parts = [_substitute(p, variables) for p in parts if not p.startswith("--")]
    source_image = None
    for flag in flags:
        name, _, value = flag.partition("=")
        if name in ("--chown", "--chmod", "--link"):
            plan.notes.append(f"{where}: {keyword} {name} ignored: files belong to the sandbox user")
        elif name == "--from" and keyword == "COPY" and value:
            source_image = _substitute(value, variables)
        else:
            raise UnsupportedDockerfile(f"{where}: {keyword} {name} needs a container backend")
    if len(parts) < 2:
        raise TaskError(f"{where}: {keyword} needs at least one source and a destination")
    *sources, dest = parts
    dest_abs = dest if dest.startswith("/") else str(PurePosixPath(plan.workdir) / dest)
    dest_is_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
    dest_abs = os.path.normpath(dest_abs)
    if source_image is not None:
        stage = _stage(stages, source_image) or uv_stage(source_image, where)
        if stage is None:
            raise UnsupportedDockerfile(
                f"{where}: COPY --from={source_image} needs that image, which this machine cannot make (it makes the "
                f"Dockerfile's earlier stages and ghcr.io/astral-sh/uv): {CONTAINER_BACKENDS} with a registry")
        key = stage.name or source_image
        plan.stages[key] = stage
        return [StageCopyStep(key, sources, dest_abs, dest_is_dir, where)]
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
