#!/usr/bin/python3
"""`uv` and `uvx` in a task image built by megatron-composer (rl/sandbox/image.py): the real uv (the `uv` wheel from
PyPI, installed when the image was built, under /usr/local/lib/megatron-composer/uv), run as it is, with what a
verifier that runs offline (UV_OFFLINE=1) needs of its surroundings:

- a cache: where UV_OFFLINE is set and UV_CACHE_DIR does not exist yet, the cache starts as a copy of the one the
  image's build warmed for what the task's test scripts have uv or pip install (rl/envs/task_folder.py), so that uv
  resolves and installs them offline (uv cannot use a cache it may not write, and the warmed one is the image's);
- a fresh environment: `uv venv DIR` replaces whatever is at DIR (`--clear --force`). uv itself refuses a folder
  that is not a virtual environment, and a verifier script that goes on (`uv venv .t; source .t/bin/activate`) would
  source what the agent left there;
- a Python (the one fallback): a version uv finds neither in the image nor offline (`-p 3.13` where the image has
  3.11: uv would download it from python-build-standalone, which is not a package registry) is the image's python3,
  said on stderr.
"""

import os
import shutil
import subprocess
import sys
import tempfile

NAME = os.path.basename(sys.argv[0])
HOME = "/usr/local/lib/megatron-composer/uv/bin"  # the real uv and uvx
WARM_CACHE = "/usr/local/share/megatron-composer/uv-cache"  # warmed by the image's build
# uv's options that take a value, before the command of `uv run` / `uvx` / `uv tool run` (the value is the next
# word unless given with '='); only -p/--python is changed, the others are skipped past.
VALUED = {"--with", "-w", "--from", "--python", "-p", "--with-requirements", "--with-editable", "--project",
          "--directory", "--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--index", "--default-index",
          "--cache-dir", "--config-file", "--constraints", "--constraint", "-c", "--overrides", "--override",
          "--requirements", "--requirement", "-r", "--group", "--extra", "--package", "--env-file", "--prompt",
          "--build-constraints", "--python-platform", "--python-preference", "--link-mode", "--resolution",
          "--prerelease", "--color", "--exclude-newer", "--keyring-provider", "--only-group", "--no-group", "--script",
          "--refresh-package", "--reinstall-package", "--upgrade-package", "-P", "--config-setting", "-C", "--target",
          "--prefix", "--allow-insecure-host", "--index-strategy", "--fork-strategy", "--no-build-package",
          "--no-binary-package", "--only-binary", "--no-binary", "--torch-backend", "--bounds", "--author-from",
          "--build-backend", "--vcs", "--name", "--app-dir", "--optional", "--dev-group", "--marker", "--tag",
          "--branch", "--rev", "--lfs"}


def say(message: str) -> None:
    print(f"{NAME} (megatron-composer image): {message}", file=sys.stderr)


def first_plain_word(args: list[str], i: int) -> int:
    """Where the first word from `i` on that is neither an option of uv nor an option's value is (len(args): none)."""
    while i < len(args):
        word = args[i]
        if word == "--" or word == "-" or not word.startswith("-"):
            return i
        i += 1 + (word in VALUED)  # `--python 3.13`; `--python=3.13` is one word
    return len(args)


def uv_args_end(args: list[str]) -> int:
    """How many of `args` are uv's own: all of them, but for `uvx`, `uv run` and `uv tool run|install` only those
    before the tool or command (whose own options, pytest's `-p no:cacheprovider` say, are not uv's)."""
    if NAME == "uvx":
        return first_plain_word(args, 0)
    subcommand: list[str] = []
    i = 0
    while (i := first_plain_word(args, i)) < len(args) and args[i] != "--":
        subcommand.append(args[i])
        i += 1
        if subcommand in (["run"], ["tool", "run"], ["tool", "install"]):
            return first_plain_word(args, i)
    return i


def fresh_venv(args: list[str]) -> list[str]:
    """`uv venv ...` with --clear --force, unless the script asked to keep what is there (--allow-existing)."""
    if NAME != "uv" or "--allow-existing" in args[:uv_args_end(args)]:
        return args
    at = first_plain_word(args, 0)
    if at < len(args) and args[at] == "venv":
        return [*args[:at + 1], "--clear", "--force", *args[at + 1:]]
    return args


def python_found(request: str) -> bool:
    """Whether uv finds a Python for `request` without downloading one."""
    res = subprocess.run([os.path.join(HOME, "uv"), "python", "find", "--no-python-downloads", request],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return res.returncode == 0


def pythons_offline(args: list[str]) -> list[str]:
    """`args` with each -p/--python that uv cannot satisfy offline replaced by this image's python3."""
    out = list(args)
    end = uv_args_end(args)
    i = 0
    while i < end:
        word = out[i]
        key, eq, value = word.partition("=")
        if key in ("-p", "--python") and (eq or i + 1 < end):
            request = value if eq else out[i + 1]
            if request and not python_found(request):
                say(f"Python {request} is not in this image and cannot be downloaded offline; the image's "
                    f"{sys.executable} ({sys.version_info.major}.{sys.version_info.minor}) runs it")
                if eq:
                    out[i] = f"{key}={sys.executable}"
                else:
                    out[i + 1] = sys.executable
            i += 1 if eq else 2
            continue
        i += 1 + (word in VALUED)
    return out


def seed_cache() -> None:
    """UV_CACHE_DIR as a copy of the image's warmed cache, the first time an offline uv needs it (where it cannot be
    made, uv runs on without it and says what its cache lacks)."""
    cache = os.environ.get("UV_CACHE_DIR")
    if not cache or os.path.lexists(cache) or not os.path.isdir(WARM_CACHE):
        return
    partial = None
    try:
        parent = os.path.dirname(os.path.abspath(cache))
        os.makedirs(parent, mode=0o700, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=".uv-cache-", dir=parent)
        shutil.copytree(WARM_CACHE, os.path.join(partial, "cache"), symlinks=True)
        os.rename(os.path.join(partial, "cache"), cache)  # another uv that got there first keeps its own
    except OSError as e:
        say(f"cannot start the offline cache {cache} from the image's ({e.strerror or e}); uv runs without it")
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)


def main(args: list[str]) -> None:
    real = os.path.join(HOME, NAME)
    if not os.access(real, os.X_OK):
        say(f"this image has no {NAME}: its base was built without a way to PyPI (the `uv` wheel); rebuild it where "
            "the package index is reachable")
        sys.exit(127)
    if os.environ.get("UV_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        seed_cache()
        args = fresh_venv(pythons_offline(args))
    os.execv(real, [real, *args])


main(sys.argv[1:])  # a script: images run it as /usr/local/bin/uv and uvx; nothing imports it
