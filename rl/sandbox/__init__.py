"""Isolated places to run model-written code: local bubblewrap sandboxes, container engines, a forking pool."""

from rl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from rl.sandbox.container import ApptainerSandbox, ContainerBackend, ContainerSandbox, make_container_backend
from rl.sandbox.local import LocalBackend, LocalSandbox, LocalSnapshot
from rl.sandbox.pool import SandboxPool

__all__ = ["ExecResult", "Sandbox", "SandboxError", "SandboxLimits", "LocalBackend", "LocalSandbox", "LocalSnapshot",
           "SandboxPool", "ContainerSandbox", "ContainerBackend", "ApptainerSandbox", "make_container_backend"]
