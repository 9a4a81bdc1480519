"""Weights as ``.safetensors`` files named and shaped as PyTorch's ``state_dict()`` of the same
model, so that ``torch.nn.Sequential.load_state_dict(safetensors.torch.load_file(path))`` takes
them, and a file from PyTorch (or from :func:`export_safetensors`) starts a vkflow run
(``Init(from_file=...)``).

The torch model is the one a user would write for the spec:

- each layer takes the next index of an ``nn.Sequential``, parameters or not (Flatten, ReLU,
  Dropout, Add, ...); a layer's ``activation=`` (Linear, Conv2d) is its own module after it, as torch
  writes it, so ``(Flatten(), Linear(128, activation="relu"), Linear(10))`` is
  ``Sequential(Flatten(), Linear(64, 128), ReLU(), Linear(128, 10))``: ``1.weight``, ``3.weight``;
- a ``Residual`` at index i is a module whose ``layers`` is an ``nn.Sequential`` (``i.layers.j.*``),
  a ``Repeat`` an ``nn.Sequential`` of its repetitions, each an ``nn.Sequential``
  (``i.r.j.*``); named inputs do not change the numbering;
- Linear ``weight`` (out, in) (vkflow stores [in, out]: it is transposed here), Conv2d
  (out, in, kh, kw), BatchNorm ``weight``/``bias``/``running_mean``/``running_var`` and an int64
  ``num_batches_tracked`` (the checkpoint's step; optional on import, its value unused),
  LayerNorm ``weight``/``bias``, Embedding ``weight`` (num, dim), PositionalEmbedding a module of
  one ``weight`` (positions, dim), SelfAttention an ``nn.MultiheadAttention(dim, heads,
  batch_first=True)``: ``in_proj_weight`` (3 dim, dim), ``in_proj_bias``, ``out_proj.weight``,
  ``out_proj.bias``. Flatten orders features as torch does (NCHW, row-major), and GELU is the exact
  (erf) one, torch's default.

A CrossEntropy's class weights belong to the loss, not the model: they are neither exported nor
imported. Only float32 tensors are taken; anything else is refused, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from flow.graph import CLASS_WEIGHTS, parameters, unpack_params
from flow.spec import BatchNorm1d, BatchNorm2d, Linear, Model, Repeat, Residual, Spec

NEEDS = "safetensors files need the safetensors package: pip install 'vkflow-ml[safetensors]'"
# SelfAttention's vkflow names -> nn.MultiheadAttention's (both projections transposed).
_ATTENTION = {
    "qkv_weight": "in_proj_weight",
    "qkv_bias": "in_proj_bias",
    "out_weight": "out_proj.weight",
    "out_bias": "out_proj.bias",
}
_TRANSPOSED = {"qkv_weight", "out_weight"}
_COUNTER = "num_batches_tracked"


@dataclass(frozen=True)
class TorchTensor:
    """One tensor of the torch model's state_dict and where vkflow keeps it.

    Attributes:
        name: the state_dict key (``"3.weight"``).
        shape: its shape in torch.
        param: vkflow's parameter (``"layers[2].weight"``); None for BatchNorm's step counter.
        transposed: vkflow stores the transpose of the torch tensor.
    """

    name: str
    shape: tuple[int, ...]
    param: str | None
    transposed: bool = False


def _prefixes(layers: tuple, path: str, torch_path: str, into: dict[str, tuple[str, Any]]) -> None:
    index = 0
    for j, layer in enumerate(layers):
        here, there = f"{path}layers[{j}]", f"{torch_path}{index}"
        into[here] = (there, layer)
        if isinstance(layer, Residual):
            _prefixes(layer.layers, f"{here}.", f"{there}.layers.", into)
        elif isinstance(layer, Repeat):
            for r in range(layer.times):
                _prefixes(layer.layers, f"{here}[{r}].", f"{there}.{r}.", into)
        # A fused activation is a module of its own in torch, so it takes the next index.
        index += 2 if getattr(layer, "activation", None) is not None else 1


def torch_tensors(model: Model) -> list[TorchTensor]:
    """The torch state_dict of ``model``, in vkflow's parameter order (see the module docstring).

    Args:
        model: a valid model.

    Returns:
        One entry per tensor, BatchNorm's ``num_batches_tracked`` included.
    """
    prefixes: dict[str, tuple[str, Any]] = {}
    _prefixes(model.layers, "", "", prefixes)
    result: list[TorchTensor] = []
    for p in parameters(model):
        if p.name == CLASS_WEIGHTS:
            continue
        path, _, own = p.name.rpartition(".")
        prefix, layer = prefixes[path]
        transposed = (isinstance(layer, Linear) and own == "weight") or own in _TRANSPOSED
        shape = p.shape[::-1] if transposed else p.shape
        result.append(TorchTensor(f"{prefix}.{_ATTENTION.get(own, own)}", shape, p.name, transposed))
        if isinstance(layer, BatchNorm1d | BatchNorm2d) and own == "running_var":
            result.append(TorchTensor(f"{prefix}.{_COUNTER}", (), None))
    return result


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(NEEDS) from None
    return safetensors


def torch_state(model: Model, values: dict[str, np.ndarray], step: int = 0) -> dict[str, np.ndarray]:
    """vkflow's parameters as the torch model's state_dict.

    Args:
        model: the model.
        values: every parameter by vkflow's name, in vkflow's layout.
        step: BatchNorm's ``num_batches_tracked``.

    Returns:
        Contiguous float32 arrays by torch name (int64 for the step counters).
    """
    state = {}
    for t in torch_tensors(model):
        if t.param is None:
            state[t.name] = np.array(step, np.int64)
        else:
            value = values[t.param].T if t.transposed else values[t.param]
            state[t.name] = np.ascontiguousarray(value, np.float32)
    return state


def save_weights(model: Model, values: dict[str, np.ndarray], path: str | Path, step: int = 0) -> Path:
    """Write vkflow's parameters to a ``.safetensors`` file as the torch model's state_dict.

    Args:
        model: the model.
        values: every parameter by vkflow's name, in vkflow's layout.
        path: the file to write.
        step: BatchNorm's ``num_batches_tracked``.

    Returns:
        The path written.
    """
    state = torch_state(model, values, step)
    data = _safetensors().numpy.save(state, metadata={"format": "pt", "producer": "vkflow"})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)  # an OSError names the path, where the library's own writer would not
    return path


# safetensors' dtype codes as numpy names, for the messages.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
}


def read_weights(model: Model, path: str | Path) -> dict[str, np.ndarray]:
    """A ``.safetensors`` file's tensors as vkflow's parameters, after checking every name, shape
    and dtype against the model's torch state_dict (strictly, as ``load_state_dict`` does).

    Args:
        model: the model the weights are for.
        path: the file.

    Returns:
        Every parameter of the model (class weights aside) by vkflow's name, in vkflow's layout.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a safetensors file, or tensors missing, unexpected, or of the wrong shape or
            dtype (all of them named at once, expected against found).
        ImportError: the safetensors package is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such weights file")
    safetensors = _safetensors()
    wanted = {t.name: t for t in torch_tensors(model)}
    problems: list[str] = []
    found: dict[str, np.ndarray] = {}
    try:
        with safetensors.safe_open(str(path), framework="numpy") as file:
            names = set(file.keys())
            for name in sorted(names - wanted.keys()):
                problems.append(f"unexpected tensor {name!r}")
            for name, t in wanted.items():
                if name not in names:
                    if t.param is not None:  # the step counter is optional: its value is unused
                        problems.append(f"missing tensor {name!r} (shape {t.shape})")
                    continue
                part = file.get_slice(name)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
                expected = "float32" if t.param is not None else "int64"
                if shape != t.shape:
                    problems.append(f"tensor {name!r} has shape {shape}, expected {t.shape}")
                elif _DTYPES.get(dtype, dtype) != expected:
                    problems.append(f"tensor {name!r} is {_DTYPES.get(dtype, dtype)}, expected {expected}")
                elif t.param is not None:
                    value = file.get_tensor(name)
                    found[t.param] = np.ascontiguousarray(value.T if t.transposed else value)
    except safetensors.SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    if problems:
        raise ValueError(f"{path} does not fit the model: " + "; ".join(problems))
    return found


def export_safetensors(checkpoint: Any, path: str | Path) -> Path:
    """Export a trained run's weights to a ``.safetensors`` file that ``torch.nn.Sequential``
    loads (names and shapes: see the module docstring).

    Args:
        checkpoint: a checkpoint: a ``.ckpt`` file, a run's checkpoint directory (its newest) or a
            loaded ``actors.checkpoint.Checkpoint``.
        path: the file to write.

    Returns:
        The path written.

    Raises:
        CheckpointError: no readable checkpoint there.
        ValueError: a spec file was given (it holds no trained weights).
    """
    from actors import checkpoint as checkpoints

    if isinstance(checkpoint, Spec) or Path(str(checkpoint)).suffix in (".json", ".msgpack", ".mpk"):
        raise ValueError(
            f"{checkpoint}: a spec holds no trained weights; export a checkpoint "
            "(a .ckpt file or a run's checkpoint directory)"
        )
    saved = checkpoint if isinstance(checkpoint, checkpoints.Checkpoint) else checkpoints.load(checkpoint)
    values = unpack_params(saved.spec.model, saved.state["params:all"])
    return save_weights(saved.spec.model, values, path, saved.cursor.step)


def with_weights(spec: Spec, path: str | Path) -> Spec:
    """The spec with its model starting from a ``.safetensors`` file (``Init(from_file=path)``),
    to train or predict from: ``flow.predict(flow.with_weights(spec, "w.safetensors"), x)``.

    Args:
        spec: the spec.
        path: the file; it is read, and checked against the model, when a run or prediction starts.

    Returns:
        The new spec.
    """
    init = replace(spec.model.init, from_file=str(path))
    return replace(spec, model=replace(spec.model, init=init))
