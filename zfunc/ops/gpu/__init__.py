"""GPU kernels as CuPy RawKernels: the package the CUDA optimizer and transfer kernels belong in.

It holds no kernel yet: on CUDA, steps use torch's fused multi-tensor optimizer kernels
(``zfunc.optim.kernels`` chooses them).
"""
