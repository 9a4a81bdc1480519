"""Programs as pure data: the memory layout a device needs and the ordered kernel launches it runs.

A plan produces these records; a backend (Vulkan or numpy) consumes them. Nothing here touches a
device, so every program can be printed, compared, serialised and tested before any GPU work.

Memory is described as *arenas* (large buffers) holding *tensors* at byte offsets. Arenas marked
``per_slot`` exist once per in-flight input slot (batches, labels, per-step values, loss), so the
device can keep several steps in flight without one step's input overwriting another's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# The element types a device tensor may hold (what the shaders read); a raw source file may hold
# more (flow.spec_data.SourceDType), and the loaders cast to these.
# uint8 only for datasets kept on the device as stored (shaders read them as 32-bit words).
TensorDType = Literal["float32", "int32", "uint32", "float16", "uint8"]

ITEM_BYTES: dict[str, int] = {"float32": 4, "int32": 4, "uint32": 4, "float16": 2, "uint8": 1}

# Descriptor offsets must honour minStorageBufferOffsetAlignment, which is at most 256 on every
# device we know of; aligning every tensor to it lets one layout serve all devices.
TENSOR_ALIGNMENT = 256

# What each slot's ``stepvals`` io tensor holds, in order. The engine writes them before every
# submit and the shaders read them, so per-step values never need a program re-recorded:
# the optimiser's learning rate, bias corrections and 1-based step count (train only), and the
# batch's real rows (every program: the loss kernels average over those and ignore the padding
# of a partial batch, so one program per kind serves every row count), and the rows the loss is
# averaged over: the same on one device; under data parallelism the whole global batch's, so each
# member's shard contributes its share of the mean and the all-reduce is a plain sum.
STEP_VALUES = ("lr", "one_minus_beta1_t", "one_minus_beta2_t", "t", "rows", "divisor")


def align_up(value: int, alignment: int = TENSOR_ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``.

    Args:
        value: a byte count or offset.
        alignment: a power of two.

    Returns:
        The smallest multiple of ``alignment`` that is >= ``value``.
    """
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Arena:
    """One large buffer. ``per_slot`` arenas get one copy per in-flight slot; ``host_visible``
    asks for memory the host can map (inputs and readback)."""

    name: str
    nbytes: int
    per_slot: bool = False
    host_visible: bool = False


@dataclass(frozen=True)
class Tensor:
    """A typed view into an arena at a byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: TensorDType
    arena: str
    offset: int

    @property
    def size(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.size * ITEM_BYTES[self.dtype]


@dataclass(frozen=True)
class Layout:
    """Every arena and tensor a device's programs use."""

    arenas: tuple[Arena, ...]
    tensors: tuple[Tensor, ...]
    _by_name: dict[str, Tensor] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def tensor(self, name: str) -> Tensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"layout has no tensor named {name!r}") from None

    def arena(self, name: str) -> Arena:
        for arena in self.arenas:
            if arena.name == name:
                return arena
        raise KeyError(f"layout has no arena named {name!r}")

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)


Param = tuple[str, int | float]


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the op (a shader family in the registry), the tensors bound to its
    bindings in order, its scalar parameters (sent as push constants), and, for ops tuned per
    device (GEMM tiles), the specialisation constants the plan resolved for the device
    (shaders.registry.resolve): empty until then."""

    op: str
    args: tuple[str, ...]
    params: tuple[Param, ...] = ()
    constants: tuple[tuple[str, int], ...] = ()

    def param(self, name: str) -> int | float:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"launch of {self.op!r} has no parameter {name!r}")

    @property
    def param_dict(self) -> dict[str, int | float]:
        return dict(self.params)


@dataclass(frozen=True)
class Barrier:
    """All launches before it finish their writes before any launch after it reads."""


Step = Launch | Barrier


@dataclass(frozen=True)
class Program:
    """An ordered list of launches and barriers, recorded once by a backend and replayed."""

    name: str
    steps: tuple[Step, ...]

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(s for s in self.steps if isinstance(s, Launch))


def launch(op: str, args: tuple[str, ...] | list[str], **params: int | float) -> Launch:
    """Build a Launch with its parameters in a canonical (sorted) order, so equal launches
    compare and serialise equal.

    Args:
        op: registry name of the op.
        args: tensor names bound to the op's bindings, in binding order.
        **params: scalar parameters.

    Returns:
        The launch record.
    """
    return Launch(op=op, args=tuple(args), params=tuple(sorted(params.items())))


def with_barriers(groups: list[list[Launch]]) -> tuple[Step, ...]:
    """Join groups of independent launches with one barrier between consecutive groups.

    Args:
        groups: launches in each group do not depend on each other.

    Returns:
        The steps, with a Barrier between non-empty groups.
    """
    steps: list[Step] = []
    for group in groups:
        if not group:
            continue
        if steps:
            steps.append(Barrier())
        steps.extend(group)
    return tuple(steps)
