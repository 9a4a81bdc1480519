"""Mixed precision's float16 weight copies, kept beside the fp32 masters (issue 18): decisions only.

A mixed plan's GEMMs read each dense weight ``w`` as its float16 copy ``half:<w>``. Where the plan
keeps the copies (:func:`keeps_copies`), they are views of one persistent arena, HALVES, that
mirrors the flat parameter arena: the copy of the float at index i is the half at index i. The
optimiser's update then writes each parameter's copy in the same pass as the parameter (the
``_half`` update kernels), so a train step starts with no casts, and every other program reads the
copies the last update left. Whatever else writes the masters (fresh weights, a checkpoint, weights
imported or copied from a data-parallel leader) refreshes the copies from them on the host with
numpy's ``astype(float16)``, which cast.comp and the update kernels match bit for bit
(actors.engine.Engine.refresh_copies). A plan that keeps none casts each copy at the start of every
program (flow.autodiff._prepend_weight_casts).
"""

from __future__ import annotations

from collections.abc import Mapping

from flow.device_facts import DeviceFacts
from flow.graph import TensorDecl
from flow.optim import HALVES
from flow.program import TENSOR_ALIGNMENT, Arena, Tensor, align_up

# False: every mixed plan casts its weights at the start of each program, as before issue 18's
# optimiser copies (a module constant so that bench/ab_mixed_copies.py can time both in one process).
OPTIMISER_COPIES = True
# A copy sits at half its master's byte offset, and masters sit at TENSOR_ALIGNMENT: a device that
# needs a coarser descriptor offset than this casts its copies instead.
_COPY_ALIGNMENT = TENSOR_ALIGNMENT // 2
_PREFIX = "half:"


def keeps_copies(precision: str, facts: DeviceFacts | None) -> bool:
    """Whether a plan keeps its weights' float16 copies in HALVES, written by the update.

    Args:
        precision: RunSettings.precision.
        facts: the device, when known (its descriptor offset alignment must allow the copies' offsets).

    Returns:
        True for mixed precision where the copies can be bound in place.
    """
    aligned = facts is None or facts.min_storage_offset_alignment <= _COPY_ALIGNMENT
    return precision == "mixed" and OPTIMISER_COPIES and aligned


def copy_tensors(
    declared: Mapping[str, TensorDecl], param_offsets: Mapping[str, int], total_params: int
) -> tuple[list[Tensor], list[Arena]]:
    """The HALVES arena and its tensors for the copies the programs declare (role "halves").

    Args:
        declared: every program's tensor declarations.
        param_offsets: each parameter's byte offset in the flat parameter arena.
        total_params: floats in that arena (a multiple of 64).

    Returns:
        (HALVES and each ``half:<w>`` at its master's float index, [the arena]); ([], []) when no
        program reads a kept copy.
    """
    copies = sorted(name for name, decl in declared.items() if decl.role == "halves")
    if not copies:
        return [], []
    tensors = [Tensor(HALVES, (total_params,), "float16", "halves", 0)]
    for name in copies:
        master = name[len(_PREFIX) :]
        tensors.append(Tensor(name, declared[name].shape, "float16", "halves", param_offsets[master] // 2))
    return tensors, [Arena("halves", align_up(total_params * 2))]
