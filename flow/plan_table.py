"""A plan as text for people: the data (splits, batches, schedule), the actors and channels, and for
each device memory per arena, tensors with their placement, and each program's launches with the
barriers between them."""

from __future__ import annotations

from flow.planning import Plan
from flow.program import Barrier
from flow.stage_plan import StagePlan


def stage_lines(stages: StagePlan) -> list[str]:
    """A model split over devices: each stage's layers and device, the micro-batches and the
    1F1B order each stage runs them in (F3: micro-batch 3's forward, B3 its backward)."""
    lines = [
        f"model split into {len(stages.members)} pipeline stages ({stages.placement} placement): "
        f"{stages.micro_batches} micro-batch(es) of up to {stages.micro_rows} rows a batch of "
        f"{stages.batch}, activations forward and gradients back through the host (credit edges), "
        "one update a batch"
        + (" (its gradient norm joined over the stages on the host)" if stages.global_norm else "")
    ]
    orders = stages.as_dict()["schedule"]
    for s, (name, (start, stop)) in enumerate(zip(stages.members, stages.layers, strict=True)):
        lines.append(
            f"  stage {s} on {name}: layers[{start}:{stop}], {stages.slots[s]} micro-batch(es) in flight; "
            f"{orders[s]}" + (f"; {stages.precisions[s]} precision" if "mixed" in stages.precisions else "")
        )
    return lines


def format_plan(plan: Plan) -> str:
    """Render a plan as aligned tables.

    Args:
        plan: the plan.

    Returns:
        The text, without a trailing newline.
    """
    lines = [f"mode: {plan.mode}"]
    if plan.data is None:
        lines.append("data: not opened (the source could not be read here)")
    else:
        data = plan.data.as_dict()
        lines.append(
            f"data: {data['samples']:,} samples, batch {data['batch_size']}, shuffle {data['shuffle']}, "
            f"seed {data['seed']}, drop_last {data['drop_last']}"
        )
        if data["blocks"] is not None:
            blocks = data["blocks"]
            ahead = "read a window ahead by a background thread, block by block"
            if not blocks["read_ahead"]:
                ahead = "no read-ahead (the source is in memory, or the data on the device)"
            lines.append(
                f"  block order: {blocks['count']:,} block(s) of {blocks['samples']:,} samples, "
                f"shuffled within windows of {blocks['window']}; {ahead}"
            )
        for name, split in data["splits"].items():
            lines.append(
                f"  {name:<5} {split['samples']:>8,} samples  {split['batches']:>6,} batches  "
                f"last batch {split['last_batch_rows']} rows"
            )
        every = f"every {data['eval_every']} steps" if data["eval_every"] else "after each epoch"
        if data["val_batches"] is not None:
            every += f" on the first {data['val_batches']:,} validation batches (run.limit_val_batches)"
        evaluation = every if data["splits"]["val"]["samples"] else "none (no validation split)"
        checkpoints = f"every {data['checkpoint_every']} steps" if data["checkpoint_every"] else "at the end"
        lines.append(
            f"  {data['steps']:,} steps ({data['batches_per_epoch']:,} a epoch); evaluation {evaluation}; "
            f"checkpoints {checkpoints}"
        )
    pipeline = plan.pipeline
    lines.append(f"actors (batches read in place: {'yes' if pipeline.in_place else 'no'}):")
    for actor in pipeline.actors:
        where = f" on device {actor.device}" if actor.device is not None else ""
        lines.append(
            f"  {actor.name:<12} {actor.kind:<10}{where}  workers {actor.workers}  "
            f"in: {actor.inbox or '-'}  out: {', '.join(actor.outboxes) or '-'}"
        )
    lines.append("channels: " + ", ".join(f"{s}->{d} ({c})" for s, d, c in pipeline.channels))
    parallel = plan.parallel
    if parallel is not None:
        shares = "to be measured before the first step" if parallel.basis == "to measure" else parallel.basis
        lines.append(
            f"data parallel over {len(parallel.members)} device{'s' if len(parallel.members) > 1 else ''}: "
            f"rows of a batch of {parallel.batch} "
            f"{list(parallel.rows)} ({shares}); gradients summed on the host in device order "
            + ("in a pinned host arena every device imports; " if parallel.all_reduce == "arena"
               else "through each device's staging reads and writes; ")
            + ("each device applies the update" if parallel.update == "each"
               else "device 0 applies the update and its weights are copied to the others")
        )  # fmt: skip
        sizes = [(stop - start) * 4 / 2**20 for start, stop in parallel.buckets]
        if len(sizes) > 1 and parallel.all_reduce == "staging":
            lines.append(f"  gradients summed after the backward pass (staging reads whole tensors); "
                         f"{len(sizes)} buckets between the ranks")  # fmt: skip
        elif len(sizes) > 1:
            lines.append(f"  gradients summed in {len(sizes)} buckets as the backward pass finishes them, "
                         f"last layer first: {', '.join(f'{mb:.3g}' for mb in sizes)} MiB")  # fmt: skip
        elif sizes:
            lines.append(f"  gradients summed in one bucket of {sizes[0]:.3g} MiB, after the backward pass")
        if parallel.ranks > 1:
            lines.append(
                f"  MPI rank {parallel.rank} of {parallel.ranks}: {parallel.batch} rows of each global batch "
                f"of {parallel.global_batch}; gradients summed over the ranks in rank order"
            )
        for i, name in enumerate(parallel.members):
            lines.append(f"  [{i}] {name}: {parallel.rows[i]} rows, programs for {parallel.capacity[i]}")
    if plan.stages is not None:
        lines += stage_lines(plan.stages)
    choice, devices = plan.member_choice, plan.spec.devices
    if choice is not None:  # measured: who was kept, who left out, and the predicted steps
        lines.append(f"devices measured before the first step: {choice.sentence()}")
    elif parallel is not None and len(parallel.members) > 1 and devices.drop_slow and not devices.shares:
        lines.append("  measured before the first step: devices that would slow each step are left out")
    for device in plan.devices:
        memory = device.memory
        budget = f"{memory.budget:,} B" if memory.budget is not None else "not checked"
        lines.append(
            f"device {device.device}: batch {device.batch_size}, {device.slots} slot(s) in flight, "
            f"total {memory.total:,} B, budget {budget}"
        )
        lines.append(
            f"  work arena {memory.work_peak:,} B with buffer reuse ({memory.work_naive:,} B without)"
        )
        for name, size in memory.arenas:
            lines.append(f"  arena {name:<20} {size:>14,} B")
        lines.append("  tensors:")
        width = max(len(t.name) for t in device.layout.tensors)
        for t in device.layout.tensors:
            lines.append(
                f"    {t.name:<{width}}  {str(t.shape):<18} {t.dtype:<8} {t.arena:<16} @{t.offset:<10,} "
                f"{t.nbytes:>12,} B"
            )
        for program in device.programs:
            launches = len(program.launches)
            barriers = sum(isinstance(s, Barrier) for s in program.steps)
            lines.append(f"  program {program.name}: {launches} launches, {barriers} barriers")
            for step in program.steps:
                if isinstance(step, Barrier):
                    lines.append("    ---- barrier ----")
                else:
                    params = " ".join(
                        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in step.params
                    )
                    lines.append(f"    {step.op:<22} {', '.join(step.args)}  [{params}]")
                    if step.constants:
                        tiles = " ".join(f"{k}={v}" for k, v in step.constants)
                        lines.append(f"    {'':<22} constants: {tiles}")
    return "\n".join(lines)
