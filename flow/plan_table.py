"""A plan as text for people: memory per arena, tensors with their placement, and each program's
launches with the barriers between them."""

from __future__ import annotations

from flow.planning import Plan
from flow.program import Barrier


def format_plan(plan: Plan) -> str:
    """Render a plan as aligned tables.

    Args:
        plan: the plan.

    Returns:
        The text, without a trailing newline.
    """
    lines = [
        f"placement: {dict(plan.placement)}",
        "channels: " + ", ".join(f"{s}->{d} ({c})" for s, d, c in plan.channels),
    ]
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
    return "\n".join(lines)
