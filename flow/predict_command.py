"""The ``export`` and ``predict`` commands of ``python -m flow`` (``vkflow``):

    export RUN_DIR_OR_CKPT -o FILE [--format safetensors|onnx]
    predict MODEL INPUT.npy|.npz [-o OUT.npy] [--key NAME] [--weights W.safetensors] [--argmax]

A mistake in what the user gave (a missing or damaged checkpoint, a file that is not an array,
inputs of another shape, an unknown format) is one ``error:`` line and exit status 1
(:func:`flow.run_command.user_error` decides which errors those are); a bad flag is argparse's
usage error, status 2.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

import numpy as np

FORMATS = {".safetensors": "safetensors", ".onnx": "onnx"}
SPEC_SUFFIXES = (".json", ".msgpack", ".mpk")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``export`` and ``predict`` to the command line's subcommands.

    Args:
        commands: the main parser's subparsers.
    """
    export = commands.add_parser(
        "export", help="write a trained run's weights as .safetensors (torch's state_dict) or .onnx"
    )
    export.add_argument(
        "checkpoint", metavar="RUN_DIR_OR_CKPT", help="a .ckpt file or a run's directory (its newest)"
    )
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")
    export.add_argument(
        "--format", choices=sorted(set(FORMATS.values())), help="default: from FILE's extension"
    )
    export.set_defaults(handler=lambda args: _guarded(_export, args))
    predict = commands.add_parser(
        "predict", help="predictions (probabilities for a classifier) for inputs in a file"
    )
    predict.add_argument("model", metavar="MODEL", help="a .ckpt file, a run's directory, or a spec file")
    predict.add_argument("inputs", metavar="INPUTS", help="a .npy file, or a .npz (its one array, or --key)")
    predict.add_argument(
        "-o", "--output", metavar="OUT.npy", help="save the predictions here (default: print them)"
    )
    predict.add_argument("--key", help="the array to read from a .npz with several")
    predict.add_argument(
        "--weights", metavar="W.safetensors", help="with a spec file: start from these weights"
    )
    predict.add_argument("--argmax", action="store_true", help="print or save each row's class id instead")
    predict.set_defaults(handler=lambda args: _guarded(_predict, args))


def _guarded(command, args: argparse.Namespace) -> int:
    from flow.run_command import print_user_error

    try:
        return command(args)
    except ImportError as error:  # an optional package the format needs
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if not print_user_error(error):
            raise
        return 1


def _export(args: argparse.Namespace) -> int:
    output = Path(args.output)
    kind = args.format or FORMATS.get(output.suffix)
    if kind is None:
        raise ValueError(f"{output}: say --format safetensors or onnx (or name a .safetensors or .onnx file)")
    if kind == "safetensors":
        from flow.safetensors_io import export_safetensors

        export_safetensors(args.checkpoint, output)
    else:
        _export_onnx(args.checkpoint, output)
    print(f"wrote {output}")
    return 0


def _export_onnx(checkpoint: str, output: Path) -> None:
    try:
        from flow.onnx_io import export_onnx
    except ModuleNotFoundError as error:
        if error.name == "flow.onnx_io":
            raise ImportError("ONNX export needs flow.onnx_io, which this vkflow does not have") from None
        raise
    export_onnx(checkpoint, output)  # it names a missing onnx package itself


def read_inputs(path: str | Path, key: str | None = None) -> np.ndarray:
    """The array in a ``.npy`` file, or in a ``.npz`` (its only one, or ``key``).

    Args:
        path: the file.
        key: the array's name in a ``.npz``.

    Returns:
        The array, of real numbers.

    Raises:
        OSError: the file cannot be read.
        ValueError: not an array file, no such key, or values that are not real numbers.
    """
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path}: not a .npy or .npz file ({error})") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            names = list(loaded.files)
            if key is None and len(names) != 1:
                raise ValueError(
                    f"{path} holds {len(names)} arrays ({', '.join(names)}): choose one with --key"
                )
            if key is not None and key not in names:
                raise ValueError(f"{path} has no array {key!r}; it has {', '.join(names) or 'none'}")
            loaded = loaded[key or names[0]]
    if loaded.dtype.kind not in "biuf":
        raise ValueError(f"{path} holds {loaded.dtype} values; a model takes real numbers")
    return loaded


def _model(args: argparse.Namespace):
    """(what flow.predict takes, its spec: None where its own reader checks the inputs)."""
    from actors import checkpoint as checkpoints

    path = Path(args.model)
    if path.suffix in SPEC_SUFFIXES:
        from flow.codec import load
        from flow.safetensors_io import with_weights

        spec = load(path)
        return (spec if args.weights is None else with_weights(spec, args.weights)), spec
    if args.weights is not None:
        raise ValueError(f"--weights goes with a spec file; {args.model} has weights of its own")
    if path.suffix == ".onnx":
        return args.model, None
    saved = checkpoints.load(path)
    return saved, saved.spec


def _predict(args: argparse.Namespace) -> int:
    from flow.inference import predict
    from flow.inputs import as_inputs

    inputs = read_inputs(args.inputs, args.key)
    model, spec = _model(args)
    if spec is not None:
        try:
            inputs = as_inputs(inputs, tuple(spec.model.input_shape))
        except ValueError as error:  # inputs of another shape: say which file
            raise ValueError(f"{args.inputs}: {error}") from None
    out = predict(model, inputs)
    if args.argmax:
        out = out.argmax(axis=-1)
    if args.output is not None:
        np.save(args.output, out)
        print(f"wrote {args.output}: {out.dtype} {tuple(out.shape)}")
    else:
        np.savetxt(sys.stdout, out.reshape(len(out), -1), fmt="%d" if args.argmax else "%.6g")
    return 0
