"""What a program's output says about the network it could not reach, and the hosts it asked for: curl and git
("Could not resolve host"), urllib3 and so requests, pip and huggingface_hub ("Failed to resolve 'h'",
"HTTPSConnectionPool(host='h'", "thrown while requesting HEAD https://h/..."), apt, wget, npm and go. Python's own
socket errors name no host: the last URL the output shows before the error is taken. One reading for an image's
build (rl/envs/task.py) and for a verdict (rl/envs/check_task.py).
"""

from __future__ import annotations

import re

_NETWORK_ERROR = re.compile(
    r"Could not resolve host|Temporary failure in name resolution|Name or service not known|"
    r"No address associated with hostname|Network is unreachable|NameResolutionError|Failed to resolve|"
    r"Temporary failure resolving|unable to resolve host address|getaddrinfo (?:ENOTFOUND|EAI_AGAIN)|"
    r"dial tcp: lookup|We couldn't connect to|Failed to establish a new connection|nodename nor servname|"
    r"Cannot connect to proxy|LocalEntryNotFoundError|OfflineModeIsEnabled|HF download failed|"
    r"megatron-composer egress refuses")
_NAMED_HOST = re.compile(
    r"Could not resolve host:?\s*['\"]?(?P<a>[\w.-]+)|Failed to resolve ['\"](?P<b>[\w.-]+)|"
    r"HTTPS?ConnectionPool\(host=['\"](?P<c>[\w.-]+)|couldn't connect to ['\"]?https?://(?P<d>[\w.-]+)|"
    r"Temporary failure resolving ['\"‘](?P<e>[\w.-]+)|unable to resolve host address ['\"‘](?P<f>[\w.-]+)|"
    r"getaddrinfo (?:ENOTFOUND|EAI_AGAIN) (?P<g>[\w.-]+)|dial tcp: lookup (?P<h>[\w.-]+)|"
    r"Failed to connect to (?P<i>[\w.-]+) port|"
    r"(?P<j>thrown while requesting \w+ https?://[\w.-]+)|"  # huggingface_hub
    r"': /simple/(?P<k>[\w.-]+)/|"  # pip's retries name the project, not its index
    r"megatron-composer egress refuses (?P<l>[\w.-]+)")  # the egress proxy's refusal (rl/sandbox/egress.py)
_URL_HOST = re.compile(r"\b(?:https?|ftp|git|ssh)://(?:[^@/\s'\"]+@)?([A-Za-z0-9][\w.-]*\.[A-Za-z]{2,})")
_LOCAL = ("localhost", "127.0.0.1", "0.0.0.0", "::1")
# uv's installer fails offline in a verifier and is not a failure there: every built image carries uv.
UV_INSTALLER = ("astral.sh",)
# Package registries: a verifier that installs its tools from them (`apt-get install -y curl`, which the image has)
# goes on when they cannot be reached, so their failures alone do not explain its zero.
PACKAGE_REGISTRIES = ("deb.debian.org", "security.debian.org", "archive.ubuntu.com", "security.ubuntu.com",
                      "ports.ubuntu.com", "pypi.org", "files.pythonhosted.org", "registry.npmjs.org")


def _host(match: re.Match) -> str:
    """The host a _NAMED_HOST match names."""
    if match.group("j"):
        return _URL_HOST.search(match.group("j")).group(1)
    if match.group("k"):
        return "pypi.org"  # pip's own index (a sandbox's pip has no other unless the task configures one)
    return next(g for g in match.groups() if g)


def network_failure(output: str, local: tuple[str, ...] = (), ignore: tuple[str, ...] = UV_INSTALLER) -> str | None:
    """'it asked for HOST' when `output` shows a failure to reach the network (a host beyond this sandbox and the
    `local` ones: the task's own services), naming the host; None when it shows none."""
    hosts = unreached_hosts(output, local, ignore)
    return f"it asked for {', '.join(hosts)}, beyond the sandbox's network" if hosts else None


def unreached_hosts(output: str, local: tuple[str, ...] = (), ignore: tuple[str, ...] = UV_INSTALLER) -> list[str]:
    """The hosts `output` shows a failure to reach, in order ("a host it does not name" where none is named),
    but the `local` ones (the task's own services) and those to `ignore`."""
    hosts = []
    for error in _NETWORK_ERROR.finditer(output):
        line_start = output.rfind("\n", 0, error.start()) + 1
        line_end = output.find("\n", error.end())
        line = output[line_start:line_end if line_end >= 0 else len(output)]
        named = _NAMED_HOST.search(line)
        host = _host(named) if named else None
        if host is None:  # Python's socket errors name no host: the last URL before the error
            urls = _URL_HOST.findall(output, 0, line_end if line_end >= 0 else len(output))
            host = urls[-1] if urls else None
        if host not in _LOCAL and host not in ignore and host not in local:
            hosts.append(host)
    found = [h for h in dict.fromkeys(hosts) if h is not None]
    if None in hosts and not found:  # errors that name no host: one the output names elsewhere, else none
        named = [_host(m) for m in _NAMED_HOST.finditer(output)]
        named = [h for h in named if h not in _LOCAL and h not in ignore and h not in local]
        found = named[-1:] or ["a host it does not name"]
    return found
