"""The actor half of a run's plan: which actor runs each pipeline node, where, with which inbox
and outboxes, the bounded channels between them, and whether the loader reads training batches
straight into the device's input slots. Pure: the runtime opens what this says and decides nothing.

Each node takes at most one inbound edge: trio has no select, so fan-in would need a forwarding
task per input, and the stream's order, which exact resume relies on, would be lost. Fan-out is
explicit (a node with several outboxes sends each item to all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flow.errors import PlanError, Problem
from flow.graph import label_shape
from flow.spec import Pipeline, Spec, default_pipeline

# The kinds a pipeline must have exactly one of (the runtime drives one loader, device and sink).
SINGLE_KINDS = ("loader", "device", "sink")
# Kinds that hand a batch on unchanged (a preprocess node with no transforms does nothing).
PASS_THROUGH = ("preprocess", "broadcast")


@dataclass(frozen=True)
class ActorPlan:
    """One pipeline node's actor.

    Attributes:
        name: the node's name.
        kind: its kind (loader, preprocess, device, optimiser, sink, broadcast).
        device: the device index it runs on (device nodes); None elsewhere.
        workers: reads or transforms in flight at once.
        inbox: the node its one inbound edge comes from; None for the loader.
        outboxes: the nodes its outbound edges go to, in the pipeline's order.
    """

    name: str
    kind: str
    device: int | None
    workers: int
    inbox: str | None
    outboxes: tuple[str, ...]


@dataclass(frozen=True)
class PipelinePlan:
    """The run's actors and channels.

    Attributes:
        actors: one per pipeline node, in the pipeline's order.
        channels: (src, dst, capacity) of every edge; capacities count messages.
        in_place: the loader reads training batches straight into the device's input slots.
    """

    actors: tuple[ActorPlan, ...]
    channels: tuple[tuple[str, str, int], ...]
    in_place: bool

    def actor(self, kind: str) -> ActorPlan:
        """The actor of a kind there is exactly one of (see SINGLE_KINDS)."""
        return next(a for a in self.actors if a.kind == kind)

    def as_dict(self) -> dict:
        return {
            "actors": [
                {
                    "name": a.name,
                    "kind": a.kind,
                    "device": a.device,
                    "workers": a.workers,
                    "inbox": a.inbox,
                    "outboxes": list(a.outboxes),
                }
                for a in self.actors
            ],
            "channels": [list(c) for c in self.channels],
            "in_place": self.in_place,
        }


def _wiring_problems(pipeline: Pipeline) -> list[Problem]:
    problems = []
    for kind in SINGLE_KINDS:
        count = sum(node.kind == kind for node in pipeline.nodes)
        if count != 1:
            message = f"the pipeline needs exactly one {kind} node, it has {count}"
            problems.append(Problem("pipeline.nodes", message))
    inbound: dict[str, list[str]] = {node.name: [] for node in pipeline.nodes}
    for edge in pipeline.edges:
        inbound.setdefault(edge.dst, []).append(edge.src)
    for name, sources in inbound.items():
        if len(sources) > 1:
            problems.append(
                Problem(
                    "pipeline.edges",
                    f"node {name!r} has {len(sources)} inbound edges ({', '.join(sources)}); the runtime "
                    "keeps one ordered stream, so each node takes at most one",
                )
            )
    return problems


def _reads_in_place(
    spec: Spec,
    pipeline: Pipeline,
    outboxes: dict[str, tuple[str, ...]],
    reads_in_place: bool,
    maps_inputs: bool,
) -> bool:
    """Whether the loader may read training batches straight into the device's input slots: when
    the source can (``read_into``) and the device maps its slots, nothing between the two changes a
    batch (no transforms; pass-through nodes only, no fan-out: a batch in a slot has one consumer,
    the device, which then only submits it), and each row's label is one element of the slot's
    flat labels (one class id or one target)."""
    model, data = spec.model, spec.data
    if not (reads_in_place and maps_inputs) or data.preprocess or data.augment:
        return False
    shape, _ = label_shape(model, data.batch_size)
    if math.prod(shape) != data.batch_size:
        return False
    kinds = {node.name: node.kind for node in pipeline.nodes}
    name = next(node.name for node in pipeline.nodes if node.kind == "loader")
    while kinds[name] != "device":
        if len(outboxes[name]) != 1:
            return False
        name = outboxes[name][0]
        if kinds[name] not in (*PASS_THROUGH, "device"):
            return False
    return True


def plan_pipeline(
    spec: Spec,
    *,
    mode: str = "train",
    sample_shape: tuple[int, ...] | None = None,
    reads_in_place: bool = False,
    maps_inputs: bool = False,
) -> PipelinePlan:
    """The actors and channels of ``spec``'s pipeline (its own, or the default one).

    Args:
        spec: a valid spec.
        mode: "train" or "predict" (predicting reads nothing: the caller feeds the loader's edge).
        sample_shape: the shape the source emits (None: unknown, so nothing is read in place).
        reads_in_place: the source can read straight into caller-owned arrays.
        maps_inputs: the device maps its input slots into host memory.

    Returns:
        The pipeline plan.

    Raises:
        PlanError: every wiring mistake at once (not exactly one loader, device or sink; a node
            with more than one inbound edge).
    """
    pipeline = spec.pipeline or default_pipeline(spec)
    problems = _wiring_problems(pipeline)
    if problems:
        raise PlanError(problems)
    inbox: dict[str, str] = {}
    outboxes: dict[str, tuple[str, ...]] = {node.name: () for node in pipeline.nodes}
    for edge in pipeline.edges:
        inbox[edge.dst] = edge.src
        outboxes[edge.src] += (edge.dst,)
    in_place = (
        mode == "train"
        and sample_shape == tuple(spec.model.input_shape)
        and _reads_in_place(spec, pipeline, outboxes, reads_in_place, maps_inputs)
    )
    actors = tuple(
        ActorPlan(
            node.name,
            node.kind,
            (node.device or 0) if node.kind == "device" else None,
            node.workers,
            inbox.get(node.name),
            outboxes[node.name],
        )
        for node in pipeline.nodes
    )
    channels = tuple((e.src, e.dst, e.capacity) for e in pipeline.edges)
    return PipelinePlan(actors, channels, in_place)
