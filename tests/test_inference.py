"""flow.inference: predictions from a trained checkpoint, whole or streamed, the same through an
open pipeline in predict mode, and from a source spec."""

from __future__ import annotations

import numpy as np
import trio
from specs import image_spec

from actors.cpu_backend import CpuBackend
from flow.inference import predict
from flow.runner import open_pipeline, run
from loaders import open_source


async def test_streaming_inference_through_the_pipeline(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    trained = await trio.to_thread.run_sync(run, spec)  # run() starts its own trio loop
    x = np.random.default_rng(0).standard_normal((37, 1, 6, 6)).astype(np.float32)

    expected = predict(trained.checkpoint, x)
    assert expected.shape == (37, 4) and np.allclose(expected.sum(axis=1), 1.0, atol=1e-5)
    streamed = list(predict(trained.checkpoint, x, stream=True))
    assert [len(s) for s in streamed] == [16, 16, 5]
    assert np.array_equal(np.concatenate(streamed), expected)
    fresh = predict(spec, x)  # untrained weights give other answers
    assert not np.allclose(fresh, expected)

    async with open_pipeline(resume=trained.checkpoint, mode="predict", backend=CpuBackend()) as p:
        first = await p.predict(x)
        async with trio.open_nursery() as nursery:

            async def feed_all() -> None:
                for rows in (x[:3], x[3:30], x[30:]):
                    await p.feed(rows)
                await p.end_input()

            nursery.start_soon(feed_all)
            outputs = [out async for out in p.results()]
    assert np.array_equal(first, expected)  # the same batches of 16, 16 and 5 rows: the same bits
    assert [len(o) for o in outputs] == [3, 27, 7]
    # Other batch splits (3, 16, 11 and 7 rows): nothing promises the same summation order for
    # them (a BLAS blocks each shape its own way), so they agree within float32 rounding.
    np.testing.assert_allclose(np.concatenate(outputs), expected, rtol=1e-5, atol=1e-6)


def test_predict_from_a_source_spec(tmp_path):
    spec = image_spec(tmp_path, epochs=1)
    trained = run(spec)
    everything = predict(trained.checkpoint, spec.data.source)
    assert everything.shape == (200, 4)

    source = open_source(spec.data.source)
    x, _, _ = source.read(np.arange(200))
    assert np.array_equal(everything, predict(trained.checkpoint, x))
