"""The agent's network as a task declares it (#59): "none" is loopback only; "public" reaches, through the run's
egress proxy on the episode's loopback (HTTP(S)_PROXY), the hosts the proxy allows and nothing else, each host asked
for logged as the episode's. The verifier's network is its own setting. A solve-time `pip install` from an index
works where the task has the network."""

from __future__ import annotations

import hashlib
import http.server
import io
import socket
import threading
import zipfile

import pytest

from rl.sandbox.egress import EgressProxy
from rl.sandbox.local import EGRESS_PORT, LocalSandbox, bwrap_problem

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


def _wheel(name: str, version: str) -> bytes:
    """A pure-Python wheel of one module, `name`, whose `VALUE` is 42."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return out.getvalue()


@pytest.fixture
def index():
    """A package index (PEP 503) with one wheel, on this host, named by the host's name (not localhost: clients send
    loopback names past a proxy)."""
    wheel = _wheel("mc_demo_pkg", "1.0")
    filename = "mc_demo_pkg-1.0-py3-none-any.whl"
    digest = hashlib.sha256(wheel).hexdigest()

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.rstrip("/") in ("/simple/mc-demo-pkg", "/simple/mc_demo_pkg"):
                body = f'<a href="/files/{filename}#sha256={digest}">{filename}</a>'.encode()
            elif self.path == f"/files/{filename}":
                body = wheel
            elif self.path == "/hello":
                body = b"hello from the host"
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html" if self.path.startswith("/simple") else "application/zip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = socket.gethostname()
    try:
        socket.gethostbyname(host)
    except OSError:
        server.shutdown()
        pytest.skip(f"this host's name {host} does not resolve here")
    yield host, server.server_address[1]
    server.shutdown()


FETCH = ("python3 -c 'import sys, urllib.request as u\ntry:\n    print(u.urlopen(sys.argv[1], timeout=10).read()"
         ".decode())\nexcept Exception as e:\n    print(\"refused:\", e)' ")


def test_public_reaches_what_the_proxy_allows_and_none_reaches_nothing(index, sandbox_parent):
    host, port = index
    with EgressProxy(allowed_hosts=[f"{host}:{port}"], upstream="") as proxy:
        with LocalSandbox(None, network="public", egress=proxy, root_parent=str(sandbox_parent)) as sbx:
            res = sbx.exec(FETCH + f"http://{host}:{port}/hello; " + FETCH + "http://example.com/")
            lines = res.output.splitlines()
            assert lines[0] == "hello from the host", res.output
            assert lines[1].startswith("refused:") and "403" in lines[1], res.output
            asked = proxy.asked(f"{sbx.root.name}:agent")
            assert (host, port, True) in asked and ("example.com", 80, False) in asked
            sbx.enter_verifier()  # the verifier's network is its own setting: none here
            res = sbx.exec(f"echo ${{HTTP_PROXY:-unset}}; {FETCH}http://{host}:{port}/hello")
            assert res.output.splitlines()[0] == "unset" and res.output.splitlines()[1].startswith("refused:")
            sbx.enter_verifier(network="public")
            assert sbx.exec(FETCH + f"http://{host}:{port}/hello").output.strip() == "hello from the host"
        with LocalSandbox(None, egress=proxy, root_parent=str(sandbox_parent)) as sbx:  # network "none"
            res = sbx.exec(f"echo ${{HTTPS_PROXY:-unset}}; HTTP_PROXY=http://127.0.0.1:{EGRESS_PORT} "
                           f"{FETCH}http://{host}:{port}/hello")
            assert res.output.splitlines()[0] == "unset" and res.output.splitlines()[1].startswith("refused:")


def test_a_solve_time_pip_install_works_with_the_network(index, sandbox_parent):
    """`pip install` while the agent works (common in Terminal-Bench solutions) installs from the index the task's
    network reaches, into the agent's own site (it is not root), which the agent's Python then imports."""
    host, port = index
    pip = (f"python3 -m pip install --user --break-system-packages --no-cache-dir --disable-pip-version-check -q "
           f"--index-url http://{host}:{port}/simple --trusted-host {host} mc-demo-pkg && "
           "python3 -c 'import mc_demo_pkg; print(mc_demo_pkg.VALUE)'")
    with EgressProxy(allowed_hosts=[f"{host}:{port}"], upstream="") as proxy:
        with LocalSandbox(None, network="public", egress=proxy, root_parent=str(sandbox_parent)) as sbx:
            res = sbx.exec(pip, env={"PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}, timeout=120)
            assert res.ok and res.output.strip().endswith("42"), res.output
        with LocalSandbox(None, egress=proxy, root_parent=str(sandbox_parent)) as sbx:
            res = sbx.exec(pip, env={"PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}, timeout=120)
            assert not res.ok, res.output
