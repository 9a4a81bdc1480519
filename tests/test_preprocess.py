"""actors.preprocess: a transform that does not fit the batch fails in the preprocess actor, which
the run's error names."""

from __future__ import annotations

import dataclasses

import pytest
from specs import image_spec

from flow.runner import run
from flow.runtime import ActorError
from flow.spec import (
    RandomCrop,
)
from flow.testing import FakeDevice


def test_a_bad_transform_fails_in_preprocess():
    cropped = dataclasses.replace(image_spec().data, augment=(RandomCrop((4, 4)),))
    bad_shape = dataclasses.replace(image_spec(), data=cropped)
    with pytest.raises(ActorError, match="actor 'preprocess' failed: ValueError: .*shape"):
        run(bad_shape, backend=FakeDevice())
