"""The egress proxy (rl/sandbox/egress.py): an episode reaches the allowed hosts through it (plain HTTP forwarded,
CONNECT tunnelled), every other host is refused with a 403 naming it, every host each episode asked for is logged,
many episodes share one proxy, and the host's own proxy is chained. Against servers on this machine only."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl.sandbox.egress import (
    EgressError,
    EgressProxy,
    PackageSources,
    apt_sources,
    npm_sources,
    pip_sources,
    upstream_from_env,
)


class Echo(BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"upstream saw {self.command} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def fetch(proxy_url: str, url: str, data: bytes | None = None) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy_url}))
    with opener.open(url, data=data, timeout=30) as response:
        return response.read().decode()


def raw(address, request: bytes) -> bytes:
    """Send `request` to the proxy on a TCP (host, port) or unix socket path; everything it answers."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(30)
        s.connect(address)
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def basic(url: str) -> str:
    user = url.split("//", 1)[1].split("@", 1)[0]
    return "Basic " + base64.b64encode(user.encode()).decode()


def test_an_episode_reaches_allowed_hosts_and_is_refused_the_rest_by_name(server, tmp_path):
    log = tmp_path / "egress.jsonl"
    with EgressProxy(allowed_hosts=[f"localhost:{server}"], log=log, upstream="") as proxy:
        url = proxy.episode_url("episode-1")
        assert fetch(url, f"http://localhost:{server}/simple/pytest/?x=1") == "upstream saw GET /simple/pytest/?x=1"
        assert fetch(url, f"http://localhost:{server}/upload", data=b"a body") == "a body"
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(url, f"http://127.0.0.1:{server}/")
        assert refused.value.code == 403 and refused.value.reason == "megatron-composer egress refuses 127.0.0.1"
        assert f"127.0.0.1:{server} is not a host this episode may reach" in refused.value.read().decode()
        # CONNECT: a tunnel to the allowed host (any protocol over it: here plain HTTP), refused elsewhere
        host, port = proxy.start()
        auth = f"Proxy-Authorization: {basic(url)}\r\n".encode()
        tunnel = raw((host, port), b"CONNECT localhost:%d HTTP/1.1\r\n" % server + auth + b"\r\n"
                     b"GET /tunnelled HTTP/1.0\r\nHost: localhost\r\n\r\n")
        assert tunnel.startswith(b"HTTP/1.1 200 Connection established") and tunnel.endswith(b"GET /tunnelled")
        denied = raw((host, port), b"CONNECT example.com:443 HTTP/1.1\r\n" + auth + b"\r\n")
        assert denied.startswith(b"HTTP/1.1 403 megatron-composer egress refuses example.com"), denied
        assert proxy.asked("episode-1") == [("localhost", server, True)] * 2 + [("127.0.0.1", server, False),
                                                                                ("localhost", server, True),
                                                                                ("example.com", 443, False)]
        # a connection that names no episode is asked for its credentials, and reaches nothing
        anonymous = raw((host, port), b"GET http://localhost:%d/ HTTP/1.1\r\n\r\n" % server)
        assert anonymous.startswith(b"HTTP/1.1 407") and b'Proxy-Authenticate: Basic realm=' in anonymous
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["episode"], r["host"], r["allowed"]) for r in records][-1] == ("episode-1", "example.com", False)
    assert len(records) == 5


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl here")
def test_curl_sends_the_episode_token_and_says_the_refusal(server):
    with EgressProxy(allowed_hosts=[f"localhost:{server}"], upstream="") as proxy:
        url = proxy.episode_url("curl-episode")
        ok = subprocess.run(["curl", "-sS", "-x", url, f"http://localhost:{server}/c"], capture_output=True,
                            text=True, timeout=60)
        assert ok.stdout == "upstream saw GET /c", ok.stderr
        refused = subprocess.run(["curl", "-sS", "-x", url, "http://example.com/"], capture_output=True, text=True,
                                 timeout=60)
        assert "example.com:80 is not a host this episode may reach" in refused.stdout
        assert proxy.asked("curl-episode") == [("localhost", server, True), ("example.com", 80, False)]


def test_many_episodes_share_one_proxy_each_logged_apart(server, tmp_path):
    """Episodes on the shared listener (their tokens) and on listeners of their own (a unix socket, as a sandbox
    would have bound into the episode), at once."""
    with EgressProxy(allowed_hosts=[f"localhost:{server}"], upstream="") as proxy:
        urls = {f"ep{i}": proxy.episode_url(f"ep{i}") for i in range(12)}
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(tmp_path / "egress.sock"))
        unix.listen()
        proxy.serve(unix, "ep-unix")
        errors = []

        def episode(name: str) -> None:
            try:
                for k in range(3):
                    if name == "ep-unix":
                        got = raw(str(tmp_path / "egress.sock"),
                                  b"GET http://localhost:%d/%s/%d HTTP/1.1\r\n\r\n" % (server, name.encode(), k))
                        assert got.endswith(f"upstream saw GET /{name}/{k}".encode()), got
                    else:
                        assert fetch(urls[name], f"http://localhost:{server}/{name}/{k}").endswith(f"/{name}/{k}")
            except Exception as e:  # reported below, from the test's thread
                errors.append(f"{name}: {e!r}")

        threads = [threading.Thread(target=episode, args=(n,)) for n in [*urls, "ep-unix"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for name in [*urls, "ep-unix"]:
            assert proxy.asked(name) == [("localhost", server, True)] * 3, name


def test_the_hosts_own_proxy_is_chained(server):
    """An upstream proxy (the host's HTTP(S)_PROXY; here another EgressProxy, whose credentials the chained one
    passes on) carries both the forwarded requests and the tunnels."""
    with EgressProxy(allowed_hosts=[f"localhost:{server}"], upstream="") as hosts_proxy:
        upstream = hosts_proxy.episode_url("the host's own proxy")
        with EgressProxy(allowed_hosts=[f"localhost:{server}"], upstream=upstream) as proxy:
            url = proxy.episode_url("chained")
            assert fetch(url, f"http://localhost:{server}/via") == "upstream saw GET /via"
            tunnel = raw(proxy.start(), b"CONNECT localhost:%d HTTP/1.1\r\nProxy-Authorization: %s\r\n\r\n"
                         b"GET /via-tunnel HTTP/1.0\r\n\r\n" % (server, basic(url).encode()))
            assert tunnel.endswith(b"upstream saw GET /via-tunnel"), tunnel
        assert hosts_proxy.asked("the host's own proxy") == [("localhost", server, True)] * 2
    http, connect, no_proxy = upstream_from_env({"http_proxy": "http://u:p%40ss@proxy.corp:3128",
                                                 "NO_PROXY": "localhost,.internal"})
    assert (connect.host, connect.port, http.authorization) == ("proxy.corp", 3128,
                                                                "Basic " + base64.b64encode(b"u:p@ss").decode())
    assert no_proxy == ["localhost", ".internal"]
    with pytest.raises(EgressError, match="only an http:// proxy can be chained"):
        upstream_from_env({"HTTPS_PROXY": "socks5://proxy.corp:1080"})


def test_the_default_allowed_hosts_are_this_hosts_package_registries(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("PIP_CONFIG_FILE", raising=False)
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = https://mirror.corp:8443/pypi/simple\nfind-links = /opt/wheels\n")
    env = {"PIP_EXTRA_INDEX_URL": "https://extra.corp/simple file:///opt/local/simple"}
    pip = pip_sources(env)
    assert pip[:2] == ["https://mirror.corp:8443/pypi/simple", "https://extra.corp/simple"] and "/opt/wheels" in pip
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text("deb [arch=amd64] http://archive.ubuntu.com/ubuntu jammy main # a comment\n")
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: https://off.example.org/x\nEnabled: no\n")
    (apt / "sources.list.d" / "old.list.disabled").write_text("deb http://disabled.example.org/x stable main\n")
    assert apt_sources(apt) == ["http://archive.ubuntu.com/ubuntu", "http://deb.debian.org/debian"]
    (tmp_path / ".npmrc").write_text("registry=https://npm.corp/\n@acme:registry=https://npm.acme.io/\n")
    npm = npm_sources({})
    assert npm[:2] == ["https://npm.corp/", "https://npm.acme.io/"]
    hosts = PackageSources(["https://pypi.org/simple", *pip], apt_sources(apt), npm).hosts()
    assert hosts[:5] == ["pypi.org", "files.pythonhosted.org", "mirror.corp:8443", "extra.corp",
                         "archive.ubuntu.com"], hosts
    assert "npm.acme.io" in hosts and not any("opt" in h or "disabled" in h or "off." in h for h in hosts)
    with pytest.raises(EgressError, match="is not a host name"):
        EgressProxy(allowed_hosts=["http://"], upstream="")
