"""Data sources for vkflow: image folders, CSV, raw binary / IDX, text, synthetic data and the bundled
digits, plus the sampler (seeded shuffle per epoch, sharding, resumable position), splits and batch
transforms.

The runtime opens a source with :func:`open_source` from a spec record, draws batches of indices
from a :class:`Sampler` and decodes them with ``source.read(indices)``. Bad input follows the
source's ``on_error`` policy (:mod:`loaders.errors`). This package imports nothing from ``flow`` or
``actors``: it is the lowest layer. From ``shaders`` it takes only the import-free
:func:`shaders.user_cache.cache_dir`, so that one setting moves every cache.
"""

from loaders.arrays import ArraysSource
from loaders.binary import IDXSource, RawBinarySource, read_idx, write_idx
from loaders.cache import load_manifest, manifest_path
from loaders.csv_source import CSVSource
from loaders.digits import load_digits_arrays, open_digits, write_image_folder
from loaders.dispatch import open_source
from loaders.errors import LoaderError
from loaders.image_folder import ImageFolderSource
from loaders.sampler import Sampler, SamplerState
from loaders.source import Source, SourceStatistics
from loaders.splits import split_indices
from loaders.synthetic import SyntheticSource
from loaders.text import TextSource
from loaders.transforms import (
    apply_transforms,
    batch_rng,
    horizontal_flip,
    normalize,
    random_crop,
    resize,
    scale,
)

__all__ = [
    "ArraysSource",
    "CSVSource",
    "IDXSource",
    "ImageFolderSource",
    "LoaderError",
    "RawBinarySource",
    "Sampler",
    "SamplerState",
    "Source",
    "SourceStatistics",
    "SyntheticSource",
    "TextSource",
    "apply_transforms",
    "batch_rng",
    "horizontal_flip",
    "load_digits_arrays",
    "load_manifest",
    "manifest_path",
    "normalize",
    "open_digits",
    "open_source",
    "random_crop",
    "read_idx",
    "resize",
    "scale",
    "split_indices",
    "write_idx",
    "write_image_folder",
]
