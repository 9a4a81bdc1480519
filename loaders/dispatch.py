"""``open_source``: turn a source spec record into an open source.

Source specs are frozen records defined in ``flow/spec_data.py``. This lower layer must not import
``flow``, so it matches them by class name and reads their attributes; optional attributes fall
back to the same defaults the specs use.
"""

from __future__ import annotations

from typing import Any

from loaders.arrays import open_arrays
from loaders.binary import IDXSource, RawBinarySource
from loaders.csv_source import CSVSource
from loaders.digits import open_digits
from loaders.image_folder import ImageFolderSource
from loaders.source import Source
from loaders.synthetic import SyntheticSource
from loaders.text import TextSource


def _opt(spec: Any, name: str, default: Any) -> Any:
    value = getattr(spec, name, default)
    return default if value is None and default is not None else value


def _tuple_or_none(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


def open_source(spec: Any) -> Source:
    """Open the source a spec describes.

    Args:
        spec: an ImageFolder, CSV, RawBinary, IDX, Synthetic, Digits, Arrays or Text record.

    Returns:
        The open source; the caller closes it.
    """
    kind = type(spec).__name__
    if kind == "ImageFolder":
        return ImageFolderSource(
            spec.root,
            size=_tuple_or_none(_opt(spec, "size", None)),
            mode=_opt(spec, "mode", "L"),
            layout=_opt(spec, "layout", "CHW"),
            labels_csv=_opt(spec, "labels_csv", None),
            workers=_opt(spec, "workers", 2),
            on_error=_opt(spec, "on_error", "raise"),
            cache=_opt(spec, "cache", "auto"),
        )
    if kind == "CSV":
        return CSVSource(
            spec.path,
            label_column=spec.label_column,
            feature_columns=_tuple_or_none(_opt(spec, "feature_columns", None)),
            header=_opt(spec, "header", True),
            chunk_rows=_opt(spec, "chunk_rows", 4096),
            on_error=_opt(spec, "on_error", "raise"),
            task=_opt(spec, "task", None),
        )
    if kind == "RawBinary":
        return RawBinarySource(
            spec.path,
            dtype=spec.dtype,
            shape=tuple(spec.shape),
            labels_path=_opt(spec, "labels_path", None),
            label_dtype=_opt(spec, "label_dtype", "int32"),
            on_error=_opt(spec, "on_error", "raise"),
        )
    if kind == "IDX":
        return IDXSource(spec.images, spec.labels, on_error=_opt(spec, "on_error", "raise"))
    if kind == "Synthetic":
        return SyntheticSource(
            task=_opt(spec, "task", "classification"),
            samples=spec.samples,
            features=tuple(spec.features),
            classes=_opt(spec, "classes", 10),
            seed=_opt(spec, "seed", 0),
        )
    if kind == "Digits":
        return open_digits(workers=_opt(spec, "workers", 2), on_error=_opt(spec, "on_error", "raise"))
    if kind == "Arrays":
        return open_arrays(_opt(spec, "x", None), _opt(spec, "y", None), _opt(spec, "path", None))
    if kind == "Custom":
        from loaders.custom import CustomSource

        return CustomSource(spec.source, _opt(spec, "name", "custom"))
    if kind == "Text":
        return TextSource(
            spec.path,
            level=_opt(spec, "level", "char"),
            context=_opt(spec, "context", 128),
            stride=_opt(spec, "stride", 1),
        )
    known = "ImageFolder, CSV, RawBinary, IDX, Synthetic, Digits, Arrays, Text, Custom"
    raise ValueError(f"unknown source spec {kind} ({known})")
