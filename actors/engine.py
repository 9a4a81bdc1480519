"""A device plan bound to a backend: parameters, optimiser state and K input slots live on the
device; programs are recorded once per (program, slot) and replayed.

This is the synchronous core the device actor drives (the actor adds trio, channels and
statistics). It never records per step: a step writes the batch and the step values into its
slot's host-visible io tensors and submits the slot's pre-recorded program.

Where the backend maps those io tensors into host memory (``write_into``: the Vulkan backend's
host-visible memory), the engine keeps a numpy view of each slot's small io tensors and writes the
step values and labels, and reads the loss and correct count, through them: an element store or
load instead of a backend call that costs several microseconds of Python each, every step. The
same views let a producer fill a batch in place (:meth:`Engine.input_views`).

The inputs x are the exception where the backend has DMA uploads (``staging_view`` and
``upload``): a producer fills the slot's pinned host staging buffer, which is ordinary cached
memory (a gather of random rows straight into mapped device memory ran at 2 GB/s on an H100
host: 420 us for a batch of 256 x 784), and :meth:`Engine.submit_filled` has the copy engine move
it (about 50 GB/s, beside compute) before the step's program, which the backend orders after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.backend import Backend
from flow.inputs import token_id_error
from flow.metrics import metric_name, on_device
from flow.model_graph import expand
from flow.optim import HALVES, LOSS_SCALE, PARAMS, check_compatible, step_values
from flow.planning import DevicePlan, init_parameters
from flow.program import Program
from flow.spec_model import CrossEntropy, Embedding


@dataclass(frozen=True)
class SlotViews:
    """Numpy views straight onto one slot's io tensors in mapped device memory.

    Attributes:
        x: the inputs, [batch_size, *input_shape].
        y: the labels or targets, flat [batch_size * per_row].
        stepvals: the per-step values [len(STEP_VALUES)] (flow.optim.step_values).
        loss: [1].
        correct: [1].
        metrics: [1] each, the model's on-device metrics' sums (flow.metrics.on_device's order).
    """

    x: np.ndarray
    y: np.ndarray
    stepvals: np.ndarray
    loss: np.ndarray
    correct: np.ndarray
    metrics: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    correct: float
    rows: int


class Engine:
    """Runs a DevicePlan's programs on a backend."""

    def __init__(self, device_plan: DevicePlan, backend: Backend) -> None:
        self.plan = device_plan
        self.backend = backend
        self.slots = device_plan.slots
        backend.open_layout(device_plan.layout, slots=self.slots)
        self._handles: dict[tuple[str, int], int] = {}
        # Mixed precision: the weights' float16 copies that the update keeps (flow.weight_copies).
        self.keeps_copies = any(t.name == HALVES for t in device_plan.layout.tensors)
        self.profiling = False  # RunSettings(profile=True): see profile()
        self._pools: dict[int, object] = {}  # slot -> the timestamp pool of its train program
        self._launch_ns: list[np.ndarray] = []  # per completed train step, each launch's GPU ns
        # Only a classifier counts correct answers; for regression the count is not a number.
        self.has_accuracy = isinstance(device_plan.model.loss, CrossEntropy)
        self.metric_tensors = tuple(f"metric:{metric_name(m)}" for m in on_device(device_plan.model))
        self._views = [self._slot_views(slot) for slot in range(self.slots)]
        self._idx_views: list[np.ndarray | None] = [None] * self.slots  # set by upload_dataset
        self._staged = callable(getattr(backend, "staging_view", None)) and callable(
            getattr(backend, "upload", None)
        )
        # An Embedding (which reads only the model's input) takes token ids: every batch is checked
        # on the host, since a GPU clamps a bad id into range and would train on the wrong row unheard.
        tables = [
            n.layer.num_embeddings for n in expand(device_plan.model).nodes if isinstance(n.layer, Embedding)
        ]
        self.vocabulary = min(tables) if tables else None

    def _check_ids(self, x: np.ndarray, first: int = 0) -> None:
        if self.vocabulary is not None and (message := token_id_error(x, self.vocabulary, first)):
            raise ValueError(message)

    def _slot_views(self, slot: int) -> SlotViews | None:
        """Views of ``slot``'s io tensors, or None where the backend maps no memory. They stay valid
        while this engine's layout is open (a new Engine on the same backend replaces it)."""
        views = {name: self._view(name, slot) for name in ("x", "y", "stepvals", "loss", "correct")}
        if any(view is None for view in views.values()):
            return None
        views["y"] = views["y"].reshape(-1)
        metrics = tuple(self._view(name, slot) for name in self.metric_tensors)
        return None if any(m is None for m in metrics) else SlotViews(**views, metrics=metrics)

    def input_views(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Each slot's (x [batch_size, *input_shape], y flat) views for a producer that fills
        batches in place: x in the slot's pinned staging memory where the backend uploads by DMA
        (submit with :meth:`submit_filled`), else in mapped device memory; y in mapped device
        memory. None where the backend maps no memory.

        Returns:
            One (x, y) pair per slot, or None.
        """
        if any(views is None for views in self._views):
            return None
        if self._staged:
            # x goes through the slot's pinned staging buffer; submit_filled uploads it.
            return [
                (self.backend.staging_view("x", slot), views.y)  # type: ignore[attr-defined, union-attr]
                for slot, views in enumerate(self._views)
            ]
        return [(views.x, views.y) for views in self._views]  # type: ignore[union-attr]

    # -- state ----------------------------------------------------------------------------------
    def initialise(self, scheme: str, seed: int) -> None:
        """Seeded initial weights (identical on every backend) and zeroed optimiser state."""
        for name, value in init_parameters(self.plan, scheme, seed).items():
            self.backend.write(name, value)
        total = self.plan.total_params
        self.backend.write("grads:all", np.zeros(total, np.float32))
        for state in self.plan.state_names:
            self.backend.write(f"state:{state}", np.zeros(total, np.float32))
        if self.plan.loss_scale is not None:  # [scale, streak, skipped] (flow.optim.LOSS_SCALE)
            self.backend.write(LOSS_SCALE, np.array([self.plan.loss_scale, 0, 0], np.float32))
        self.refresh_copies()

    def refresh_copies(self, weights: np.ndarray | None = None, halves: np.ndarray | None = None) -> None:
        """Mixed precision: write the weights' float16 copies from their fp32 masters, after
        anything but the update wrote the masters (the update writes both; flow.weight_copies).
        numpy's astype(float16) rounds as cast.comp and the update kernels do, bit for bit.

        Args:
            weights: the flat masters just written, if the caller has them (else read back).
            halves: their float16 copies, if the caller made them already (one conversion for
                several engines).
        """
        if self.keeps_copies:
            if halves is None:
                masters = self.backend.read(PARAMS) if weights is None else weights
                halves = np.asarray(masters).astype(np.float16)
            self.backend.write(HALVES, halves)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter, copied back to the host."""
        return {p.name: self.backend.read(p.name) for p in self.plan.parameters}

    def state(self) -> dict[str, np.ndarray]:
        """Parameters and optimiser state as flat arrays (what a checkpoint stores)."""
        saved = {"params:all": self.backend.read("params:all")}
        for state in self.plan.state_names:
            saved[f"state:{state}"] = self.backend.read(f"state:{state}")
        if self.plan.loss_scale is not None:
            saved[LOSS_SCALE] = self.backend.read(LOSS_SCALE)
        return saved

    def load_state(self, saved: dict[str, np.ndarray]) -> None:
        """Restore what ``state`` returned, after checking that all of it fits this plan (see
        flow.optim.check_compatible), so a refused state leaves the device as it was.

        Raises:
            ValueError: naming the arrays that are missing, extra, or of the wrong type or size.
        """
        check_compatible(saved, self.plan.state_names, self.plan.total_params)
        for name, value in saved.items():
            if name != LOSS_SCALE or self.plan.loss_scale is not None:  # else: initialise's stays
                self.backend.write(name, value)
        self.refresh_copies(saved[PARAMS])

    # -- a data-parallel member's weights ---------------------------------------------------------
    def weights(self) -> np.ndarray:
        """The flat parameters (a host copy)."""
        return self.backend.read("params:all")

    def set_weights(self, weights: np.ndarray, halves: np.ndarray | None = None) -> None:
        """Replace the flat parameters (with the leader's, after its update); ``halves``: their
        float16 copies, when the caller made them (see refresh_copies)."""
        self.backend.write(PARAMS, weights)
        self.refresh_copies(weights, halves)

    # -- steps ----------------------------------------------------------------------------------
    def _handle(self, kind: str, slot: int) -> int:
        key = (kind, slot)
        if key not in self._handles:
            program = self.plan.program(kind)
            if kind == "train" and self.profiling:  # a timestamp before the first launch and after each
                pool = self._pools[slot] = self.backend.timestamp_pool(len(program.launches) + 1)
                self._handles[key] = self.backend.record(program, slot, timestamps=pool)
            else:
                self._handles[key] = self.backend.record(program, slot)
        return self._handles[key]

    # -- RunSettings(profile=True) ------------------------------------------------------------------
    def profile(self, on: bool = True) -> None:
        """Time each launch of the train program from now on (before :meth:`prepare`), where the
        backend has timestamp queries (:attr:`profiling` says whether it does)."""
        self.profiling = on and callable(getattr(self.backend, "timestamp_pool", None))

    def note_step(self, slot: int) -> None:
        """Keep the launch times of the train step just completed on ``slot`` (profiling only)."""
        pool = self._pools.get(slot)
        if pool is not None:
            self._launch_ns.append(np.diff(self.backend.read_timestamps_ns(pool)))

    @property
    def profiled_steps(self) -> int:
        """The train steps whose launch times :meth:`note_step` kept."""
        return len(self._launch_ns)

    def launch_times(self) -> tuple[tuple[str, str, float], ...]:
        """(``<position>:<op>``, op, median seconds) per launch of the train program, over the
        steps :meth:`note_step` kept; () before any."""
        if not self._launch_ns:
            return ()
        medians = np.median(np.stack(self._launch_ns), axis=0) / 1e9
        launches = self.plan.program("train").launches
        timed = zip(launches, medians, strict=True)
        return tuple((f"{i}:{item.op}", item.op, float(t)) for i, (item, t) in enumerate(timed))

    def prepare(self, kinds: tuple[str, ...] = ("train", "eval", "predict")) -> None:
        """Record the programs of ``kinds`` for every slot up front, so no step records: with
        these, every batch the run can send (any row count) has its program ready."""
        for kind in kinds:
            for slot in range(self.slots):
                self._handle(kind, slot)

    def _check_rows(self, rows: int) -> None:
        if not 1 <= rows <= self.plan.batch_size:
            raise ValueError(f"batch of {rows} rows; this plan takes 1..{self.plan.batch_size}")

    def write_batch(self, slot: int, x: np.ndarray, y: np.ndarray | None = None) -> int:
        """Copy a batch into a slot's io tensors; returns its row count. A partial batch is padded
        with zero rows: the programs run on the full batch, and zeros keep the padding's
        gradients exactly 0 (stale rows could hold a NaN, and 0 * NaN is NaN)."""
        rows = int(x.shape[0])
        self._check_rows(rows)
        self._check_ids(x)
        if rows < self.plan.batch_size:
            padded = np.zeros((self.plan.batch_size, *x.shape[1:]), np.float32)
            padded[:rows] = x
            x = padded
        self.backend.write("x", x, slot)  # the backend picks how to move a large array
        if y is not None:
            views = self._views[slot]
            flat = np.asarray(y).reshape(-1)
            if views is not None and flat.size <= views.y.size:
                views.y[: flat.size] = flat  # a shorter write fills a prefix, as backend.write does
            else:
                self.backend.write("y", y, slot)
        return rows

    def submit(
        self, kind: str, slot: int, rows: int, step: int | None = None, divisor: int | None = None
    ) -> int:
        """Submit a recorded program on a slot whose batch is already written; returns a ticket.

        Args:
            kind: ``train``, ``eval`` or ``predict``; a data-parallel member's ``apply``.
            slot: the input slot.
            rows: the batch's real rows (1..batch_size).
            step: the update's 0-based index (``train`` and ``apply`` only).
            divisor: the rows the loss averages over (None: ``rows``; a data-parallel member's
                shard: the global batch's).
        """
        return self.backend.submit(self.stage(kind, slot, rows, step, divisor))

    def stage(
        self, kind: str, slot: int, rows: int, step: int | None = None, divisor: int | None = None
    ) -> int:
        """Everything :meth:`submit` does but the submission: write the step values (its
        arguments) and return the slot's recorded program, for :meth:`submit_staged`."""
        self.set_step(kind, slot, rows, step, divisor)
        return self._handle(kind, slot)

    def submit_staged(self, handles: tuple[int, ...]) -> list[int]:
        """Submit programs :meth:`stage` (or ``stage_*``) returned, in order, at once; returns
        one ticket per program."""
        return self.backend.submit_group(handles)

    def set_step(
        self, kind: str, slot: int, rows: int, step: int | None = None, divisor: int | None = None
    ) -> None:
        """Write the step values :meth:`submit` writes (its arguments), before :meth:`submit_part`."""
        self._check_rows(rows)
        updates = kind in ("train", "apply")
        if updates:
            assert step is not None, "a train step needs its step index"
        values = step_values(self.plan.optimiser, step if updates else None, rows, divisor)
        views = self._views[slot]
        if views is not None:
            views.stepvals[:] = values
        else:
            self.backend.write("stepvals", values, slot)

    def submit_part(self, part: Program, slot: int) -> int:
        """Submit one part of a program cut into parts (flow.parallel_plan.train_parts; each
        recorded on first use), after :meth:`set_step`; returns its ticket."""
        key = (part.name, slot)
        if key not in self._handles:
            self._handles[key] = self.backend.record(part, slot)
        return self.backend.submit(self._handles[key])

    # -- a dataset kept on the device -------------------------------------------------------------
    def upload_dataset(self, x: np.ndarray, labels: np.ndarray) -> None:
        """Put the plan's resident dataset on the device once: the samples as stored (uint8 stays
        uint8), their labels and the fused preprocessing (DevicePlan.resident).

        Args:
            x: every sample [n, *sample_shape], as the source stores them (loaders StoredData.x).
            labels: every label [n].
        """
        resident = self.plan.resident
        if resident is None:
            raise ValueError("this plan keeps no dataset on the device")
        if x.shape != (resident.samples, *resident.sample_shape) or x.dtype != np.dtype(resident.dtype):
            raise ValueError(
                f"dataset of {x.dtype} {x.shape}; the plan keeps {resident.dtype} "
                f"{(resident.samples, *resident.sample_shape)}"
            )
        if self.vocabulary is not None:  # once, on the ids the model sees (the fused preprocessing applied)
            scale, shift = np.asarray(resident.affine, np.float32).reshape(-1, 2).T
            shape = [1] * x.ndim
            shape[1] = len(scale)
            scale, shift = scale.reshape(shape), shift.reshape(shape)
            for start in range(0, len(x), 65536):  # in parts: a float copy of a big set costs memory
                self._check_ids(x[start : start + 65536].astype(np.float32) * scale + shift, start)
        self.backend.write("data:x", x)
        self.backend.write("data:y", np.asarray(labels, np.int32))
        self.backend.write("data:affine", np.asarray(resident.affine, np.float32))
        self._idx_views = [self._view("idx", slot) for slot in range(self.slots)]

    def _view(self, tensor: str, slot: int) -> np.ndarray | None:
        """A view of ``tensor``'s memory in ``slot``, or None where the backend maps no memory."""
        write_into = getattr(self.backend, "write_into", None)
        return write_into(tensor, slot) if write_into is not None else None

    def submit_indices(self, kind: str, slot: int, indices: np.ndarray, step: int | None = None) -> int:
        """Submit a batch of the resident dataset by its sample indices: the program's first
        launch gathers the rows. The index slots past the batch get 0, a real sample, so the
        padding rows are finite (the loss ignores them).

        Args:
            kind: ``train`` or ``eval``.
            slot: the input slot.
            indices: the batch's sample indices (1..batch_size of them).
            step: the update's 0-based index (``train`` only).

        Returns:
            The program's ticket.
        """
        return self.backend.submit(self.stage_indices(kind, slot, indices, step))

    def stage_indices(self, kind: str, slot: int, indices: np.ndarray, step: int | None = None) -> int:
        """:meth:`submit_indices` but the submission (see :meth:`stage`)."""
        return self.stage(kind, slot, self.write_indices(slot, indices), step)

    def write_indices(self, slot: int, indices: np.ndarray) -> int:
        """Write a batch's sample indices into a slot (see :meth:`submit_indices`); returns its rows."""
        rows = int(len(indices))
        self._check_rows(rows)
        view = self._idx_views[slot]
        if view is not None:
            view[:rows] = indices
            view[rows:] = 0
        else:
            padded = np.zeros(self.plan.batch_size, np.int32)
            padded[:rows] = indices
            self.backend.write("idx", padded, slot)
        return rows

    def submit_filled(self, kind: str, slot: int, rows: int, step: int | None = None) -> int:
        """Submit on a slot whose batch a producer wrote through :meth:`input_views`: first the
        DMA upload of the staged inputs where the backend stages them (the program is ordered
        after it by the backend), then the program; returns the program's ticket. The rows past
        ``rows`` are zeroed first, as :meth:`write_batch` pads."""
        return self.backend.submit(self.stage_filled(kind, slot, rows, step))

    def stage_filled(self, kind: str, slot: int, rows: int, step: int | None = None) -> int:
        """:meth:`submit_filled` but the program's submission (see :meth:`stage`): the upload is
        queued now, and the program, submitted later, runs after it."""
        self._check_rows(rows)
        if self.vocabulary is not None:
            staged = self._staged and self.backend.staging_view("x", slot)  # type: ignore[attr-defined]
            self._check_ids((staged if self._staged else self._views[slot].x)[:rows])  # type: ignore[union-attr]
        if rows < self.plan.batch_size:
            if self._staged:
                self.backend.staging_view("x", slot)[rows:] = 0  # type: ignore[attr-defined]
            else:
                self._views[slot].x[rows:] = 0  # type: ignore[union-attr]
        if self._staged:
            self.backend.upload("x", slot)  # type: ignore[attr-defined]
        return self.stage(kind, slot, rows, step)

    def loss_and_correct(self, slot: int) -> tuple[float, float]:
        """The finished program's loss and correct count on ``slot`` (NaN count for regression).

        Args:
            slot: the slot whose program is done.

        Returns:
            (loss, correct).
        """
        views = self._views[slot]
        if views is not None:
            loss = float(views.loss[0])
            return loss, float(views.correct[0]) if self.has_accuracy else float("nan")
        loss = float(self.backend.read("loss", slot)[0])
        return loss, float(self.backend.read("correct", slot)[0]) if self.has_accuracy else float("nan")

    def metric_values(self, slot: int) -> tuple[float, ...]:
        """The finished program's on-device metric values on ``slot`` (flow.metrics), read as the
        loss is: no extra wait."""
        views = self._views[slot]
        if views is not None:
            return tuple(float(m[0]) for m in views.metrics)
        return tuple(float(self.backend.read(name, slot)[0]) for name in self.metric_tensors)

    def result(self, slot: int, step: int, rows: int) -> StepResult:
        """Loss and correct count of the finished program on ``slot``."""
        loss, correct = self.loss_and_correct(slot)
        return StepResult(step=step, loss=loss, correct=correct, rows=rows)

    def outputs(self, slot: int, rows: int) -> np.ndarray:
        """The predict program's output rows on ``slot``."""
        return self.backend.read("output", slot)[:rows]

    def train_step(self, x: np.ndarray, y: np.ndarray, step: int, slot: int = 0) -> StepResult:
        """One synchronous training step (tests and simple scripts)."""
        rows = self.write_batch(slot, x, y)
        self.backend.wait(self.submit("train", slot, rows, step))
        return self.result(slot, step, rows)

    def evaluate(self, x: np.ndarray, y: np.ndarray, slot: int = 0) -> StepResult:
        rows = self.write_batch(slot, x, y)
        self.backend.wait(self.submit("eval", slot, rows))
        return self.result(slot, -1, rows)

    def predict(self, x: np.ndarray, slot: int = 0) -> np.ndarray:
        rows = self.write_batch(slot, x)
        self.backend.wait(self.submit("predict", slot, rows))
        return self.outputs(slot, rows)
