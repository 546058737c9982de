"""The engine's hot-path operators: Triton kernels for CUDA, plain torch references for CPU.

Callers use `sluice.kernels.ops`, which picks the implementation from one backend setting.
"""
