#!/usr/bin/python3
"""uv and uvx inside a task image built by megatron-composer (rl/sandbox/image.py), where verifiers run offline.

Task verifiers usually fetch uv and let it install pytest (`uvx --with pytest==8.4.1 pytest ...`, or `uv init;
uv add pytest==8.4.1; uv run pytest ...`, or `uv venv; uv pip install ...`). The image's build installed every
requirement those scripts name into the image's Python, with the network; this stand-in runs the same commands
offline against it:
- `uvx TOOL ARGS` / `uv tool run TOOL ARGS` / `uv run CMD ARGS` run the tool or command with the image's Python;
- `uv add`, `uv pip install`, `uv sync`, `uv lock`, `uv init`, `uv python install` only check that what they name is
  installed, and `uv venv DIR` makes a virtual environment that sees the image's packages.
A requirement that is not installed (or at another version) stops the command with one line that says so. A
requested Python version (`-p 3.13`) is the image's own (said on stderr when it differs).
"""

import os
import shutil
import subprocess
import sys
import sysconfig

NAME = os.path.basename(sys.argv[0])
# Options that take a value, of uv and of its subcommands (the value is the next word, or after '=').
VALUED = {"--with", "-w", "--from", "--python", "-p", "--with-requirements", "--with-editable", "--project",
          "--directory", "--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--index", "--default-index",
          "--cache-dir", "--config-file", "--constraint", "-c", "--override", "--requirement", "-r", "--group",
          "--extra", "--package", "--env-file", "--prompt", "--name", "--build-constraint", "--python-platform",
          "--python-preference", "--link-mode", "--resolution", "--prerelease", "--color", "--exclude-newer",
          "--keyring-provider", "--only-group", "--no-group", "--script", "--compile-bytecode", "--dev-group",
          "--optional", "--bounds", "--author-from", "--build-backend", "--vcs", "--app-dir", "--target"}


def say(message: str) -> None:
    print(f"{NAME} (offline stand-in in this task image): {message}", file=sys.stderr)


def split_options(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """({option: [values]}, the positional words) up to the first positional word of a `run`-like command."""
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return options, args[i + 1:]
        if not word.startswith("-") or word == "-":
            return options, args[i:]
        key, eq, value = word.partition("=")
        if key in VALUED:
            if not eq:
                i += 1
                value = args[i] if i < len(args) else ""
            options.setdefault(key, []).append(value)
        else:
            options.setdefault(key, []).append("")
        i += 1
    return options, []


def missing(requirement: str) -> str | None:
    """Why `requirement` (a PEP 508 string) is not satisfied by the image's Python, or None."""
    from importlib import metadata

    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return None if os.path.exists(requirement) else f"{requirement!r} is not a requirement this stand-in reads"
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return f"{req.name} is not installed"
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return f"{req.name} {have} is installed, not {req.specifier}"
    return None


def require(requirements: list[str]) -> None:
    problems = [p for r in requirements if r and (p := missing(r))]
    if problems:
        say("; ".join(problems) + ". The image installs what the task's test scripts ask uv for when it is built: "
            "rebuild it (a changed test script changes its digest), or name the package in the Dockerfile")
        sys.exit(2)


def python_note(options: dict[str, list[str]]) -> None:
    asked = (options.get("-p") or options.get("--python") or [""])[-1]
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if asked and not asked.startswith(mine) and asked not in ("python3", "python", sys.executable):
        say(f"Python {asked} was asked for; the image's Python {mine} runs it")


def run(command: list[str], options: dict[str, list[str]]) -> None:
    """Run a command as `uv run` would: a Python module where the command is an installed one's entry point."""
    require(options.get("--with", []) + options.get("-w", []))
    python_note(options)
    if not command:
        say("nothing to run")
        sys.exit(2)
    for folder in options.get("--directory", []):
        os.chdir(folder)
    if command[0].startswith("python") and shutil.which(command[0]) is None:  # python3.13: the image's Python
        command = ["python3", *command[1:]]
    os.execvp(command[0], command)  # from PATH: an activated virtual environment's first, as uv does


def tool(args: list[str]) -> None:
    options, rest = split_options(args)
    if not rest:
        say("no tool named")
        sys.exit(2)
    source = (options.get("--from") or [rest[0]])[-1]
    require([source] + options.get("--with", []) + options.get("-w", []))
    python_note(options)
    name = rest[0].split("@")[0].split("==")[0]
    scripts = sysconfig.get_path("scripts")
    for folder in ("/usr/local/bin", scripts, "/usr/bin"):
        if os.access(os.path.join(folder, name), os.X_OK) and os.path.join(folder, name) != os.path.realpath(
                sys.argv[0]):
            os.execv(os.path.join(folder, name), [name, *rest[1:]])
    os.execv(sys.executable, [sys.executable, "-m", name.replace("-", "_"), *rest[1:]])


def main(argv: list[str]) -> None:
    if NAME == "uvx":
        tool(argv)
    global_options, rest = split_options(argv)
    if not rest:
        if "--version" in global_options or "-V" in global_options:
            print("uv 0.0.0 (offline stand-in)")
            return
        say("usage: uv run|tool run|add|pip install|venv|init|sync|lock|python install ...")
        sys.exit(2)
    command, args = rest[0], rest[1:]
    if command == "run":
        options, cmd = split_options(args)
        run(cmd, options)
    elif command == "tool" and args[:1] == ["run"]:
        tool(args[1:])
    elif command == "tool" and args[:1] == ["install"]:
        options, names = split_options(args[1:])
        require(names[:1] + options.get("--with", []) + options.get("-w", []))
    elif command in ("add", "sync", "lock", "init", "remove", "tree", "export"):
        options, names = split_options(args)
        if command == "add":
            require(names + sum((open(f).read().split() for f in options.get("-r", []) + options.get(
                "--requirements", []) if os.path.exists(f)), []))
    elif command == "pip":
        sub, *pip_args = args or [""]
        options, names = split_options(pip_args)
        if sub in ("install", "sync"):
            files = options.get("-r", []) + options.get("--requirement", [])
            listed = [line.split("#")[0].strip() for f in files if os.path.exists(f) for line in open(f)]
            require(names + [line for line in listed if line and not line.startswith("-")])
        elif sub in ("list", "freeze", "show"):
            os.execv(sys.executable, [sys.executable, "-m", "pip", sub, *pip_args])
    elif command == "venv":
        options, names = split_options(args)
        python_note(options)
        folder = names[0] if names else ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", folder], check=True)
    elif command == "python":
        options, names = split_options(args[1:])
        python_note({"-p": names[:1]})
    elif command in ("cache", "self", "generate-shell-completion", "help"):
        return  # uv's own housekeeping: nothing to do for an offline stand-in
    else:
        say(f"`uv {command}` is not supported offline")
        sys.exit(2)


main(sys.argv[1:])  # a script: images run it as /usr/local/bin/uv and uvx; nothing imports it
