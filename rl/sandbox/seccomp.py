"""The seccomp filter every local sandbox command runs under (bubblewrap's --seccomp): system calls no task needs
and attacks on a sandbox's own harness use are refused with EPERM.

- ptrace: stopping, reading or rewriting another process of the sandbox (the verifier's shell, a checker);
- process_vm_readv / process_vm_writev: reading or writing another process's memory without ptrace;
- pidfd_getfd: copying another process's open descriptors (a status pipe, the script a shell is reading);
- kcmp: comparing other processes' descriptors and memory (a probe for the above);
- perf_event_open: sampling another process (its registers, its stack);
- prlimit64 with a pid (another process's limits: shrinking the verifier's shell's stack or files until it fails);
  a process's own limits (pid 0, what setrlimit and `ulimit` use) stay allowed.

The filter is classic BPF, built here by hand (no libseccomp needed): it checks the architecture (a call from
another ABI, such as 32-bit x86 code on x86_64 or the x32 ABI, is refused as a whole), then the call number.
Filters are inherited across fork and exec, so everything a command starts, `judge` and its nested sandbox
included, runs under it. Debuggers (gdb, strace) do not work in a sandbox.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# struct seccomp_data: nr at offset 0, arch at offset 4, args[0] at offset 16 (low word) and 20 (high word)
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ARG0_LO, _ARG0_HI = 16, 20
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_X32_BIT = 0x40000000

# (AUDIT_ARCH, {name: number}) per machine
ARCHES = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
                            "pidfd_getfd": 438, "perf_event_open": 298, "prlimit64": 302}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
                             "pidfd_getfd": 438, "perf_event_open": 241, "prlimit64": 261}),
}
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "perf_event_open")
DENIED_WITH_PID = ("prlimit64",)  # refused when their first argument (a pid) is not 0


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one) as bytes of struct sock_filter, or None where the machine's
    system call numbers are not known here (then commands run without it; docs/SANDBOX.md)."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    deny = _RET_ERRNO | errno.EPERM
    nrs = [numbers[name] for name in DENIED]
    pid_nrs = [numbers[name] for name in DENIED_WITH_PID]
    head = [_insn(_LD_W_ABS, 0, 0, 4),
            _insn(_JEQ_K, 1, 0, audit_arch),   # this architecture: go on
            _insn(_RET_K, 0, 0, deny),           # another ABI: refused whole
            _insn(_LD_W_ABS, 0, 0, 0)]
    # the tail: [allow, deny, check pid: load lo, lo == 0 ? (load hi, hi == 0 ? allow : deny) : deny]
    tail = [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, deny),
            _insn(_LD_W_ABS, 0, 0, _ARG0_LO), _insn(_JEQ_K, 0, 3, 0),
            _insn(_LD_W_ABS, 0, 0, _ARG0_HI), _insn(_JEQ_K, 0, 1, 0),
            _insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, deny)]
    checks = []
    if audit_arch == ARCHES["x86_64"][0]:
        checks.append(("x32", _X32_BIT))
    checks += [("deny", nr) for nr in nrs] + [("pid", nr) for nr in pid_nrs]
    body = []
    for i, (kind, k) in enumerate(checks):
        # a match jumps past the checks after this one to the tail's refusal (1) or its pid check (2)
        jump = len(checks) - i - 1 + (2 if kind == "pid" else 1)
        body.append(_insn(_JGE_K if kind == "x32" else _JEQ_K, jump, 0, k))
    return b"".join(head + body + tail)


def filter_fd() -> int | None:
    """A new descriptor (a memfd at offset 0) holding the filter, for bubblewrap's --seccomp FD; the caller passes
    it to the launched process and closes it. None where there is no filter for this machine."""
    prog = filter_program()
    if prog is None:
        return None
    fd = os.memfd_create("mc-seccomp", 0)  # not close-on-exec: bubblewrap reads it after exec
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
