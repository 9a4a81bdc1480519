"""The other ranks of an MPI job, as a data-parallel run needs them: the sum of every rank's
gradients (and step sums: loss, correct rows), an agreement check, and a digest of the weights
compared across ranks (flow.parallel_plan describes the run; actors.data_parallel calls these).

Why one thread: every MPI call runs on one dedicated OS thread (:class:`MpiThread`), started on
first use. It imports mpi4py, which initialises MPI, and finalises MPI at exit, since MPI wants
both on the same thread. Callers (the device actor's worker thread, the runtime's setup) hand it a
function and wait on a Future, so the trio event loop never blocks on another rank, and MPI sees
a single thread however many trio workers come and go. mpi4py is imported only here, only when a
launcher started several ranks (flow.parallel_plan.world_from_env), so a single-process run never
loads it.

Why not ``MPI.SUM``: MPI leaves the order of a reduction to the implementation (its algorithm,
message sizes, topology), so a float sum may change with the rank count or the library. vkflow fixes
the order itself, as a ring all-reduce moves the data: each bucket (its float64 step sums, then its
float32 gradients) is cut into one slice per rank (:func:`slice_bounds`); an Alltoallv hands rank r
slice r of every rank (and every rank's step sums, a few bytes); rank r adds them in rank order
0, 1, ..., N - 1; an Allgatherv hands every rank every summed slice. Each rank computes the same
bits, and they are the bits of one process whose members sum in that order (one member per rank:
``mpiexec -n 2`` on ``"cpu"`` trains bit for bit as one process on ``["cpu", "cpu"]``), since each
element's sum is its own. Each rank sends and receives 2 (N - 1) / N times the bucket, as a ring.

Why non-blocking: where the library is MPI-3 (``Ialltoallv``, ``Iallgatherv``), :meth:`Ranks.start_sum`
posts the bucket's Alltoallv and returns, so several buckets are in flight while the devices run
the backward pass; the MPI thread tests the requests in flight while it has nothing else to do
(MPI libraries move a non-blocking collective only inside an MPI call), and :meth:`Ranks.finish_sum`
waits on that thread. Elsewhere, or with ``VKFLOW_MPI_BLOCKING=1``, the blocking calls run in the
same order; ``Ranks.exchange`` says which, and rank 0 prints it at the start.

Why a deadline: a rank that hangs or died leaves the others waiting in their next collective for
ever. A collective unanswered within ``World.deadline_s`` prints which ranks are missing and aborts
the whole job (``MPI_Abort``, legal from any thread: mpi4py asks for MPI_THREAD_MULTIPLE).

Who is missing: a blocking collective cannot say who has not joined it, so once the deadline has
passed, the waiting thread (its MPI thread still blocked) probes every other rank with non-blocking
messages on a communicator of their own (a ``Dup`` of the world's, made at the start) and names the
ranks that send none within a grace period: the others wait too and probe back, as their own
deadlines pass. Nothing is sent while the ranks keep up, so a step costs nothing more. A rank that
dies is named at once, without a deadline, by actors.rank_watch: rank 0 holds a socket to every
other rank, and under MPICH's hydra each rank's sentinel keeps the launcher from ending the job
before a survivor has said which rank died (Open MPI ends it first, naming the rank itself).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from actors.rank_watch import PeerWatch, Sentinel, sentinel_for
from flow.parallel_plan import World, divergence

ABORT_CODE = 3  # the exit status of every rank of a job aborted by vkflow
# Why wait before aborting: the launcher forwards a rank's stderr through its proxies, and an abort
# that tears the job down at once loses the line that says why (seen with MPICH's hydra).
FORWARD_S = 1.0
PROBE_TAG = 7  # the probes' messages, on the probe communicator (see the module docstring)
POLL_S = 0.0005  # how often the idle MPI thread tests the requests in flight


class RanksError(RuntimeError):
    """The ranks disagree (a different spec or start, weights that drifted apart) or stopped
    answering; the message names the ranks.

    Attributes:
        everywhere: every rank found it (a comparison all of them made), so each stops on its own
            and none needs to abort the job.
    """

    def __init__(self, message: str, everywhere: bool = True) -> None:
        super().__init__(message)
        self.everywhere = everywhere


def _silent(missing: list[int] | None, seconds: float, what: str) -> str:
    """Who did not answer ``what`` within ``seconds``, as :meth:`Ranks.missing` found them."""
    if missing is None:
        return f"the other ranks did not answer within {seconds:g} s ({what})"
    if not missing:
        return f"every rank answered a probe, yet {what} did not finish within {seconds:g} s"
    many = len(missing) > 1
    named = f"rank{'s' if many else ''} {', '.join(map(str, missing))}"
    return f"{named} did not answer within {seconds:g} s ({what}): {'they' if many else 'it'} died or hung"


def slice_bounds(count: int, ranks: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into ``ranks`` contiguous slices, the first ``count % ranks`` one
    element longer (some empty when ``count < ranks``).

    Returns:
        Each rank's [start, stop), in rank order.
    """
    base, extra = divmod(count, ranks)
    stops = np.cumsum([base + (r < extra) for r in range(ranks)], dtype=np.int64)
    return [(int(stop - base - (r < extra)), int(stop)) for r, stop in enumerate(stops)]


def pack(grads: np.ndarray, sums: tuple[float, ...], bounds: list[tuple[int, int]]) -> tuple:
    """The bytes a rank sends in the Alltoallv: for each rank r in turn, ``sums`` (float64), then
    slice r of ``grads`` (float32).

    Returns:
        (the buffer, (its bytes for each rank, their offsets)).
    """
    head = np.asarray(sums, np.float64).view(np.uint8)
    grads = np.ascontiguousarray(grads, np.float32)
    pieces = [piece for a, b in bounds for piece in (head, grads[a:b].view(np.uint8))]
    counts = [head.size + 4 * (b - a) for a, b in bounds]
    return np.concatenate(pieces), (counts, np.cumsum([0, *counts[:-1]]).tolist())


def add_in_rank_order(
    rows: np.ndarray, head: int, count: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, tuple[float, ...]]:
    """A rank's received slices (one row per rank: ``head`` bytes of ``count`` float64 sums, then
    float32 gradients) added in rank order.

    Args:
        rows: the slices.
        head: the bytes of the sums.
        count: how many sums.
        out: where the slice's sum goes (default: a new array).

    Returns:
        (the slice's sum, the sums' sums).
    """
    first = rows[0, head:].view(np.float32)
    total = np.empty_like(first) if out is None else out
    np.copyto(total, first)
    for row in rows[1:]:
        total += row[head:].view(np.float32)
    totals = [0.0] * count
    for row in rows:
        totals = [t + float(s) for t, s in zip(totals, row[:head].view(np.float64), strict=True)]
    return total, tuple(totals)


class MpiThread:
    """One OS thread that makes every MPI call of the process (see the module docstring).

    Attributes:
        in_flight: the non-blocking requests it tests while idle (only this thread touches them).
    """

    def __init__(self) -> None:
        self.in_flight: list = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="vkflow mpi", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=POLL_S if self.in_flight else None)
            except queue.Empty:
                self.in_flight = [request for request in self.in_flight if not request.Test()]
                continue
            if job is None:
                return
            fn, args, future = job
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to the caller, who raises it
                future.set_exception(error)

    def post(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` for the MPI thread, which runs its jobs in the order posted.

        Returns:
            The future of what ``fn`` returns.
        """
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` on the MPI thread and wait for it (blocking).

        Args:
            fn: the function.
            *args: its arguments.
            timeout: seconds to wait at most (None: for ever).

        Returns:
            What ``fn`` returned.

        Raises:
            TimeoutError: no answer within ``timeout`` (the call goes on on the MPI thread).
        """
        return self.post(fn, *args).result(timeout)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)


_thread: MpiThread | None = None
_sentinel: Sentinel | None = None  # holds this rank's pipes past a death (actors.rank_watch)
_MPI: Any = None  # mpi4py's MPI module, once the thread has imported it
_guard = threading.Lock()


def _initialise():
    import mpi4py

    mpi4py.rc.finalize = False  # on this thread, at exit: _finalise
    from mpi4py import MPI

    return MPI


def _finalise() -> None:
    if _thread is None:
        return
    try:
        _thread.call(lambda: _thread.in_flight.clear() or _MPI.Is_finalized() or _MPI.Finalize(), timeout=30)
    finally:
        _thread.stop()


def mpi_thread() -> MpiThread:
    """The process's MPI thread, started (and MPI initialised on it) on the first call.

    Returns:
        The thread.
    """
    global _thread, _MPI, _sentinel
    with _guard:
        if _thread is None:
            _sentinel = sentinel_for(os.environ)  # before MPI opens sockets it would inherit
            thread = MpiThread()
            _MPI = thread.call(_initialise)
            _thread = thread
            atexit.register(_finalise)
        return _thread


class Ranks:
    """This rank's link to the others (blocking calls; each runs on the MPI thread).

    Args:
        world: where this process stands, as the launcher's environment says.
        thread: the MPI thread (default: the process's).

    Raises:
        RanksError: MPI's rank and size are not the environment's.
    """

    def __init__(self, world: World, thread: MpiThread | None = None) -> None:
        self.world = world
        self.thread = thread or mpi_thread()
        self.comm = self.thread.call(lambda: _MPI.COMM_WORLD)
        self.probe: Any = None
        self.watch = PeerWatch(self.rank, world.size, self._died)  # abort() tells it
        found = (self.thread.call(self.comm.Get_rank), self.thread.call(self.comm.Get_size))
        if found != (world.rank, world.size):
            raise RanksError(f"MPI says rank {found[0]} of {found[1]}, the launcher's environment "
                             f"rank {world.rank} of {world.size}")  # fmt: skip
        self.probe = self._call("the start", self.comm.Dup)
        blocking = os.environ.get("VKFLOW_MPI_BLOCKING") == "1" or self.thread.call(_MPI.Get_version) < (3, 0)
        self.exchange = "Alltoallv + Allgatherv" if blocking else "non-blocking Ialltoallv + Iallgatherv"
        here = (f"pid {os.getpid()} on {socket.gethostname()}", self.watch.address, self.exchange)
        self.pids, addresses, exchanges = zip(*self.gather(here, "the ranks' process ids"), strict=True)
        if len(set(exchanges)) > 1:  # a blocking collective never matches a non-blocking one
            raise RanksError(f"the ranks would exchange gradients differently: {', '.join(exchanges)} "
                             "(set VKFLOW_MPI_BLOCKING alike on every rank)")  # fmt: skip
        if self.rank == 0:  # a launcher that stops the job when a rank dies names the rank's pid
            named = ", ".join(f"rank {r} is {p}" for r, p in enumerate(self.pids))
            print(f"vkflow: {named}\nvkflow: gradients summed over the ranks by {self.exchange}",
                  file=sys.stderr)  # fmt: skip
        unreachable = self.watch.start(addresses[0])
        if unreachable:
            print(f"vkflow: {unreachable}: a rank that dies is named at the deadline only", file=sys.stderr)

    @property
    def rank(self) -> int:
        return self.world.rank

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self._wait(what, self.thread.post(fn, *args))

    def _wait(self, what: str, future: Future) -> Any:
        try:
            return future.result(self.world.deadline_s)
        except TimeoutError:
            # The grace covers the others' deadlines passing later (they joined later), not a
            # rank's whole deadline: a tenth of it, within [1 s, 10 s].
            missing = self.missing(min(max(self.world.deadline_s / 10, 1.0), 10.0))
            silent = _silent(missing, self.world.deadline_s, what)
            message = f"vkflow: rank {self.rank} of {self.world.size}: {silent}; aborting the MPI job"
            self.abort(message)
            raise RanksError(message, everywhere=False) from None

    def _died(self, rank: int) -> None:
        here = f"rank {self.rank} of {self.world.size}"
        self.abort(f"vkflow: {here}: rank {rank} ({self.pids[rank]}) died: its connection to rank "
                   f"{self.rank} closed without a goodbye; aborting the MPI job")  # fmt: skip

    def missing(self, grace: float) -> list[int] | None:
        """The other ranks that send no probe within ``grace`` seconds, probing them all on this
        thread (see the module docstring); None if the probe itself failed."""
        if self.probe is None:
            return None
        others = [rank for rank in range(self.world.size) if rank != self.rank]
        here, boxes = np.full(1, self.rank, np.int64), np.empty((self.world.size, 1), np.int64)
        try:
            self._sent = [self.probe.Isend(here, dest=rank, tag=PROBE_TAG) for rank in others]
            replies = {rank: self.probe.Irecv(boxes[rank], source=rank, tag=PROBE_TAG) for rank in others}
            until = time.monotonic() + grace
            while replies and time.monotonic() < until:
                replies = {rank: reply for rank, reply in replies.items() if not reply.Test()}
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - an MPI failure: fall back to naming nobody
            return None
        return sorted(replies)

    def abort(self, message: str, code: int = ABORT_CODE) -> None:
        """Print ``message``, then stop every rank of the job (MPI_Abort), from any thread."""
        self.watch.goodbye()  # the others' watch threads leave the word to this line
        if _sentinel is not None:
            _sentinel.release()
        # One write with its newline: the launcher forwards each rank's stderr as it comes, so a
        # separate newline lets another rank's message join this line.
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        time.sleep(FORWARD_S)
        self.comm.Abort(code)

    def gather(self, value: Any, what: str) -> list:
        """Every rank's ``value`` (small, picklable), in rank order.

        Args:
            value: this rank's.
            what: what is gathered, for the error should the others not answer.

        Returns:
            The values.
        """
        return self._call(what, self.comm.allgather, value)

    def agree(self, value: Any, what: str) -> None:
        """Check that every rank holds the same ``value``.

        Raises:
            RanksError: naming the ranks whose value differs from rank 0's, and the values.
        """
        values = self.gather(value, what)
        differ = [rank for rank, other in enumerate(values) if other != values[0]]
        if differ:
            raise RanksError(f"ranks {differ} differ from rank 0 in {what}: {values[differ[0]]!r} against "
                             f"{values[0]!r}")  # fmt: skip

    def sum_in_rank_order(
        self, grads: np.ndarray, sums: tuple[float, ...], what: str
    ) -> tuple[np.ndarray, tuple[float, ...]]:
        """Every rank's ``grads`` (float32) and ``sums`` (float64) added in rank order (see the
        module docstring): reduce-scatter by Alltoallv, then Allgatherv.

        Args:
            grads: this rank's partial sum (any length, the same on every rank; may be empty).
            sums: this rank's step sums (loss, correct rows, ...).
            what: the step, for the error should the others not answer.

        Returns:
            (the gradients' sum, the sums' sums), the same bits on every rank.
        """
        return self.finish_sum(self.start_sum(grads, sums, what))

    def start_sum(self, grads: np.ndarray, sums: tuple[float, ...], what: str) -> tuple:
        """Start :meth:`sum_in_rank_order` on the MPI thread and return at once (``grads`` is
        copied first, so the caller may reuse it): a gradient bucket's exchange goes on while the
        devices run the backward of the next. Every rank starts the same sums in the same order.

        Returns:
            What :meth:`finish_sum` takes.
        """
        bounds = slice_bounds(np.size(grads), self.world.size)
        send, sent = pack(grads, sums, bounds)
        a, b = bounds[self.rank]
        rows = np.empty((self.world.size, 8 * len(sums) + 4 * (b - a)), np.uint8)
        received = ([rows.shape[1]] * self.world.size, [r * rows.shape[1] for r in range(self.world.size)])
        future = self.thread.post(self._scatter, send, sent, rows, received)
        return future, send, rows, len(sums), bounds, what

    def _scatter(self, send: np.ndarray, sent: tuple, rows: np.ndarray, received: tuple) -> Any:
        """On the MPI thread: the Alltoallv, posted (its request) or done (None)."""
        if self.exchange.startswith("Alltoallv"):
            return self.comm.Alltoallv([send, sent, _MPI.BYTE], [rows, received, _MPI.BYTE])
        request = self.comm.Ialltoallv([send, sent, _MPI.BYTE], [rows, received, _MPI.BYTE])
        self.thread.in_flight.append(request)
        return request

    def _finish(self, request: Any, rows: np.ndarray, count: int, bounds: list) -> tuple:
        """On the MPI thread: wait for the Alltoallv, add this rank's slices in rank order and
        gather every rank's summed slice (non-blocking where the Alltoallv was)."""
        if request is not None:
            request.Wait()
            self.thread.in_flight = [other for other in self.thread.in_flight if other is not request]
        total, (a, b) = np.empty(bounds[-1][1], np.float32), bounds[self.rank]
        _, totals = add_in_rank_order(rows, 8 * count, count, out=total[a:b])  # in place: no copy
        if total.size:
            layout = [total, ([b - a for a, b in bounds], [a for a, _ in bounds]), _MPI.FLOAT]
            if request is None:
                self.comm.Allgatherv(_MPI.IN_PLACE, layout)
            else:
                self.comm.Iallgatherv(_MPI.IN_PLACE, layout).Wait()
        return total, totals

    def finish_sum(self, started: tuple) -> tuple[np.ndarray, tuple[float, ...]]:
        """Wait for a sum :meth:`start_sum` started (aborting the job past the deadline), add
        this rank's slice of every rank in rank order, and gather the summed slices.

        Returns:
            (the gradients' sum, the sums' sums), the same bits on every rank.
        """
        future, _send, rows, count, bounds, what = started  # the send buffer lives until here
        return self._call(what, self._finish, self._wait(what, future), rows, count, bounds)

    def check_weights(self, weights: np.ndarray, step: int) -> None:
        """Compare a digest of this rank's weights with every other rank's.

        Args:
            weights: the flat parameters.
            step: the training steps done, for the message.

        Raises:
            RanksError: naming the ranks whose weights differ from rank 0's.
        """
        digest = hashlib.sha256(np.ascontiguousarray(weights).tobytes()).digest()
        digests = self.gather(digest, f"the weights' digest after step {step}")
        differ = divergence(digests)
        if differ:
            raise RanksError(
                f"the weights of rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                f"differ from rank 0's after step {step}: the ranks no longer train one model "
                "(devices that round differently, or a rank that missed an update)"
            )
