"""Isolated places to run model-written code: local bubblewrap sandboxes, container engines, a forking pool."""

from rl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from rl.sandbox.local import LocalBackend, LocalSandbox, LocalSnapshot

__all__ = ["ExecResult", "Sandbox", "SandboxError", "SandboxLimits", "LocalBackend", "LocalSandbox", "LocalSnapshot"]
