"""Images for the local backend: a task's Dockerfile built without a daemon into a root filesystem on the host.

A Debian root filesystem made from packages (mmdebstrap; the host's Debian release where the host runs Debian)
stands in for the FROM image: one base per host, built once, with what the sandbox itself runs inside (bubblewrap,
util-linux) and Python with pip, pytest and venv (what most tasks and verifiers expect). Each image starts as a
copy of it: the packages the FROM image's family implies, then the Dockerfile's steps. It is cached under its
digest (`ImageBuilder.build`), so a task is built once per host and a second prepare costs a lookup. Sandboxes
run on it (rl/sandbox/local.py): its system folders read-only, copies of its other folders writable.

The build is the only phase with the network: RUN steps may install from the Debian mirror and the package index.
Its commands run as root of a user namespace of their own, whose uids 0-65535 are BUILD_UID_BASE.. on the host
(so apt and dpkg can hand files to system users, and nothing in the image is the host's root), with pid, ipc, uts
and mount namespaces of their own. Of the host they see only what networking needs: resolv.conf and hosts, the
host's CA bundle (for hosts whose proxy signs TLS with its own authority) and pip's configuration with the local
indexes it names. Building needs a root host (to map that uid range) with mmdebstrap; `build_problem` says what is
missing in one line.
"""

from __future__ import annotations

import base64
import configparser
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rl.sandbox.base import BASE_ENV, HOME, ID_BASE, ID_RANGE, ExecResult, SandboxError, dir_usage, run_process
from rl.sandbox.bwrap import bwrap_path, read_bwrap_info
from rl.sandbox.layers import in_use, materialize, mount_overlay, unmount, use_overlay
from rl.sandbox.leftovers import force_rmtree, sweep
from rl.sandbox.owners import make_dir
from rl.sandbox.safe_tree import copy_into, open_beneath, open_dir

BUILD_UID_BASE = ID_BASE  # root of the build's user namespace is root of every sandbox's: the image's files are root's
BUILD_UIDS = ID_RANGE
# What the sandbox runs inside every image (nested bubblewrap for `judge`; nsenter, setpriv, prlimit) and what
# most tasks and their verifiers expect (python3 with pip, venv, pytest). No `python`: plain Debian and Ubuntu images
# have none (a Dockerfile may link it itself); the loader gives python:* images theirs.
BASE_PACKAGES = ("bubblewrap", "util-linux", "procps", "ca-certificates", "curl", "python3", "python3-pip",
                 "python3-venv", "python3-pytest")
DEFAULT_SUITE = "bookworm"
# The capabilities a container engine gives a build's root by default (they count inside its user namespace only).
BUILD_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
              "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_SETFCAP", "CAP_AUDIT_WRITE")
# As Debian's official images do: apt drops the packages it downloaded once they are installed, so that an image
# (and each sandbox's copy of its /var) does not keep them.
_APT_DROP = "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"
APT_CLEAN = (f'DPkg::Post-Invoke {{ "{_APT_DROP}"; }};\nAPT::Update::Post-Invoke {{ "{_APT_DROP}"; }};\n'
             'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')
BUILD_ENV = {**BASE_ENV, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
PIP_CONFIGS = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf")
IMAGE_LAYOUT = 3  # how an image is kept (3: a layer over the base; what it holds besides its recipe: /etc/hosts)
HOST_NET_FILES = ("/etc/resolv.conf", "/etc/hosts")
MAX_BUILD_OUTPUT = 4 * 1024 * 1024
BUILD_HOST_DIR = "/run/mc-build"  # where the build sees the host's CA bundle (a tmpfs, gone from the image)
# The real uv in every image: the `uv` wheel's binaries, installed in the base from the package index, behind
# `uv` and `uvx` (image_tools/uv.py, put into every image after its steps), with a cache the image's build warms for
# what the task's verifier asks for (`warm_uv_cache`), which the verifier's uv then uses offline.
UV_VERSION = "0.13.9"
UV_TOOL = Path(__file__).with_name("image_tools") / "uv.py"
UV_HOME = "/usr/local/lib/megatron-composer/uv"  # bin/uv, bin/uvx: image_tools/uv.py's HOME
UV_WARM_CACHE = "/usr/local/share/megatron-composer/uv-cache"  # image_tools/uv.py's WARM_CACHE


def uv_install_command() -> str:
    """Shell, run as root in a build with the network: the `uv` wheel's uv and uvx into UV_HOME/bin."""
    return (f"python3 -m pip install --no-cache-dir -q --no-deps --target /tmp/mc-uv uv=={UV_VERSION} && "
            f"mkdir -p {UV_HOME}/bin && mv /tmp/mc-uv/bin/uv /tmp/mc-uv/bin/uvx {UV_HOME}/bin/ && rm -rf /tmp/mc-uv "
            f"&& {UV_HOME}/bin/uv --version")


def uv_warm_command(requirements: tuple[str, ...] | list[str]) -> str:
    """Shell, run as root in a build with the network: uv's cache at UV_WARM_CACHE holds what `requirements` need
    the way verifiers ask uv for them -- installed into a virtual environment (`uv venv; uv pip install`, and
    `uvx --with`, which resolves the same way) and added to a project (`uv init; uv add; uv run`, whose universal
    resolution reads every platform's dependencies) -- all together, else one by one (two scripts may pin
    differently). A requirement uv cannot install fails the step; the project form is best effort."""
    reqs = " ".join(shlex.quote(r) for r in requirements)
    return "\n".join([
        "set -e",
        f"export UV_CACHE_DIR={UV_WARM_CACHE} UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1",
        f"uv={UV_HOME}/bin/uv",
        '[ -x "$uv" ] || { echo "this base has no uv: nothing to cache"; exit 0; }',
        "w=$(mktemp -d)",
        'in_venv() { rm -rf "$w/venv" && "$uv" venv -q --python /usr/bin/python3 "$w/venv" && '
        '"$uv" pip install -q --python "$w/venv/bin/python" "$@"; }',
        'in_project() { rm -rf "$w/p" && "$uv" init -q --bare --no-workspace --python /usr/bin/python3 "$w/p" && '
        '(cd "$w/p" && "$uv" add -q "$@"); }',
        f"in_venv {reqs} || for r in {reqs}; do in_venv \"$r\"; done",
        f"in_project {reqs} || for r in {reqs}; do in_project \"$r\" || echo \"uv add $r: left to the verifier\"; "
        "done",
        f'rm -rf "$w"; chmod -R a+rX {UV_WARM_CACHE}'])


TOOLS_DIGEST = hashlib.sha256(UV_TOOL.read_bytes() + uv_warm_command(["x"]).encode()).hexdigest()[:16]


def uv_index_env() -> dict[str, str]:
    """pip's package indexes on this host as uv's settings (uv reads no pip.conf), so that the build warms uv's
    cache from where pip installs: http(s) indexes, and find-links that are URLs or folders the build sees."""
    from rl.sandbox.egress import pip_index_settings

    index, extra, find_links = pip_index_settings()
    web = [u for u in index + extra if u.startswith(("http://", "https://"))]
    env = {"UV_DEFAULT_INDEX": web[0]} if index and web and web[0] == index[0] else {}
    if extras := [u for u in extra if u.startswith(("http://", "https://"))]:
        env["UV_INDEX"] = " ".join(extras)
    if links := [u for u in find_links if u.startswith(("http://", "https://")) or os.path.isdir(u)]:
        env["UV_FIND_LINKS"] = ",".join(links)
    return env


def default_cache_dir() -> Path:
    """MC_IMAGE_CACHE, else a system folder: the build's and the sandboxes' users must be able to reach it (a home
    folder is often closed to them)."""
    return Path(os.environ.get("MC_IMAGE_CACHE") or "/var/cache/megatron-composer/images")


def host_suite() -> str:
    """The host's Debian release (its packages are what this host reaches), else DEFAULT_SUITE."""
    try:
        fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    except OSError:
        return DEFAULT_SUITE
    if fields.get("ID", "").strip('"') == "debian" and fields.get("VERSION_CODENAME"):
        return fields["VERSION_CODENAME"].strip('"')
    return DEFAULT_SUITE


def build_problem() -> str | None:
    """Why this host cannot build images, in one line with the fix; None when it can."""
    if os.geteuid() != 0:
        return ("building a task's image needs root (its build maps a range of uids, as a container engine does); "
                "run as root, or use a container backend (--backend podman or docker)")
    if shutil.which("mmdebstrap") is None:
        return "building a task's image needs mmdebstrap, which this host lacks: apt-get install mmdebstrap"
    if bwrap_path() is None:
        return "building a task's image needs bubblewrap: apt-get install bubblewrap"
    return None


@dataclass
class ImageRecipe:
    """What to build (made by a task loader from a Dockerfile): Debian packages that stand in for the FROM image's
    family, then the steps (each has `apply(build_root, timeout)`), under `key`, a digest of all the build reads."""

    key: str
    packages: tuple[str, ...]
    steps: list
    timeout_s: float  # for each step
    what: str  # what it is built from, for messages
    required: str | None = None  # why the host's system cannot stand in (None: it can; a backend may build anyway)
    dockerfile: str = ""  # the Dockerfile as written, for a container engine that builds it from the same base
    verifier_packages: tuple[str, ...] = ()  # what the task's verifier has uv or pip install: pip installs them here
    stages: dict = field(default_factory=dict)  # name -> ImageRecipe: images its steps copy from (COPY --from)
    stand_in: tuple[str, ...] = ()  # commands after the packages that give the base what the FROM image has


@dataclass
class Image:
    """A built image: its layers on the host (top first: its own, then the base's) and how it came to be."""

    layers: tuple[Path, ...]
    key: str
    build_s: float  # how long its build took (when it was built)
    cached: bool  # found in the cache by this lookup


def _shift_owners(root: Path, by: int) -> None:
    """Add `by` to every file's owner and group once (never following links; a file with several hard links is
    one file), keeping set-id bits, which chown clears."""
    done: set[tuple[int, int]] = set()

    def shift(path: str) -> None:
        st = os.lstat(path)
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            if (st.st_dev, st.st_ino) in done:
                return
            done.add((st.st_dev, st.st_ino))
        os.lchown(path, st.st_uid + by, st.st_gid + by)
        if not os.path.islink(path) and st.st_mode & 0o7000:
            os.chmod(path, st.st_mode & 0o7777)

    shift(str(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            shift(os.path.join(dirpath, name))


def _pip_host_paths() -> tuple[list[str], dict[str, str]]:
    """pip's configuration on the host: the config files and the local folders they or PIP_* name (file:// indexes,
    find-links, constraints), to be seen read-only by the build; and the PIP_* environment to pass."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_") and k != "PIP_CERT"}
    values = list(env.values())
    files = [p for p in PIP_CONFIGS if os.path.isfile(p)]
    for path in files:
        parser = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(configparser.Error, OSError):
            parser.read(path)
            values += [v for section in parser.sections() for _, v in parser.items(section)]
    paths = list(files)
    for value in values:
        for word in value.split():
            word = word[len("file://"):] if word.startswith("file://") else word
            if word.startswith("/") and os.path.exists(word):
                paths.append(os.path.normpath(word))
    return sorted(set(paths)), env


@dataclass
class HostNetworkView:
    """What a build sees of the host to reach the network as the host does: read-only binds (host path, path in
    the build) and environment. The host's CA bundle goes to BUILD_HOST_DIR (the image's own bundle stays its
    own), named by the usual variables: a proxy may sign TLS with the host's own authority."""

    binds: list[tuple[str, str]]
    env: dict[str, str]


def host_network_view(name_service: bool = True) -> HostNetworkView:
    """The host's CA bundle, pip's configuration and the local indexes it names, and (`name_service`: for a build
    that shares the host's network namespace) resolv.conf and hosts."""
    pip_paths, env = _pip_host_paths()
    paths = [p for p in ((*HOST_NET_FILES,) if name_service else ()) + tuple(pip_paths) if os.path.exists(p)]
    binds = [(p, p) for p in paths]
    ca = next((p for p in CA_BUNDLES if os.path.isfile(p)), None)
    if ca:
        binds.append((ca, f"{BUILD_HOST_DIR}/ca.crt"))
        env.update({k: f"{BUILD_HOST_DIR}/ca.crt" for k in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE",
                                                             "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
                                                             "NODE_EXTRA_CA_CERTS")})
    return HostNetworkView(binds, env)


class BuildRoot:
    """One image's build phase: commands run as root in its root filesystem, with the host's network.
    It offers what a task's setup steps use of a sandbox (`exec`, `copy_in`)."""

    builds_image = True  # a setup step's failure here is the build's, not a missing part of the host

    def __init__(self, root: Path, default_timeout_s: float = 1800.0):
        self.root = root
        self.default_timeout_s = default_timeout_s
        self._bwrap = bwrap_path()
        self._network = host_network_view()
        self.outputs: list[tuple[str, str]] = []  # (step, output) of the steps so far: a later failure may be theirs
        self.stage_roots: dict[str, Path] = {}  # images its COPY --from steps copy out of (ImageRecipe.stages)

    def exec(self, command: str, *, timeout: float | None = None, cwd: str = "/",
             env: dict[str, str] | None = None) -> ExecResult:
        env = {**BUILD_ENV, **self._network.env, **(env or {})}
        argv = [self._bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv", "--uid", "0", "--gid", "0"]
        for cap in BUILD_CAPS:
            argv += ["--cap-add", cap]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--bind", str(self.root), "/", "--proc", "/proc", "--dev", "/dev"]
        # what bwrap will make as mount points (each bind's place and the folders above it that are missing)
        created = {str(p) for _, dest in self._network.binds
                   for p in [Path(dest), *Path(dest).parents] if p != Path("/")
                   and not os.path.lexists(self.root / str(p).lstrip("/"))}
        if any(dest.startswith(BUILD_HOST_DIR + "/") for _, dest in self._network.binds):
            argv += ["--tmpfs", BUILD_HOST_DIR]
        for host, dest in self._network.binds:
            argv += ["--ro-bind", host, dest]
        argv += ["--chdir", cwd, "--", "bash", "--noprofile", "--norc", "-c", command]
        try:
            return self._run_mapped(argv, timeout or self.default_timeout_s)
        finally:  # the mount points bwrap had to make are not part of the image (what was there before stays)
            for path in sorted(created, key=len, reverse=True):
                _remove_mountpoint(self.root / path.lstrip("/"))

    def _run_mapped(self, argv: list[str], timeout: float) -> ExecResult:
        """Run bubblewrap as the build range's first uid; as soon as it has made the user namespace, map uids and
        gids 0-65535 inside to the build range outside (only a privileged host may map a range), then let it go on."""
        block_r, block_w = os.pipe()
        info_r, info_w = os.pipe()
        argv = [argv[0], "--userns-block-fd", str(block_r), "--info-fd", str(info_w), *argv[1:]]
        mapped: list[str] = []

        def map_user():
            try:
                info = read_bwrap_info(info_r, timeout_s=60)
                pid = info.get("child-pid")
                if isinstance(pid, int):
                    for name in ("uid_map", "gid_map"):
                        with open(f"/proc/{pid}/{name}", "w") as f:
                            f.write(f"0 {BUILD_UID_BASE} {BUILD_UIDS}\n")
                    mapped.append("yes")
            except (OSError, SandboxError) as e:
                mapped.append(str(e))
            finally:
                with contextlib.suppress(OSError):
                    os.write(block_w, b"1")

        mapper = threading.Thread(target=map_user, daemon=True)
        mapper.start()
        try:
            res = run_process(argv, timeout=timeout, max_output=MAX_BUILD_OUTPUT, env={"PATH": BASE_ENV["PATH"]},
                              user=BUILD_UID_BASE, group=BUILD_UID_BASE, pass_fds=(block_r, info_w), poll_s=1.0)
        finally:
            os.close(block_r)
            os.close(info_w)
            mapper.join(timeout=60)
            os.close(info_r)
            os.close(block_w)
        if mapped and mapped[0] != "yes":
            res.events.append(f"the build's users could not be mapped: {mapped[0]}")
        return res

    def copy_in(self, host_path: str | Path, dest: str, merge: bool = False) -> None:
        """Put a host file or folder's contents at `dest` in the image (COPY/ADD), owned by the image's root, never
        through a link that a RUN step left in the image (rl/sandbox/safe_tree.py)."""
        if not dest.startswith("/") or ".." in Path(dest).parts:
            raise SandboxError(f"COPY destination must be an absolute path without '..', got {dest!r}")
        if Path(host_path).is_file() and dest.endswith("/"):
            dest += Path(host_path).name
        try:
            copy_into(host_path, self.root, dest, owner=(BUILD_UID_BASE, BUILD_UID_BASE), merge=merge)
        except SandboxError as e:
            raise SandboxError(f"COPY to {dest}: {e}") from None


def _remove_mountpoint(path: Path) -> None:
    """Remove an empty file or folder bwrap made as a mount point (never one a step filled)."""
    try:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        elif path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (a file): builds of one image, or of the base, wait for each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ImageBuilder:
    """Builds and caches images under `cache_dir` (MC_IMAGE_CACHE, default /var/cache/megatron-composer/images):
    `base-<digest>/` the Debian root filesystem, `<digest>/` each image (its root in `rootfs/`, how it was built
    in `image.json`), `logs/` the build logs."""

    def __init__(self, cache_dir: str | Path | None = None, suite: str | None = None, progress=print):
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.suite = suite or host_suite()
        self.progress = progress
        recipe = [self.suite, BASE_PACKAGES, "shift-once", BUILD_UID_BASE, APT_CLEAN, uv_install_command(),
                  "mount-points-of-their-own"]
        digest = hashlib.sha256(json.dumps(recipe).encode())
        self.base_key = digest.hexdigest()[:16]

    def problem(self) -> str | None:
        return build_problem()

    def _work_dir(self) -> Path:
        """A new build folder; it and the cache are open to traversal: the build's root (a uid of the build range)
        and the sandboxes' users reach the image through them."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for folder in [self.cache_dir, *self.cache_dir.parents]:
            if folder.stat().st_mode & 0o001 == 0:
                raise SandboxError(f"the image cache {self.cache_dir} is inside {folder}, which other users cannot "
                                   "enter; set MC_IMAGE_CACHE to a folder under one they can (e.g. /var/cache)")
        work = make_dir("build", self.cache_dir)
        os.chmod(work, 0o711)
        return work

    def _finished(self, folder: Path) -> bool:
        return (folder / "image.json").is_file()

    def base_folder(self) -> Path:
        """Where this host's base is kept (built or not)."""
        return self.cache_dir / f"base-{self.base_key}"

    def base(self) -> Path:
        """The Debian root filesystem every image starts from (built by mmdebstrap on first use)."""
        folder = self.base_folder()
        if self._finished(folder):
            return folder / "rootfs"
        if (why := self.problem()) is not None:
            raise SandboxError(why)
        with _locked(self.cache_dir / f".base-{self.base_key}.lock"):
            if self._finished(folder):
                return folder / "rootfs"
            sweep(str(self.cache_dir))
            self.progress(f"building the Debian {self.suite} base image (once per host; about a minute) ...")
            t0 = time.monotonic()
            work = self._work_dir()
            try:
                rootfs = work / "rootfs"
                log = self.log_path(f"base-{self.base_key}")
                cmd = ["mmdebstrap", "--variant=minbase", "--mode=root", f"--include={','.join(BASE_PACKAGES)}",
                       self.suite, str(rootfs)]
                with open(log, "w") as f:
                    res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if res.returncode != 0:
                    raise SandboxError(f"building the Debian {self.suite} base image failed ({_last_line(log)}); "
                                       f"the whole log: {log}")
                for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
                    marker.unlink()  # pip installs system-wide in a build, as in a python:* image
                (rootfs / "etc" / "apt" / "apt.conf.d" / "docker-clean").write_text(APT_CLEAN)
                _shift_owners(rootfs, BUILD_UID_BASE)
                uv = self._install_uv(rootfs)
                self._finish(work, folder, {"suite": self.suite, "packages": list(BASE_PACKAGES), "uv": uv,
                                            "build_s": round(time.monotonic() - t0, 1)})
            finally:
                force_rmtree(work)
        return folder / "rootfs"

    def _install_uv(self, rootfs: Path) -> str | None:
        """The real uv into the base (the `uv` wheel, from the package index); its version, or None where the index
        cannot be reached: the base is still made, and an image's `uv` then says in one line that it has none."""
        res = BuildRoot(rootfs).exec(uv_install_command(), timeout=600)
        if res.ok:
            return UV_VERSION
        log = self.log_path("base-uv")
        log.write_text(f"$ {uv_install_command()}\n{res.output}")
        self.progress(f"the base has no uv: installing the uv {UV_VERSION} wheel failed ({_last_line(log)}); task "
                      f"verifiers that use uv will say so (the whole log: {log})")
        return None

    def base_archive(self) -> Path:
        """The base as a tar archive with its owners as the build made them (uid 0 is root there), readable by every
        user: what container engines import, a rootless one included (it cannot read the base's private files).
        Written once, by root (the base is root's)."""
        archive = self.cache_dir / f"base-{self.base_key}" / "rootfs.tar"
        if archive.is_file():
            return archive
        root = self.base()
        if os.geteuid() != 0:
            raise SandboxError(f"the local base has no archive for container engines yet ({archive}); root writes it "
                               "once: run `make test-podman` or `tools/check_task.py TASK --backend podman "
                               "--local-base` as root")

        def unshift(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid, info.gid = info.uid - BUILD_UID_BASE, info.gid - BUILD_UID_BASE
            info.uname = info.gname = ""
            return info

        partial = archive.with_name(f".rootfs.tar.{os.getpid()}")
        try:
            with tarfile.open(partial, "w") as tar:
                for entry in sorted(os.listdir(root)):
                    tar.add(root / entry, arcname=entry, filter=unshift)
            os.chmod(partial, 0o644)
            os.replace(partial, archive)
        finally:
            partial.unlink(missing_ok=True)
        return archive

    def export_base(self, engine: str) -> str:
        """The base as an image of a container engine (podman, docker; rootless too), imported once from
        `base_archive`. Returns its reference."""
        ref = f"localhost/megatron-composer/debian-{self.suite}:{self.base_key}"
        if subprocess.run([engine, "image", "inspect", ref], capture_output=True).returncode == 0:
            return ref
        archive = self.base_archive()
        self.progress(f"importing the Debian {self.suite} base into {engine} as {ref} ...")
        res = subprocess.run([engine, "import", "--change", f"ENV PATH={BASE_ENV['PATH']}", str(archive), ref],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise SandboxError(f"{engine} import of the base failed: {res.stderr.strip()[-300:]}")
        return ref

    def log_path(self, name: str) -> Path:
        logs = self.cache_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"

    def _finish(self, work: Path, folder: Path, meta: dict) -> None:
        (work / "image.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(work, folder)
        except OSError:
            if not self._finished(folder):  # another process finished the same image first: keep theirs
                raise

    def key(self, recipe_key: str) -> str:
        return hashlib.sha256(f"{self.base_key}:{TOOLS_DIGEST}:{IMAGE_LAYOUT}:{recipe_key}".encode()).hexdigest()[:24]

    def _image(self, folder: Path, meta: dict, cached: bool) -> Image:
        """The image kept in `folder`: its layer over the base (overlayfs), or its whole root (copies)."""
        own = folder / "layer"
        layers = (own, self.cache_dir / f"base-{meta.get('base', self.base_key)}" / "rootfs") if own.is_dir() \
            else (folder / "rootfs",)
        return Image(layers, folder.name, float(meta.get("build_s", 0.0)), cached=cached)

    def lookup(self, recipe_key: str) -> Image | None:
        folder = self.cache_dir / self.key(recipe_key)
        if not self._finished(folder):
            return None
        meta = json.loads((folder / "image.json").read_text())
        try:  # its record's time is its last use, which `prune` reads
            os.utime(folder / "image.json")
        except OSError:
            pass
        return self._image(folder, meta, cached=True)

    @contextlib.contextmanager
    def view(self, image: Image):
        """``with builder.view(image) as root:`` the image's merged root, read-only (a stage that a later
        Dockerfile stage copies from)."""
        if len(image.layers) == 1:
            yield image.layers[0]
            return
        with held_view(self.cache_dir) as target:
            mount_overlay(list(image.layers), target)
            try:
                yield target
            finally:
                unmount(target)

    def prune(self, unused_days: float | None = None, dry_run: bool = False,
              max_bytes: int | None = None) -> list[tuple[Path, int, str]]:
        """Remove what this cache holds that no prepare will use: bases other than this host's current one, images
        built on another base or by other image tools or layout (older code), unfinished builds of processes that no
        longer run, with `unused_days` images not used for that long and build logs as old, and with `max_bytes`
        the least recently used images until the cache fits. An image a running sandbox stacks (its layer is mounted)
        is never removed. Returns (folder, bytes, why) of each."""
        sweep(str(self.cache_dir))  # unfinished builds of stopped processes
        if not self.cache_dir.is_dir():
            return []
        now, removed = time.time(), []
        kept: list[tuple[float, Path, int]] = []  # images that stay: (last use, folder, bytes)
        total = 0
        for folder in sorted(p for p in self.cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            record = folder / "image.json"
            if folder.name == "logs":
                why_of = {f: "a build log older than the limit" for f in folder.iterdir()
                          if unused_days is not None and now - f.stat().st_mtime > unused_days * 86400}
                for f, why in why_of.items():
                    removed.append((f, f.stat().st_size, why))
                    if not dry_run:
                        f.unlink()
                continue
            if not record.is_file():
                continue  # a build in progress (mc-build-*): the sweep removes it once its owner stops
            meta = json.loads(record.read_text())
            size = dir_usage([str(folder)])[0]
            layer = folder / ("rootfs" if folder.name.startswith("base-") or not (folder / "layer").is_dir()
                              else "layer")
            if folder.name.startswith("base-"):
                why = None if folder.name == f"base-{self.base_key}" else "a base this host no longer builds on"
            elif (meta.get("base"), meta.get("tools"), meta.get("layout")) != (self.base_key, TOOLS_DIGEST,
                                                                                  IMAGE_LAYOUT):
                why = "built on another base or by older image tools"
            elif unused_days is not None and now - record.stat().st_mtime > unused_days * 86400:
                why = f"not used for {unused_days:g} days"
            else:
                why = None
            if why and in_use(layer):
                why = None  # a sandbox stacks it now
            if why:
                removed.append((folder, size, why))
                if not dry_run:
                    force_rmtree(folder)
            else:
                total += size
                if not folder.name.startswith("base-"):
                    kept.append((record.stat().st_mtime, folder, size))
        if max_bytes is not None:
            for _, folder, size in sorted(kept):  # least recently used first
                if total <= max_bytes:
                    break
                if in_use(folder / "layer") or in_use(folder / "rootfs"):
                    continue
                removed.append((folder, size, f"the least recently used while the cache is over "
                                              f"{max_bytes / 2**30:g} GB"))
                total -= size
                if not dry_run:
                    force_rmtree(folder)
        return removed

    def build_recipe(self, recipe: ImageRecipe) -> Image:
        """Build (or find) a loader's recipe: the images it copies from first, then its packages from the Debian
        mirror, then its steps."""
        stages = {name: self.build_recipe(stage) for name, stage in recipe.stages.items()}

        def steps(root: BuildRoot) -> None:
            with contextlib.ExitStack() as views:
                root.stage_roots = {name: views.enter_context(self.image_view(image))
                                    for name, image in stages.items()}
                build_steps(root)

        def build_steps(root: BuildRoot) -> None:
            if recipe.packages:
                command = ("apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                           + " ".join(recipe.packages) + " && rm -rf /var/lib/apt/lists/*")
                res = root.exec(command, timeout=recipe.timeout_s)
                if not res.ok:
                    log = self.log_path("packages")
                    log.write_text(f"$ {command}\n{res.output}")
                    raise SandboxError(f"{recipe.what}: installing {', '.join(recipe.packages)} for the image failed "
                                       f"({res.describe()}); the whole log: {log}")
            for command in recipe.stand_in:
                res = root.exec(command, timeout=recipe.timeout_s)
                if not res.ok:
                    raise SandboxError(f"{recipe.what}: the stand-in's `{command}` failed ({res.describe()}): "
                                       f"{res.output.strip()[-200:]}")
            for step in recipe.steps:
                step.apply(root, recipe.timeout_s)
            if recipe.verifier_packages:  # from the package index now, so that the verifier needs no network
                command = "python3 -m pip install --no-cache-dir -q " + " ".join(
                    shlex.quote(p) for p in recipe.verifier_packages)
                res = root.exec(command, timeout=recipe.timeout_s)
                if not res.ok:
                    log = self.log_path("verifier-packages")
                    log.write_text(f"$ {command}\n{res.output}")
                    newer = re.search(r"require a different python version: .*?Requires-Python (\S+)", res.output)
                    why = (f"its releases need Python {newer.group(1).rstrip(';,')}, newer than the stand-in's "
                           f"(Debian {self.suite}'s python3)" if newer else _last_line(log))
                    raise SandboxError(f"{recipe.what}: installing what the verifier asks for "
                                       f"({', '.join(recipe.verifier_packages)}) failed ({res.describe()}: "
                                       f"{why}); the whole log: {log}")
                res = root.exec(uv_warm_command(recipe.verifier_packages), timeout=recipe.timeout_s,
                                env=uv_index_env())
                if not res.ok:
                    log = self.log_path("verifier-uv-cache")
                    log.write_text(f"$ {uv_warm_command(recipe.verifier_packages)}\n{res.output}")
                    raise SandboxError(f"{recipe.what}: uv could not cache what the verifier asks for "
                                       f"({', '.join(recipe.verifier_packages)}) ({res.describe()}: "
                                       f"{_last_line(log)}); the whole log: {log}")

        return self.build(recipe.key, steps, what=recipe.what)

    @contextlib.contextmanager
    def image_view(self, image: Image):
        """A read-only view of `image`'s root filesystem for the time of the block (what COPY --from reads): its
        layers stacked (overlayfs), or its one folder where layers are copies."""
        if len(image.layers) == 1:
            yield image.layers[0]
            return
        work = self._work_dir()
        view = work / "view"
        try:
            view.mkdir()
            if use_overlay():
                mount_overlay(image.layers, view)
                try:
                    yield view
                finally:
                    unmount(view)
            else:
                materialize(image.layers, view)
                yield view
        finally:
            force_rmtree(work)

    def build(self, recipe_key: str, steps: Callable[[BuildRoot], None], what: str = "image",
              parent: Image | None = None) -> Image:
        """The image of `recipe_key` (a digest of everything its build reads), building it with `steps` (run
        against a BuildRoot whose root is a new layer over the base, or over `parent`'s layers) unless it is cached.
        A failed build leaves nothing behind."""
        if (found := self.lookup(recipe_key)) is not None:
            return found
        lowers = list(parent.layers) if parent is not None else [self.base()]
        key = self.key(recipe_key)
        with _locked(self.cache_dir / f".{key}.lock"):
            if (found := self.lookup(recipe_key)) is not None:
                return found
            self.progress(f"building {what} (cached afterwards as {key}) ...")
            t0 = time.monotonic()
            work = self._work_dir()
            overlay = use_overlay()
            merged = work / ("merged" if overlay else "rootfs")
            try:
                if overlay:  # the build writes a layer of its own: nothing of the base is copied
                    for name in ("layer", "ovl-work", "merged"):
                        (work / name).mkdir()
                    base_root = os.stat(lowers[-1])
                    os.chown(work / "layer", base_root.st_uid, base_root.st_gid)
                    os.chmod(work / "layer", stat.S_IMODE(base_root.st_mode))
                    mount_overlay(lowers, merged, work / "layer", work / "ovl-work")
                else:
                    materialize(lowers, merged)
                try:
                    root = BuildRoot(merged)
                    steps(root)
                    for name in ("uv", "uvx"):  # after the steps: what runs uv offline for the verifier (its cache)
                        root.copy_in(UV_TOOL, f"/usr/local/bin/{name}")
                        _chmod_in(merged, f"/usr/local/bin/{name}", 0o755)
                    # what uv's installer leaves, which verifiers source (`source $HOME/.local/bin/env`); uv is here
                    with held_file(UV_INSTALLER_ENV) as env_file:
                        root.copy_in(env_file, f"{HOME}/.local/bin/env")
                    if not _exists_in(merged, "/etc/hosts"):  # where each sandbox mounts its own, as docker does
                        with held_file("") as empty:
                            root.copy_in(empty, "/etc/hosts")
                finally:
                    if overlay:
                        unmount(merged)
                if overlay:
                    force_rmtree(work / "ovl-work")
                    merged.rmdir()
                build_s = time.monotonic() - t0
                self._finish(work, self.cache_dir / key, {"what": what, "base": self.base_key, "tools": TOOLS_DIGEST,
                                                          "layout": IMAGE_LAYOUT, "build_s": round(build_s, 1),
                                                          "parent": parent.key if parent is not None else None})
            finally:
                force_rmtree(work)
        return self._image(self.cache_dir / key, {"base": self.base_key, "build_s": build_s}, cached=False)


# $HOME/.local/bin/env as uv's installer writes it: verifiers run `curl ... astral.sh/uv/install.sh | sh` (offline, it
# fails) and `source $HOME/.local/bin/env`, which under `set -e` must not stop them; the image has uv already.
UV_INSTALLER_ENV = 'case ":${PATH}:" in *:"$HOME/.local/bin":*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac\n'


@contextlib.contextmanager
def held_file(text: str):
    """A host file holding `text`, for the time of the block."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="mc-image-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
        yield Path(path)
    finally:
        os.unlink(path)


@contextlib.contextmanager
def held_view(parent: Path):
    """An empty folder to mount a read-only view of an image on, removed (and its mount detached) after."""
    target = make_dir("build", parent)
    try:
        yield target
    finally:
        force_rmtree(target)


def _exists_in(root: Path, path: str) -> bool:
    parts = path.strip("/").split("/")
    try:
        fd = open_dir(root, "/".join(parts[:-1]))
    except OSError:
        return False
    try:
        os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _chmod_in(root: Path, path: str, mode: int) -> None:
    """chmod a file inside a build's root, never through a link."""
    parts = path.strip("/").split("/")
    fd = open_dir(root, "/".join(parts[:-1]))
    try:
        inner = open_beneath(fd, parts[-1], os.O_RDONLY)
        try:
            os.fchmod(inner, mode)
        finally:
            os.close(inner)
    finally:
        os.close(fd)


def containerfile(recipe: ImageRecipe, base_ref: str, cleanup: str | None = None) -> str:
    """The recipe as a Containerfile on `base_ref` (the Debian base, imported into a container engine by
    `ImageBuilder.export_base`, with the real uv): the same packages, the Dockerfile's own instructions, what the
    verifier asks for (pip-installed, and in uv's cache) and the `uv` that runs it offline, so that the engine builds
    what the local backend builds. `cleanup` is a last command (what the build saw of the host goes). The steps after
    the Dockerfile's own run as root, then its USER is back."""
    if recipe.stages:
        raise SandboxError(f"{recipe.what}: a multi-stage Dockerfile (COPY --from) is not rebuilt on the local base; "
                           "run it on the local backend, or on the engine without --local-base")
    lines = [f"FROM {base_ref}", "ARG " + " ".join(sorted(host_network_view(name_service=False).env))]
    if recipe.packages:
        lines.append("RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                     + " ".join(recipe.packages) + " && rm -rf /var/lib/apt/lists/*")
    lines += [f"RUN {command}" for command in recipe.stand_in]
    body = [line for line in recipe.dockerfile.replace("\\\n", " ").splitlines()
            if not re.match(r"\s*FROM\s", line, re.IGNORECASE)]
    lines += body
    users = [m.group(1) for line in body if (m := re.match(r"\s*USER\s+(\S+)", line, re.IGNORECASE))]
    if users:
        lines.append("USER root")
    if recipe.verifier_packages:
        lines.append("RUN python3 -m pip install --no-cache-dir -q "
                     + " ".join(shlex.quote(p) for p in recipe.verifier_packages))
        warm = base64.b64encode(uv_warm_command(recipe.verifier_packages).encode()).decode()
        lines.append(f"RUN echo {warm} | base64 -d | bash")
    encoded = base64.b64encode(UV_TOOL.read_bytes()).decode()
    lines.append(f"RUN echo {encoded} | base64 -d > /usr/local/bin/uv && cp /usr/local/bin/uv /usr/local/bin/uvx "
                 "&& chmod 755 /usr/local/bin/uv /usr/local/bin/uvx")
    if cleanup:
        lines.append(f"RUN {cleanup}")
    if users:
        lines.append(f"USER {users[-1]}")
    return "\n".join(lines) + "\n"


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return re.sub(r"\s+", " ", lines[-1])[:200] if lines else "no output"
