"""The verifier's own network, and the episode's services published into it.

The verifier phase runs in a user and network namespace of its own (`VerifierNamespaces`), not the episode's: a port
it binds is its own, an abstract unix socket of the episode does not exist for it, and nothing the agent left running
can reach it. The ports the episode's services listen on when the agent phase ends are published into it the way a
container's published port works (`PortForward`): a connection to 127.0.0.1:P (or [::1]:P) in the verifier's network
reaches the service on P in the episode's. A port the verifier binds itself stays the verifier's: connections to P go
to a relay by an nftables redirect, and the relay hands each one to the verifier's own listener on P when there is one,
else to the episode's service (without nftables the relay listens on P itself, so a verifier that binds a published
port fails to bind it; docs/SANDBOX.md). A verifier that talks to P before its own server there listens (a readiness
probe) may have reached the episode's service instead: the relay watches for the verifier's listeners, and a port
that both answered from the episode and was bound by the verifier is a conflict (`conflicts`), which voids the
verdict rather than let the episode's service pose as the verifier's own.

Namespaces are entered by host threads (setns is per thread), so the relays run in the host process.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import selectors
import shutil
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl.sandbox.base import BASE_ENV, SandboxError

CLONE_NEWNET = 0x40000000
BYPASS_MARK = 0x4D43  # set by the relay on its own connections: they are not redirected again
_TCP_LISTEN = "0A"
_UDP_UNCONNECTED = "07"


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def in_netns(ns_path: str, fn):
    """fn() run by a thread that has joined the network namespace at ns_path (sockets it makes live there)."""
    out: dict = {}

    def run():
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {ns_path}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    t = threading.Thread(target=run, name="sandbox-netns", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _loopback_up() -> None:
    """Bring `lo` up in the current thread's network namespace (SIOCSIFFLAGS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 0x1, b""))  # SIOCSIFFLAGS, IFF_UP


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(proto, port) of every TCP listener and bound UDP socket in pid's network namespace."""
    found = set()
    for proto, files, state in (("tcp", ("tcp", "tcp6"), _TCP_LISTEN), ("udp", ("udp", "udp6"), _UDP_UNCONNECTED)):
        for name in files:
            try:
                lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) > 3 and fields[3] == state:
                    port = int(fields[1].rsplit(":", 1)[1], 16)
                    if port:
                        found.add((proto, port))
    return sorted(found)


@functools.lru_cache(maxsize=1)
def nft_problem() -> str | None:
    """Why published ports cannot give way to the verifier's own listeners here, or None."""
    nft = shutil.which("nft")
    if nft is None:
        return "nftables (nft) is not installed: apt-get install nftables"
    if os.geteuid() != 0:
        return "not root"
    res = subprocess.run(["unshare", "--net", nft, "-f", "-"], input="table inet mc_probe {}\n", capture_output=True,
                         text=True, env={"PATH": BASE_ENV["PATH"]})
    return None if res.returncode == 0 else f"nft cannot make a table here ({res.stderr.strip()[:200]})"


def _hold_userns(argv: list[str], parent_userns: str, mapping: str, writer: list[str] = ()) -> subprocess.Popen:
    """A process (`cat`, waiting on its input) started by argv in a user namespace of its own, whose maps are written
    (`mapping` for uids and gids) once it is a child of `parent_userns` (the namespace it was made in): by the host,
    or by `writer` (a command prefix that enters the parent namespace, where the kernel wants the writer to be)."""
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={"PATH": BASE_ENV["PATH"]}, start_new_session=True)
    deadline = time.monotonic() + 10
    try:
        while True:  # unshare has made the namespaces once it runs `cat`
            try:
                if os.readlink(f"/proc/{holder.pid}/ns/user") != parent_userns and \
                        os.readlink(f"/proc/{holder.pid}/exe").endswith("/cat"):
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                err = holder.stderr.read().decode(errors="replace").strip()[:200]
                raise SandboxError(f"cannot make the verifier's namespaces: {err or 'unshare did not start'}")
            time.sleep(0.0005)
        for name in ("uid_map", "gid_map"):
            if writer:
                res = subprocess.run([*writer, "sh", "-c", f'printf "{mapping.strip()}" > /proc/{holder.pid}/{name}'],
                                     capture_output=True, text=True, env={"PATH": BASE_ENV["PATH"]})
                if res.returncode != 0:
                    raise SandboxError(f"cannot map the verifier's users: {res.stderr.strip()[:200]}")
            else:
                with open(f"/proc/{holder.pid}/{name}", "w") as f:
                    f.write(mapping)
    except BaseException:
        _end(holder)
        raise
    return holder


def _end(holder: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        holder.kill()
    with contextlib.suppress(OSError):
        holder.stdin.close()
    holder.wait()
    holder.stderr.close()


@dataclass
class VerifierNamespaces:
    """The verifier's own world: a user namespace (uids 0-65535 mapped to `uid_base` onwards, the image range) and a
    network and ipc namespace it owns, with loopback up; and for `judge`, a user namespace nested in it that maps the
    same uids (its root is the verifier's root, who owns it: the judged code can run there as the agent's user, whose
    files the work tree holds). Each is held by a small process (`holder`, `judge_holder`), whose end ends it; a
    holder's pid and start time name it (mc-enter refuses a pid that another process took since)."""

    uid_base: int
    holder: subprocess.Popen | None = field(default=None, repr=False)
    judge_holder: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> "VerifierNamespaces":
        if os.geteuid() != 0:
            raise SandboxError("a verifier network of its own needs root on the host")
        try:
            self.holder = _hold_userns(["unshare", "--user", "--net", "--ipc", "--", "cat"],
                                       os.readlink("/proc/self/ns/user"), f"0 {self.uid_base} 65536\n")
            in_netns(self.net, _loopback_up)
            enter = ["nsenter", f"--user=/proc/{self.holder.pid}/ns/user", "-S", "0", "-G", "0", "--"]
            self.judge_holder = _hold_userns([*enter, "unshare", "--user", "--", "cat"],
                                             os.readlink(f"/proc/{self.holder.pid}/ns/user"), "0 0 65536\n", enter)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def pid(self) -> int:
        return self.holder.pid

    @property
    def net(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def bind_judge_userns(self, target: Path) -> None:
        """Bind the judge's user namespace onto the file `target` (a bind mount holds it; its holder then ends), so
        that the verifier's view can hold it where bubblewrap cannot bind /proc/<pid>/ns/* itself."""
        from rl.sandbox.layers import bind_mount

        bind_mount(Path(f"/proc/{self.judge_holder.pid}/ns/user"), target)
        _end(self.judge_holder)
        self.judge_holder = None

    def start_time(self) -> int:
        with open(f"/proc/{self.holder.pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])

    def enter_argv(self) -> list[str]:
        """mc-enter options that join these namespaces (user first)."""
        pid = self.holder.pid
        return ["--expect", f"{pid}:{self.start_time()}", *[a for ns in ("user", "net", "ipc")
                                                           for a in ("--ns-file", f"{ns}=/proc/{pid}/ns/{ns}")]]

    def close(self) -> None:
        for name in ("judge_holder", "holder"):
            holder = getattr(self, name)
            if holder is not None:
                _end(holder)
                setattr(self, name, None)


class PortForward:
    """Publishes the episode's service ports into the verifier's network (see the module's docstring)."""

    def __init__(self, listen_ns: str, listen_pid: int, target_ns: str, ports: list[tuple[str, int]]):
        self.listen_ns, self.listen_pid, self.target_ns = listen_ns, listen_pid, target_ns
        self.ports = ports
        self.redirect = nft_problem() is None
        self._sel = selectors.DefaultSelector()
        self._stop_r, self._stop_w = os.pipe()
        self._sockets: list[socket.socket] = []
        self._udp_peers: dict[tuple, socket.socket] = {}
        self._lock = threading.Lock()
        self._to_episode: set[tuple[str, int]] = set()  # ports a connection of the verifier's went to the episode on
        self._verifier_bound: set[tuple[str, int]] = set()  # published ports the verifier was seen to listen on
        self._thread: threading.Thread | None = None

    def start(self) -> "PortForward":
        rules = []
        for proto, port in self.ports:
            kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                try:
                    sock = in_netns(self.listen_ns, functools.partial(self._listener, family, kind, host,
                                                                       0 if self.redirect else port))
                except OSError as e:
                    if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                        continue  # no IPv6 loopback here
                    raise SandboxError(f"cannot publish the episode's {proto} port {port} to the verifier: {e}") \
                        from None
                self._sockets.append(sock)
                self._sel.register(sock, selectors.EVENT_READ, (proto, port, family))
                ip = "ip" if family == socket.AF_INET else "ip6"
                rules.append(f"{ip} daddr {host} {proto} dport {port} redirect to :{sock.getsockname()[1]}")
        if self.redirect and rules:
            table = ("table inet mc_publish {\n chain output {\n  type nat hook output priority -100; policy accept;\n"
                     f"  meta mark {BYPASS_MARK} accept\n" + "".join(f"  {r}\n" for r in rules) + " }\n}\n")
            res = subprocess.run(["nsenter", f"--net={self.listen_ns}", "nft", "-f", "-"], input=table,
                                 capture_output=True, text=True, env={"PATH": BASE_ENV["PATH"]})
            if res.returncode != 0:
                self.close()
                raise SandboxError("cannot publish the episode's ports to the verifier: nft: "
                                   f"{res.stderr.strip()[:200]}")
        self._sel.register(self._stop_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name="sandbox-ports", daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _listener(family: int, kind: int, host: str, port: int) -> socket.socket:
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(64)
        sock.setblocking(False)
        return sock

    def _verifier_listens(self, proto: str, port: int) -> bool:
        """Whether the verifier's own process listens on `port` (the relay's listeners are on other ports)."""
        return self.redirect and (proto, port) in listening_ports(self.listen_pid)

    def _watch_verifier(self) -> None:
        """Note the published ports the verifier listens on now."""
        if self.redirect:
            bound = set(listening_ports(self.listen_pid)) & set(self.ports)
            with self._lock:
                self._verifier_bound |= bound

    def conflicts(self) -> list[tuple[str, int]]:
        """Published ports that answered the verifier from the episode and that the verifier bound itself."""
        self._watch_verifier()
        with self._lock:
            return sorted(self._to_episode & self._verifier_bound)

    def _connect(self, proto: str, port: int, family: int) -> socket.socket:
        """A socket connected to whoever serves `port` for the verifier: its own listener, else the episode's."""
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        if self._verifier_listens(proto, port):
            ns, mark = self.listen_ns, True
            with self._lock:
                self._verifier_bound.add((proto, port))
        else:
            ns, mark = self.target_ns, False
            with self._lock:
                self._to_episode.add((proto, port))
        order = [family] + [f for f in (socket.AF_INET, socket.AF_INET6) if f != family]

        def connect():
            last = None
            for fam in order:
                sock = socket.socket(fam, kind)
                if mark:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, BYPASS_MARK)
                sock.settimeout(10)
                try:
                    sock.connect(("127.0.0.1" if fam == socket.AF_INET else "::1", port))
                    return sock
                except OSError as e:
                    sock.close()
                    last = e
            raise last

        return in_netns(ns, connect)

    def _serve(self) -> None:
        while True:
            self._watch_verifier()
            for key, _ in self._sel.select(timeout=0.02):
                if key.data is None:
                    return
                proto, port, family = key.data
                sock = key.fileobj
                try:
                    if proto == "tcp":
                        client, _ = sock.accept()
                        threading.Thread(target=self._relay_tcp, args=(client, port, family), daemon=True,
                                         name="sandbox-port-relay").start()
                    else:
                        self._relay_udp(sock, port, family)
                except OSError:
                    continue

    def _relay_tcp(self, client: socket.socket, port: int, family: int) -> None:
        try:
            upstream = self._connect("tcp", port, family)
        except OSError:
            client.close()
            return
        client.setblocking(True)
        upstream.settimeout(None)
        pair = {client: upstream, upstream: client}
        sel = selectors.DefaultSelector()
        for s in pair:
            sel.register(s, selectors.EVENT_READ)
        open_ends = 2
        try:
            while open_ends:
                for key, _ in sel.select():
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                        with contextlib.suppress(OSError):
                            pair[key.fileobj].shutdown(socket.SHUT_WR)
                        open_ends -= 1
                        continue
                    pair[key.fileobj].sendall(data)
        except OSError:
            pass
        finally:
            sel.close()
            client.close()
            upstream.close()

    def _relay_udp(self, listener: socket.socket, port: int, family: int) -> None:
        data, addr = listener.recvfrom(1 << 16)
        key = (port, family, addr)
        with self._lock:
            peer = self._udp_peers.get(key)
        if peer is None:
            peer = self._connect("udp", port, family)
            peer.settimeout(None)
            with self._lock:
                self._udp_peers[key] = peer
            threading.Thread(target=self._udp_replies, args=(peer, listener, addr), daemon=True,
                             name="sandbox-port-relay").start()
        peer.send(data)

    @staticmethod
    def _udp_replies(peer: socket.socket, listener: socket.socket, addr) -> None:
        with contextlib.suppress(OSError):
            while True:
                listener.sendto(peer.recv(1 << 16), addr)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock in self._sockets + list(self._udp_peers.values()):
            sock.close()
        self._sel.close()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
