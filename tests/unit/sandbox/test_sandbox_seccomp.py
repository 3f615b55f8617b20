"""Every local sandbox command runs under the seccomp filter of rl/sandbox/seccomp.py: the program refuses exactly
the listed calls of its architecture and every call of another ABI (checked by running the BPF program here), and in
a sandbox, inside `judge` too, ptrace, pidfd_getfd and process_vm_readv fail with EPERM while ordinary work runs."""

import struct

import pytest

from rl.sandbox.local import LocalBackend, bwrap_problem
from rl.sandbox.seccomp import _RET_ALLOW, _RET_ERRNO, _X32_BIT, ARCHES, DENIED, DENIED_WITH_PID, filter_program

EPERM = _RET_ERRNO | 1


def run_bpf(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """The classic BPF the filter uses (load word, jump if equal / greater or equal, return), run on one call
    (struct seccomp_data: nr, arch, instruction pointer, args)."""
    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code in (0x15, 0x35):
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_filter_refuses_exactly_the_listed_calls_and_other_abis(machine):
    audit_arch, numbers = ARCHES[machine]
    prog = filter_program(machine)
    denied = {numbers[name] for name in DENIED}
    for nr in range(512):
        assert run_bpf(prog, nr, audit_arch) == (EPERM if nr in denied else _RET_ALLOW), nr
        # another process's limits (any pid, 32-bit or not) are refused; a process's own (pid 0) are not
        with_pid = nr in {numbers[name] for name in DENIED_WITH_PID}
        for pid in (1, 1 << 32, 12345):
            assert run_bpf(prog, nr, audit_arch, pid) == (EPERM if nr in denied or with_pid else _RET_ALLOW), (nr, pid)
    assert run_bpf(prog, 0, 0x40000003) == EPERM  # i386 code on x86_64, say: refused whole
    if machine == "x86_64":
        assert run_bpf(prog, _X32_BIT | 0, audit_arch) == EPERM  # the x32 ABI's read()
    assert filter_program("sparc") is None


PROBE = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
child = os.fork()
if child == 0:
    time.sleep(5)
    os._exit(0)
def errno_of(ret):
    return "ok" if ret >= 0 else os.strerror(ctypes.get_errno())
out = {"ptrace": errno_of(libc.ptrace(16, child, 0, 0))}  # PTRACE_ATTACH
pidfd = libc.syscall(434, child, 0)  # pidfd_open (allowed) then pidfd_getfd of its pipe (refused)
out["pidfd_getfd"] = errno_of(libc.syscall(438, pidfd, w, 0))
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(buf), 8), iovec(ctypes.addressof(buf), 8)
out["process_vm_readv"] = errno_of(libc.process_vm_readv(child, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
os.kill(child, 9)
print(sorted(out.items()))
"""
REFUSED = str(sorted({"ptrace": "Operation not permitted", "pidfd_getfd": "Operation not permitted",
                      "process_vm_readv": "Operation not permitted"}.items()))


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_a_sandbox_and_its_judge_cannot_ptrace_copy_descriptors_or_read_memory(sandbox_parent):
    if filter_program() is None:
        pytest.skip("no seccomp filter for this machine's architecture")
    with LocalBackend(root_parent=str(sandbox_parent)).create(None) as sbx:
        sbx.write_file("/app/probe.py", PROBE.encode())
        res = sbx.exec("python3 /app/probe.py")
        assert res.exit_code == 0 and res.output.strip() == REFUSED, res.output
        assert sbx.exec("echo ok | cat && (sleep 0.1 &) && wait").output.strip() == "ok"  # ordinary work runs
        sbx.enter_verifier()
        res = sbx.exec("/opt/verifier/bin/judge python3 /app/probe.py")
        if res.exit_code == 125:
            pytest.skip("judge cannot nest a sandbox on this host")
        assert res.exit_code == 0 and res.output.strip() == REFUSED, res.output
