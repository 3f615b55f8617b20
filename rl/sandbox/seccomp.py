"""The seccomp filter every local sandbox command runs under (bubblewrap's --seccomp): system calls no task needs
and attacks on a sandbox's own harness use are refused with EPERM.

- ptrace: stopping, reading or rewriting another process of the sandbox (the verifier's shell, a checker);
- process_vm_readv / process_vm_writev: reading or writing another process's memory without ptrace;
- pidfd_getfd: copying another process's open descriptors (a status pipe, the script a shell is reading);
- kcmp: comparing other processes' descriptors and memory (a probe for the above).

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

# struct seccomp_data: nr at offset 0, arch at offset 4
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_X32_BIT = 0x40000000

# (AUDIT_ARCH, {name: number}) per machine
ARCHES = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
                            "pidfd_getfd": 438}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
                             "pidfd_getfd": 438}),
}
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd")


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
    prog = [_insn(_LD_W_ABS, 0, 0, 4),
            _insn(_JEQ_K, 1, 0, audit_arch),   # this architecture: go on
            _insn(_RET_K, 0, 0, deny),           # another ABI: refused whole
            _insn(_LD_W_ABS, 0, 0, 0)]
    if audit_arch == ARCHES["x86_64"][0]:
        prog.append(_insn(_JGE_K, len(nrs) + 1, 0, _X32_BIT))  # x32 calls: to the refusal at the end
    for i, nr in enumerate(nrs):
        prog.append(_insn(_JEQ_K, len(nrs) - i, 0, nr))  # to the refusal at the end
    prog += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, deny)]
    return b"".join(prog)


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
