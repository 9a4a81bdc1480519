"""ONNX files in and out: :func:`export_onnx` writes a trained model (a run directory, a checkpoint
or a spec) as an ONNX file that gives what ``flow.predict`` gives; :func:`import_onnx` reads an ONNX
file as a spec and weights, which ``flow.predict("model.onnx", x)`` runs on the device like any
checkpoint. The graphs themselves are flow.onnx_export's and flow.onnx_import's (one table of ops,
:data:`flow.onnx_export.OPS`); this module reads and writes the files. Needs the ``onnx`` extra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actors import checkpoint as checkpoints
from flow.graph import unpack_params
from flow.onnx_export import LAYER_NORM_OPSET, OnnxError, require_onnx, to_onnx
from flow.onnx_import import from_onnx
from flow.optim import PARAMS
from flow.planning import init_parameters, plan
from flow.spec import Spec

__all__ = ["OnnxError", "export_onnx", "import_onnx"]


def export_onnx(
    model: Spec | str | Path | checkpoints.Checkpoint,
    path: str | Path,
    *,
    opset: int = LAYER_NORM_OPSET,
) -> Path:
    """Write a model as an ONNX file: input ``input`` [batch, *input_shape] of raw samples (the
    spec's Normalize and Scale preprocessing is in the graph), output ``output``, what
    ``flow.predict`` gives (probabilities for a CrossEntropy model). onnxruntime or any ONNX runtime
    can then run it; vkflow's own ``flow.predict(path, x)`` reads it back.

    Args:
        model: a run directory (its newest checkpoint), a checkpoint file or a loaded one, or a
            spec (record or .json/.msgpack file: its fresh, seeded weights).
        path: the file to write (a missing directory is created).
        opset: the ONNX opset, >= 13 (default 17; LayerNorm needs 17, and from 20 GELU is written
            as Gelu rather than its Erf form).

    Returns:
        The path written.

    Raises:
        OnnxError: a layer or preprocessing step with no ONNX form here (SelfAttention, PositionalEmbedding
            and Embedding are written; Resize is not), or the onnx package is missing.
        CheckpointError: no readable checkpoint at ``model``.
    """
    onnx = require_onnx()  # before reading a checkpoint, so a missing extra is the first thing said
    spec, state = _load(model)
    if state is None:  # a spec: the weights a fresh run starts from
        flat = np.zeros(0, np.float32)
        named = init_parameters(
            plan(spec, mode="predict").devices[0], spec.model.init.scheme, spec.model.init.seed
        )
    else:
        flat = np.asarray(state[PARAMS], np.float32)
        named = unpack_params(spec.model, flat)
    proto = to_onnx(spec, named, opset)
    onnx.checker.check_model(proto, full_check=True)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(target))
    return target


def import_onnx(path: str | Path) -> tuple[Spec, dict[str, np.ndarray]]:
    """Read an ONNX file as a vkflow spec and weights (what ``flow.predict`` does with a .onnx path).

    Args:
        path: the .onnx file.

    Returns:
        (spec, state): a model with no loss (predictions are the graph's output) on the default
        devices, and ``{"params:all": weights}`` as a checkpoint holds them.

    Raises:
        OnnxError: a file that is not a valid ONNX model, or a node vkflow cannot run (naming it,
            its op and what vkflow runs); or the onnx package is missing.
        OSError: the file cannot be read.
    """
    onnx = require_onnx()
    path = Path(path)
    path.stat()  # a missing file is an OSError, as for any other file
    try:
        proto = onnx.load(str(path))  # with its external data (torch's dynamo exporter writes some)
        onnx.checker.check_model(proto)
    except Exception as error:  # protobuf's DecodeError, the checker's ValidationError, ...
        why = " ".join(str(error).split())[:300] or type(error).__name__
        raise OnnxError(f"{path}: not a valid ONNX model ({why})") from None
    return from_onnx(proto, str(path))


def _load(model: Spec | str | Path | checkpoints.Checkpoint) -> tuple[Spec, dict[str, np.ndarray] | None]:
    from flow.inference import _load_model  # the one reader of "a model", as predict takes it

    return _load_model(model)
