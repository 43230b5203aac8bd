"""The CPU kernels, one module per concern: C (`native.c`, built and called by `native`) and the same
steps for numba (the rest), which run where no C compiler works:

- `isa`: which integer-dot instructions this CPU has, and the path the int8 kernels take;
- `int8_dot`: the integer dot of one weight unit, one code generator per instruction set side by side;
- `int8`: products with int8 activations (quantize each row per block of 32, exact integer dots);
- `attention`: causal attention over the KV caches, each K/V row read once per KV head;
- `cpu`: products with float32 activations, the BLAS path for long prompts, and `QLinear`,
  the quantized weight a model multiplies by (`x @ w`), with its KernelPlan's kernels;
- `layer`: a whole transformer layer as one call (int8 activations);
- `threads`: how many threads the calling thread's kernels use;
- `native`: building `native.c` per instruction path and calling it;
- `warm`: compiling the numba kernels before the first request, once per machine.
"""
