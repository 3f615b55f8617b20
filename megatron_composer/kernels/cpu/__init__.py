"""C++ CPU kernels: the sources (csrc/), their loader (cpp.py: compiled on first use, None where they cannot be
built) and the autograd Functions that wrap them (rms_norm.py, rope.py, grouped_mm.py).

Only the device-neutral entry points in megatron_composer/kernels/<name>.py import this package: they pick a
kernel here on the CPU and torch's own path (SDPA, torch._grouped_mm, the reference beside the entry point)
elsewhere. The model, parallelism and inference rooms call those entry points (inference's CPU row kernels
for the head excepted: the engine asks cpp.load("decode") for them and falls back to torch's ops).
"""
