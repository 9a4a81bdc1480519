"""Run one op on any backend with host arrays: for op tests and for users poking at a kernel.

Every binding of the op gets a host array (its initial contents); after the launch, every
binding is read back, so in-place ops (optimisers, accumulating GEMM) are checked the same way.
"""

from __future__ import annotations

import numpy as np

from actors.backend import Backend, run_program
from flow.program import Arena, Layout, Program, Tensor, align_up, launch
from shaders.registry import op as op_def

_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.int32): "int32",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.float16): "float16",
    np.dtype(np.uint8): "uint8",
}


def single_op_layout(bindings: dict[str, np.ndarray]) -> Layout:
    """A one-arena layout holding each array as a tensor named after its binding.

    Args:
        bindings: binding name -> array (only its shape and dtype are used).

    Returns:
        The layout.
    """
    tensors = []
    offset = 0
    for name, array in bindings.items():
        dtype = _DTYPES.get(array.dtype)
        if dtype is None:
            raise TypeError(f"binding {name!r}: unsupported dtype {array.dtype}")
        tensor = Tensor(name=name, shape=tuple(array.shape) or (1,), dtype=dtype, arena="main", offset=offset)
        tensors.append(tensor)
        offset = align_up(offset + max(tensor.nbytes, 4))
    return Layout(arenas=(Arena(name="main", nbytes=max(offset, 256)),), tensors=tuple(tensors))


def run_op(
    backend: Backend, op: str, bindings: dict[str, np.ndarray], **params: float
) -> dict[str, np.ndarray]:
    """Launch ``op`` once with host arrays bound by name.

    Args:
        backend: a fresh backend (its layout is replaced).
        op: registry name.
        bindings: one array per binding of the op, in any order; names as in the registry.
        **params: the op's parameters.

    Returns:
        Every binding read back after the launch.
    """
    definition = op_def(op)
    missing = [b for b in definition.bindings if b not in bindings]
    extra = [b for b in bindings if b not in definition.bindings]
    if missing or extra:
        raise ValueError(f"op {op!r} binds {definition.bindings}; missing {missing}, unknown {extra}")
    ordered = {name: np.ascontiguousarray(bindings[name]) for name in definition.bindings}
    backend.open_layout(single_op_layout(ordered))
    for name, array in ordered.items():
        backend.write(name, array)
    program = Program(name=op, steps=(launch(op, tuple(ordered), **params),))
    run_program(backend, program)
    return {name: backend.read(name).reshape(ordered[name].shape) for name in ordered}
