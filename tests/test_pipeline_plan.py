"""flow.pipeline_plan: batches are read in place only where nothing changes a batch between the
source and the device."""

from __future__ import annotations

import dataclasses

from specs import synthetic_spec

from flow.pipeline_plan import plan_pipeline
from flow.spec import (
    MSE,
    Edge,
    Linear,
    Node,
    Normalize,
    Pipeline,
    default_pipeline,
)


def test_the_plan_reads_in_place_only_where_nothing_changes_a_batch():
    spec = synthetic_spec()
    shape = tuple(spec.model.input_shape)

    def in_place(spec=spec, sample_shape=shape, reads=True, maps=True) -> bool:
        return plan_pipeline(spec, sample_shape=sample_shape, reads_in_place=reads, maps_inputs=maps).in_place

    assert in_place()
    assert not in_place(maps=False)  # the device maps nothing
    assert not in_place(reads=False)  # a source without read_into
    predicting = plan_pipeline(
        spec, mode="predict", sample_shape=shape, reads_in_place=True, maps_inputs=True
    )
    assert not predicting.in_place  # the caller feeds arrays
    normalised = dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, preprocess=(Normalize((0.0,), (2.0,)),))
    )
    assert not in_place(normalised)
    assert not in_place(sample_shape=(7,))  # the source's samples are not the inputs
    # A second consumer of the loader's batches (a fan-out) would see slots the device refills.
    pipeline = default_pipeline(spec)
    fan_out = Pipeline(
        nodes=(*pipeline.nodes, Node("tap", "broadcast")),
        edges=(*pipeline.edges, Edge("loader", "tap")),
    )
    assert not in_place(dataclasses.replace(spec, pipeline=fan_out))
    # MSE with several outputs: a row's targets are more than one element of the slot's labels.
    regression = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, layers=(*spec.model.layers[:-1], Linear(2)), loss=MSE())
    )
    assert not in_place(regression)
