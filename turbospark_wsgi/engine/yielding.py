"""Where the compute thread may give way: between two layers of a forward pass.

The engine has no gate of its own and runs straight through. The serving layer installs one
(compute.FrontDoor): while the request loop is answering a burst, the compute thread waits here
for a few milliseconds instead of taking the GIL and a core between every pair of kernels.

    yielding.install(gate)      # gate(): returns when the compute thread may go on
    yielding.point()            # in a layer loop: one global read when no gate is installed
"""
_gate = None


def install(gate):
    """Makes `gate` (a callable, or None for none) the process's gate; returns the previous one."""
    global _gate
    previous, _gate = _gate, gate
    return previous


def point():
    gate = _gate
    if gate is not None:
        gate()
