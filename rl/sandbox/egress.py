"""The agent's network as a task declares it (#59): a host-side HTTP proxy through which an episode with
`network_mode = "public"` reaches what this host reaches, and nothing else.

`EgressProxy` forwards plain HTTP (`GET http://host/path`) and tunnels CONNECT (HTTPS and anything else over TLS), to
the hosts it allows: by default the package registries this host is configured for (`registry_hosts`: pip's index,
extra indexes and find-links from pip.conf and PIP_*, PyPI's file host with PyPI, the apt sources' hosts, npm's
registry), plus what a run adds. Every other host is refused with an HTTP 403 whose status line and body name the
host. An upstream proxy in the host's environment (HTTP_PROXY, HTTPS_PROXY, NO_PROXY) is chained.

One proxy serves many concurrent episodes (a thread per connection), and logs every host each of them asked for
(`asked`, and `log`: a callable or a JSON-lines file). Which episode a connection belongs to is known structurally
where the sandbox gives each episode a listener of its own (`serve`: a socket made inside the episode's network
namespace, or a unix socket bound into it), which needs nothing of the client; on the shared TCP listener
(`start`), from the credentials of the episode's proxy URL (`episode_url`: a random token as the URL's user, which
HTTP clients send as Proxy-Authorization; a client that waits to be asked gets a 407 challenge). A connection with
no episode is refused.

    proxy = EgressProxy(allowed_hosts=registry_hosts() + ["huggingface.co"], log=run_dir / "egress.jsonl")
    host, port = proxy.start()
    env = {"HTTP_PROXY": proxy.episode_url("episode-17"), "HTTPS_PROXY": ...}   # or proxy.serve(sock, "episode-17")
    ...
    proxy.asked("episode-17")   # [("pypi.org", 443, True), ("example.com", 443, False), ...]
    proxy.close()
"""

from __future__ import annotations

import base64
import binascii
import configparser
import contextlib
import json
import os
import re
import secrets
import selectors
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

DEFAULT_PORTS = (80, 443)  # ports an allowed host is reached on unless its entry names one
PYPI_FILES = "files.pythonhosted.org"
MAX_HEAD = 64 * 1024  # a request's line and headers
CONNECT_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 300.0  # a tunnel or a forwarded request with no traffic either way for this long is closed
MAX_CONNECTIONS = 512  # open client connections of the whole proxy; more wait in the listen queue
REALM = "megatron-composer egress"


class EgressError(ValueError):
    """The proxy cannot be set up as asked (a bad allowed-host entry, an upstream proxy it cannot chain)."""


# What this host is configured to reach --------------------------------------------------------------------------
@dataclass
class PackageSources:
    """The package registries this host's tools are configured for: pip's index URLs (index, extra indexes,
    find-links), the apt sources' URIs and npm's registries."""

    pip: list[str]
    apt: list[str]
    npm: list[str]

    def hosts(self) -> list[str]:
        """Their hosts as allowed-host entries ("host" or "host:port"); PyPI's file host with PyPI."""
        entries: list[str] = []
        for url in self.pip + self.apt + self.npm:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                continue  # file:// indexes and local folders need no network
            entries.append(parts.hostname + (f":{parts.port}" if parts.port not in (None, *DEFAULT_PORTS) else ""))
            if parts.hostname == "pypi.org":
                entries.append(PYPI_FILES)
        return list(dict.fromkeys(entries))


def _pip_config_files() -> list[Path]:
    """pip's configuration files in the order pip reads them (later ones win; pip's own rule)."""
    home = Path.home()
    files = [Path("/etc/pip.conf"), Path("/etc/xdg/pip/pip.conf"), home / ".pip" / "pip.conf",
             Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return [f for f in files if f.is_file()]


def pip_index_settings(env: dict[str, str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """pip's (index URLs, extra index URLs, find-links) as PIP_* and pip.conf set them (PyPI unless configured)."""
    env = os.environ if env is None else env
    settings: dict[str, str] = {}
    for path in _pip_config_files():
        parser = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(configparser.Error, OSError):
            parser.read(path)
            for section in ("global", "install", "download"):
                if parser.has_section(section):
                    settings.update(parser.items(section))
    for key in ("index-url", "extra-index-url", "find-links"):
        if env.get(f"PIP_{key.upper().replace('-', '_')}"):
            settings[key] = env[f"PIP_{key.upper().replace('-', '_')}"]
    return (settings.get("index-url", "https://pypi.org/simple").split(), settings.get("extra-index-url", "").split(),
            settings.get("find-links", "").split())


def pip_sources(env: dict[str, str] | None = None) -> list[str]:
    """pip's index URL, extra index URLs and find-links, in that order."""
    index, extra, find_links = pip_index_settings(env)
    return index + extra + find_links


def apt_sources(folder: Path = Path("/etc/apt")) -> list[str]:
    """The URIs of the apt sources apt reads: sources.list and sources.list.d/*.list (one-line form), and
    sources.list.d/*.sources (deb822 `URIs:`)."""
    uris: list[str] = []
    one_line = [folder / "sources.list", *sorted((folder / "sources.list.d").glob("*.list"))]
    for path in one_line:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 2 and words[0] in ("deb", "deb-src"):
                    uris.append(words[1])
    for path in sorted((folder / "sources.list.d").glob("*.sources")):
        with contextlib.suppress(OSError):
            stanzas = re.split(r"\n\s*\n", path.read_text(errors="replace"))
            for stanza in stanzas:
                fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", stanza, re.MULTILINE))
                if fields.get("Enabled", "yes").strip().lower() != "no":
                    uris += fields.get("URIs", "").split()
    return uris


def npm_sources(env: dict[str, str] | None = None) -> list[str]:
    """npm's registries: `registry` and `@scope:registry` of the user's and the global npmrc and npm_config_*
    (npm's default registry where none is set)."""
    env = os.environ if env is None else env
    found: list[str] = []
    for path in (Path.home() / ".npmrc", Path("/etc/npmrc"), Path("/usr/etc/npmrc"),
                 Path("/usr/local/etc/npmrc")):
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                key, eq, value = line.partition("=")
                if eq and re.fullmatch(r"\s*(@[\w.-]+:)?registry\s*", key):
                    found.append(value.strip())
    found += [v for k, v in env.items() if k.lower() == "npm_config_registry" and v]
    return found or ["https://registry.npmjs.org/"]


def host_package_sources() -> PackageSources:
    return PackageSources(pip_sources(), apt_sources(), npm_sources())


def registry_hosts() -> list[str]:
    """The allowed-host entries of the package registries this host is configured for (the proxy's default)."""
    return host_package_sources().hosts()


# The upstream proxy in the host's environment -----------------------------------------------------------------
@dataclass
class Upstream:
    """An HTTP proxy to chain (the host's own way out): its address and Basic credentials, if any."""

    host: str
    port: int
    authorization: str | None = None

    @classmethod
    def parse(cls, url: str) -> "Upstream":
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise EgressError(f"upstream proxy {url!r}: only an http:// proxy can be chained (the host's HTTP_PROXY "
                              "/ HTTPS_PROXY)")
        auth = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return cls(parts.hostname, parts.port or 80, auth)


def upstream_from_env(env: dict[str, str] | None = None) -> tuple[Upstream | None, Upstream | None, list[str]]:
    """(for http://, for CONNECT, NO_PROXY entries) as the host's environment sets them (either case)."""
    env = os.environ if env is None else env

    def get(name: str) -> str:
        return env.get(name) or env.get(name.lower()) or ""

    http = get("HTTP_PROXY")
    https = get("HTTPS_PROXY") or http
    no_proxy = [e.strip().lower() for e in get("NO_PROXY").split(",") if e.strip()]
    return (Upstream.parse(http) if http else None, Upstream.parse(https) if https else None, no_proxy)


def _bypasses(host: str, no_proxy: list[str]) -> bool:
    host = host.lower()
    return any(e == "*" or host == e.lstrip(".") or host.endswith("." + e.lstrip(".").lstrip("*.")) for e in no_proxy)


# The proxy ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Allowed:
    pattern: str  # a host name or address, or "*.domain"
    ports: tuple[int, ...]

    def admits(self, host: str, port: int) -> bool:
        host = host.lower().rstrip(".")
        name = (host.endswith(self.pattern[1:]) and host != self.pattern[2:]) if self.pattern.startswith("*.") \
            else host == self.pattern
        return name and port in self.ports


def _allowed_entry(entry: str) -> _Allowed:
    """An allowed-host entry: "host", "*.domain", "host:port" or a URL (its host and port)."""
    text = entry.strip().lower()
    parts = urllib.parse.urlsplit(text if "://" in text else f"//{text}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not re.fullmatch(r"(\*\.)?[a-z0-9_.-]+|[0-9a-f:.]+", host):
        raise EgressError(f"allowed host {entry!r} is not a host name, '*.domain', 'host:port' or a URL")
    return _Allowed(host, (port,) if port else DEFAULT_PORTS)


class _Refused(Exception):
    def __init__(self, status: int, reason: str, body: str, headers: str = ""):
        super().__init__(body)
        self.status, self.reason, self.body, self.headers = status, reason, body, headers


class EgressProxy:
    """See the module docstring. `allowed_hosts`: entries "host", "*.domain", "host:port" or URLs (default: the
    package registries of this host, `registry_hosts()`); `log`: a callable given each request's record, or a path
    whose JSON lines receive them; `upstream`: the proxy URL to chain ("" for none; default: the host's
    HTTP_PROXY/HTTPS_PROXY/NO_PROXY)."""

    def __init__(self, allowed_hosts: Iterable[str] | None = None,
                 log: Callable[[dict], None] | str | Path | None = None, upstream: str | None = None,
                 bind: str = "127.0.0.1"):
        entries = list(registry_hosts() if allowed_hosts is None else allowed_hosts)
        self.allowed = [_allowed_entry(e) for e in entries]
        if upstream is None:
            self.upstream_http, self.upstream_connect, self.no_proxy = upstream_from_env()
        else:
            chained = Upstream.parse(upstream) if upstream else None
            self.upstream_http, self.upstream_connect, self.no_proxy = chained, chained, []
        self.bind = bind
        self._log_file = open(log, "a", buffering=1) if isinstance(log, (str, Path)) else None
        self._log_call = log if callable(log) else None
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}  # token -> episode
        self._asked: dict[str, list[tuple[str, int, bool]]] = {}
        self._listeners: list[tuple[socket.socket, str | None]] = []
        self._open: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self._address: tuple[str, int] | None = None

    # -- set-up ----------------------------------------------------------------------------------------------------
    def start(self) -> tuple[str, int]:
        """Listen on `bind` (an ephemeral port) for every episode's connections; returns (host, port)."""
        if self._address is None:
            sock = socket.create_server((self.bind, 0), backlog=256)
            self._address = sock.getsockname()[:2]
            self.serve(sock, None)
        return self._address

    def episode_url(self, episode: str) -> str:
        """The proxy URL for one episode on the shared listener (HTTP_PROXY and HTTPS_PROXY): its token as the user,
        which clients send as Proxy-Authorization."""
        host, port = self.start()
        token = "ep-" + secrets.token_hex(12)
        with self._lock:
            self._tokens[token] = episode
            self._asked.setdefault(episode, [])
        return f"http://{token}:x@{host}:{port}"

    def serve(self, listener: socket.socket, episode: str | None,
              local: Callable[[str, int], socket.socket | None] | None = None) -> None:
        """Accept connections on `listener` (bound and listening: TCP made inside an episode's network namespace,
        or a unix socket), every one of them the episode's (None: the shared listener, which reads the episode from
        the connection's credentials). `local(host, port)`: a connection to what the episode itself serves under
        that name (its loopback, the names its /etc/hosts gives its services), or None; such a request is the
        episode's own business, neither checked against the allowed hosts nor sent out of it, as a proxy inside
        a container would resolve it."""
        if episode is not None:
            with self._lock:
                self._asked.setdefault(episode, [])
        listener.settimeout(0.5)
        with self._lock:
            self._listeners.append((listener, episode))
        threading.Thread(target=self._accept, args=(listener, episode, local), name="egress-accept",
                         daemon=True).start()

    def asked(self, episode: str) -> list[tuple[str, int, bool]]:
        """Every (host, port, allowed) the episode asked for, in order."""
        with self._lock:
            return list(self._asked.get(episode, []))

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed.set()
        with self._lock:
            sockets = [s for s, _ in self._listeners] + list(self._open)
            self._listeners.clear()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # -- connections -----------------------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket, episode: str | None, local=None) -> None:
        while not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if not self._slots.acquire(timeout=IDLE_TIMEOUT_S):
                client.close()
                continue
            threading.Thread(target=self._handle, args=(client, episode, local), name="egress-conn",
                             daemon=True).start()

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.update(socks)

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def _handle(self, client: socket.socket, episode: str | None, local=None) -> None:
        upstream = None
        self._track(client)
        try:
            client.settimeout(IDLE_TIMEOUT_S)
            head, rest = _read_head(client)
            method, target, version, headers = _parse_head(head)
            if episode is None:
                episode = self._episode_of(headers)
            host, port, path = _destination(method, target, headers)
            try:
                own = local(host, port) if local is not None else None
            except OSError as e:
                raise _Refused(502, f"cannot reach {host}", f"megatron-composer egress: {host}:{port} is the "
                               f"episode's own, and nothing answers there: {e.strerror or e}\n") from None
            if own is not None:  # the episode's own service: reached in its network, as it would be without a proxy
                upstream = own
                if method == "CONNECT":
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                else:
                    _send_request(own, method, path, version, headers, host, port)
                self._track(upstream)
                if rest:
                    upstream.sendall(rest)
                _relay(client, upstream)
                return
            allowed = any(a.admits(host, port) for a in self.allowed)
            self._record(episode, method, host, port, allowed)
            if not allowed:
                raise _Refused(403, f"megatron-composer egress refuses {host}",
                               f"megatron-composer egress: {host}:{port} is not a host this episode may reach (it "
                               f"reaches the package registries of this host and the run's allowed hosts: "
                               f"{', '.join(a.pattern for a in self.allowed) or 'none'})\n")
            if method == "CONNECT":
                upstream, early = self._open_tunnel(host, port)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n" + early)
            else:
                upstream = self._open_forward(method, host, port, path, version, headers)
            self._track(upstream)
            if rest:
                upstream.sendall(rest)
            _relay(client, upstream)
        except _Refused as r:
            body = r.body.encode()
            with contextlib.suppress(OSError):
                client.sendall(f"HTTP/1.1 {r.status} {r.reason}\r\nContent-Type: text/plain\r\n"
                               f"Content-Length: {len(body)}\r\n{r.headers}Connection: close\r\n\r\n".encode() + body)
        except (OSError, ValueError):
            pass  # the client went away, or sent what is not HTTP
        finally:
            self._untrack(client, *([upstream] if upstream is not None else []))
            self._slots.release()

    def _episode_of(self, headers: dict[str, str]) -> str:
        """The episode whose token the connection's Proxy-Authorization carries."""
        credentials = headers.get("proxy-authorization", "")
        scheme, _, value = credentials.partition(" ")
        token = ""
        if scheme.lower() == "basic":
            with contextlib.suppress(binascii.Error, UnicodeDecodeError):
                token = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
        with self._lock:
            episode = self._tokens.get(token)
        if episode is None:
            raise _Refused(407, "Proxy Authentication Required",
                           "megatron-composer egress: use the episode's proxy URL (its token as the user)\n",
                           f'Proxy-Authenticate: Basic realm="{REALM}"\r\n')
        return episode

    def _record(self, episode: str, method: str, host: str, port: int, allowed: bool) -> None:
        record = {"time": round(time.time(), 3), "episode": episode, "method": method, "host": host, "port": port,
                  "allowed": allowed}
        with self._lock:
            self._asked.setdefault(episode, []).append((host, port, allowed))
            if self._log_file is not None:
                self._log_file.write(json.dumps(record) + "\n")
        if self._log_call is not None:
            self._log_call(record)

    def _connect(self, host: str, port: int) -> socket.socket:
        try:
            return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            raise _Refused(502, f"cannot reach {host}", f"megatron-composer egress: cannot reach {host}:{port}: "
                                                        f"{e.strerror or e}\n") from None

    def _open_tunnel(self, host: str, port: int) -> tuple[socket.socket, bytes]:
        """A connection to host:port (through the host's proxy where it has one) and what the far end already sent."""
        via = self.upstream_connect if not _bypasses(host, self.no_proxy) else None
        if via is None:
            return self._connect(host, port), b""
        sock = self._connect(via.host, via.port)
        auth = f"Proxy-Authorization: {via.authorization}\r\n" if via.authorization else ""
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}\r\n".encode())
        head, rest = _read_head(sock)
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        if not re.match(r"HTTP/1\.[01] 2\d\d", status):
            sock.close()
            raise _Refused(502, f"upstream proxy refused {host}",
                           f"megatron-composer egress: the host's proxy {via.host}:{via.port} answered "
                           f"{status!r} for {host}:{port}\n")
        return sock, rest

    def _open_forward(self, method: str, host: str, port: int, path: str, version: str,
                      headers: dict[str, str]) -> socket.socket:
        via = self.upstream_http if not _bypasses(host, self.no_proxy) else None
        if via is None:
            sock = self._connect(host, port)
            _send_request(sock, method, path, version, headers, host, port)
        else:
            sock = self._connect(via.host, via.port)
            _send_request(sock, method, f"http://{_authority(host, port, 80)}{path}", version, headers, host, port,
                          via.authorization)
        return sock


def _send_request(sock: socket.socket, method: str, target: str, version: str, headers: dict[str, str], host: str,
                  port: int, authorization: str | None = None) -> None:
    """A forwarded request's head: the client's headers without its proxy ones, one request per connection (the next
    one is checked anew), naming its Host."""
    kept = {k: v for k, v in headers.items() if k not in ("proxy-authorization", "proxy-connection", "connection",
                                                           "keep-alive")}
    if authorization:
        kept["proxy-authorization"] = authorization
    kept.setdefault("host", _authority(host, port, 80))
    kept["connection"] = "close"
    sock.sendall((f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept.items())
                  + "\r\n").encode("latin-1"))


def _authority(host: str, port: int, default: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == default else f"{shown}:{port}"


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The request or response head (up to the blank line) and what came after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            raise _Refused(431, "Request Header Fields Too Large", "megatron-composer egress: the head is too long\n")
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("the connection closed before the head ended")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Refused(400, "Bad Request", "megatron-composer egress: not an HTTP request\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return parts[0].upper(), parts[1], parts[2], headers


def _destination(method: str, target: str, headers: dict[str, str]) -> tuple[str, int, str]:
    """(host, port, path) a request asks for: CONNECT's authority, or a proxy request's absolute URL."""
    if method == "CONNECT":
        parts = urllib.parse.urlsplit(f"//{target}")
        if not parts.hostname or not parts.port:
            raise _Refused(400, "Bad Request", f"megatron-composer egress: CONNECT needs host:port, got {target!r}\n")
        return parts.hostname.lower(), parts.port, ""
    parts = urllib.parse.urlsplit(target)
    if parts.scheme != "http" or not parts.hostname:
        raise _Refused(400, "Bad Request", f"megatron-composer egress: a proxy request names an http:// URL, got "
                                           f"{target[:200]!r} (https goes through CONNECT)\n")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname.lower(), parts.port or 80, path


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until one side has closed and the other has finished, or nothing moves for
    IDLE_TIMEOUT_S."""
    sel = selectors.DefaultSelector()
    peers = {a: b, b: a}
    for s in peers:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_reads = 2
    try:
        while open_reads:
            ready = sel.select(timeout=IDLE_TIMEOUT_S)
            if not ready:
                return
            for key, _ in ready:
                src = key.fileobj
                try:
                    chunk = src.recv(65536)
                except BlockingIOError:
                    continue
                dst = peers[src]
                if not chunk:
                    sel.unregister(src)
                    open_reads -= 1
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    continue
                dst.setblocking(True)
                dst.settimeout(IDLE_TIMEOUT_S)
                try:
                    dst.sendall(chunk)
                finally:
                    dst.setblocking(False)
    except OSError:
        return
    finally:
        sel.close()
