"""Command line: ``python -m flow devices|check|plan|run|generate|export|predict|bench``.

Each command is a thin shell over the library: it parses arguments, calls one function, prints,
and returns an exit status (0 ok, 1 a problem with the input, 2 a usage error). A problem with the
input is reported in words, never as a traceback (see flow.run_command.user_error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from flow.codec import load
from flow.errors import FlowError


def _devices(args: argparse.Namespace) -> int:
    from actors.device_select import every_device

    devices, message = every_device()
    if args.json:
        print(json.dumps({"devices": [asdict(d) for d in devices], "message": message}, indent=2))
        return 0
    if message:
        print(message)
    for d in devices:
        heaps = ", ".join(f"{h.size / 2**30:.1f} GiB{' local' if h.device_local else ''}" for h in d.heaps)
        print(f"[{'cpu' if d.is_numpy else d.index}] {d.name} ({d.kind}, {d.vendor})")
        print(f"    api {d.api_version}, driver {d.driver_version}")
        print(
            "    queues: "
            + ", ".join(
                f"family {q.index} x{q.count} {'G' if q.graphics else ''}{'C' if q.compute else ''}"
                f"{'T' if q.transfer else ''}"
                for q in d.queue_families
            )
        )
        print(
            f"    memory heaps: {heaps}; types: "
            + ", ".join("+".join(t.flags) or "-" for t in d.memory_types)
        )
        print(
            f"    workgroup: size {d.max_workgroup_size}, invocations {d.max_workgroup_invocations}, "
            f"shared {d.shared_memory_bytes} B, subgroup {d.subgroup_size}"
        )
        print(f"    features: {', '.join(d.features) or '-'}")
        if d.cooperative_matrix_shapes:
            print(f"    cooperative matrix: {'; '.join(d.cooperative_matrix_shapes)}")
    return 0


def _report(file: str, work):
    """Run ``work()``; print every problem (or the file error) and return None when it fails."""
    try:
        return work()
    except FlowError as error:
        print(f"{file}: {len(error.problems)} problem(s)")
        for problem in error.problems:
            print(f"  {problem}")
    except (OSError, ValueError) as error:  # a file that cannot be read, a tuning table that is not one
        print(f"{file}: {error}")
    return None


def _check(args: argparse.Namespace) -> int:
    from flow.preflight import preflight
    from flow.summary import summarize

    spec = _report(args.file, lambda: load(args.file))
    if spec is None:
        return 1
    # The spec's problems and, when its source can be read, the data's: all of them at once.
    problems, about = preflight(spec)
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print(summarize(spec))
    print(f"source: {about}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from flow.data_plan import header_of
    from flow.runtime import plan_on, select_devices
    from loaders import LoaderError, open_source

    spec = _report(args.file, lambda: load(args.file))
    if spec is None:
        return 1
    # The whole run where its inputs can be had: the data from the source's header (no sample is
    # read), the programs and memory for the device the spec selects (no device is opened).
    header = None
    try:
        source = open_source(spec.data.source)
    except (LoaderError, OSError) as error:
        print(f"{args.file}: data not planned: {error}", file=sys.stderr)
    else:
        with contextlib.closing(source):
            header = header_of(source)
    try:
        selection = select_devices(spec.devices)
    except LookupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    group = selection.facts
    facts = group if len(group) > 1 else group[0]
    the_plan = _report(args.file, lambda: plan_on(spec, facts, header=header, budget=args.budget))
    if the_plan is None:
        return 1
    if args.json:
        print(json.dumps({**the_plan.as_dict(), "device_choice": selection.reason}, indent=1))
        return 0
    from flow.plan_table import format_plan

    if selection.reason:  # why "auto" chose the device the plan is for
        print(f"device choice: {selection.reason}")
    print(format_plan(the_plan))
    return 0


def _run(args: argparse.Namespace) -> int:
    from flow.run_command import main_run

    return main_run(args.rest)


def _bench(args: argparse.Namespace) -> int:
    import types

    script = Path(__file__).resolve().parent.parent / "bench" / "bench_mlp.py"
    if not script.exists():
        print("bench/bench_mlp.py not found: the benchmarks ship with the source tree, not the wheel")
        return 2
    # Run as __main__ by hand: runpy would set argv[0] to the script, and its usage line would say
    # bench_mlp.py rather than the command the user typed.
    sys.argv = [f"{program()} bench", *args.rest]
    sys.path.insert(0, str(script.parent))  # the benchmark imports its sibling modules (common, bench_gemm)
    module = types.ModuleType("__main__")
    module.__file__ = str(script)
    outer, sys.modules["__main__"] = sys.modules["__main__"], module
    try:
        exec(compile(script.read_text(), str(script), "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = outer
    return 0


def _generate(args: argparse.Namespace) -> int:
    from flow.generation import Sampling, settings_error

    if problem := settings_error(args.tokens, Sampling(args.temperature, args.top_k, args.seed)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from flow.inference import generate
    from flow.run_command import print_user_error

    try:
        print(generate(args.checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    except Exception as error:
        if not print_user_error(error):
            raise
        return 1
    return 0


def _report_run(args: argparse.Namespace) -> int:
    from flow.report import ReportError, write_report

    try:
        paths = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(str(path) for path in paths))
    return 0


def program() -> str:
    """How vkflow was started, for its usage lines: the ``vkflow`` script or ``python -m flow``."""
    return "vkflow" if Path(sys.argv[0]).name == "vkflow" else "python -m flow"


# The name on the package index ("vkflow" there is another project); the script is still `vkflow`.
DISTRIBUTION = "vkflow-ml"


def version() -> str:
    """The installed distribution's version (``unknown`` when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m flow`` and the ``vkflow`` script.

    Args:
        argv: arguments (default: sys.argv[1:]).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog=program(), description="vkflow: ML on any Vulkan GPU")
    parser.add_argument("--version", action="version", version=f"vkflow {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    devices = commands.add_parser("devices", help="list Vulkan devices and their facts")
    devices.add_argument("--json", action="store_true")
    devices.set_defaults(handler=_devices)
    check = commands.add_parser("check", help="validate a spec file; print every problem or a summary")
    check.add_argument("file")
    check.set_defaults(handler=_check)
    plan = commands.add_parser(
        "plan", help="print the whole run's plan (data, actors, channels, programs, memory) for a spec file"
    )
    plan.add_argument("file")
    plan.add_argument("--json", action="store_true")
    plan.add_argument(
        "--budget", type=int, default=None, help="device memory budget in bytes (default: the device's)"
    )
    plan.set_defaults(handler=_plan)
    run = commands.add_parser("run", help="train a spec file: run FILE [--resume DIR] [--quiet] ...")
    run.add_argument("rest", nargs=argparse.REMAINDER)
    run.set_defaults(handler=_run)
    generate = commands.add_parser(
        "generate", help="continue a prompt with a language model's checkpoint, sampled on the device"
    )
    generate.add_argument("checkpoint", help="a .ckpt file or a checkpoint directory (its newest)")
    generate.add_argument("prompt")
    generate.add_argument("--tokens", type=int, default=200, help="tokens to add (default 200)")
    generate.add_argument("--temperature", type=float, default=1.0, help="> 0 (default 1.0)")
    generate.add_argument("--top-k", type=int, default=None, help="draw among the K likeliest (default all)")
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(handler=_generate)
    from flow.predict_command import add_commands

    add_commands(commands)  # export, predict
    report = commands.add_parser("report", help="plot a run's metrics: report.png, report.html, report.json")
    report.add_argument("run_dir", help="the run's directory (its checkpoint_dir) or its metrics file")
    report.add_argument("--out", metavar="DIR", help="where to write (default: next to the metrics file)")
    report.set_defaults(handler=_report_run)
    bench = commands.add_parser("bench", help="benchmark against PyTorch (bench/bench_mlp.py)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_bench)
    argv = sys.argv[1:] if argv is None else list(argv)
    # run and bench hand every later argument to their own parsers untouched (argparse's
    # REMAINDER mis-splits options such as "--only e").
    if argv and argv[0] in ("run", "bench"):
        return (_run if argv[0] == "run" else _bench)(argparse.Namespace(rest=argv[1:]))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
