"""The device engine's own kernels: quantized matrix products that read GGUF blocks (Q4_0, Q4_1,
Q8_0, Q4_K, Q6_K) where they lie on the device, and a decode row's attention over the device KV
cache.

Why CUDA C++ for CuPy's RawModule (kernels.cu), and not numba.cuda under its simulator:

* On a GPU it needs nothing CuPy does not already need. CuPy compiles its own elementwise and
  reduction kernels with NVRTC, so wherever CuPy works a RawModule compiles too. numba.cuda would
  add numba's CUDA target, the CUDA Python bindings and libNVVM to the device, none of which a
  CuPy wheel brings.
* On a CPU the very same source runs. kernels.cu is written so that a host C++ compiler can build
  it: a thread block's threads run one after the other inside each `PHASE` (a barrier on the
  device), and threads share data only through the block's shared arrays across those barriers,
  which is exactly what that order models. So the tests run the kernel code itself, indexing and
  all, not a numpy copy of it that could drift; the launch loop is the only host-only code (a few
  lines). `nvcc`, where installed, also compiles the source for the device in the tests.
* The simulator would run numba's Python kernels one Python thread per CUDA thread: minutes for
  the shapes of a small model's forward pass, where the host build runs `tools/gpu_check.py
  --device cpu` end to end in seconds.

launch.py builds and launches the kernels (`device_kernels()` on a GPU, `host_kernels()` on the
CPU), weights.py keeps a GGUF's matrices in block form, model.py runs the transformer on them.
It has run on one GPU (an H200): docs/gpu.md has what it measured.
"""
