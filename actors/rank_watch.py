"""A rank that dies (kill -9, the kernel's OOM killer, a crash in native code) named in vkflow's words
by the ranks that survive it, before the launcher ends the job (actors.collective.Ranks starts it).

Why the launcher is too quick: MPICH's hydra proxy ends the whole job (SIGKILL to every rank) as
soon as it learns that a rank died: when the rank's PMI socket closes, or, at the proxy's next event
(the dead rank's stdout closing is one), when ``waitpid`` says a signal killed it. That is a few
milliseconds after the death, far sooner than the survivors' next collective times out, so the only
word of it was hydra's, naming a process id. ``mpiexec -disable-auto-cleanup`` does not help: the
proxy then sends the survivors SIGUSR1 (which ends a process that does not catch it), and its
``waitpid`` check still kills them all (measured: the line was lost in 1 of 3 such runs).

Two parts:

- The survivors learn at once (:class:`PeerWatch`). Rank 0 holds a TCP connection to every other
  rank, their addresses exchanged in the start's one allgather. A thread on each end waits on them:
  a connection that closes without a goodbye (sent at a clean exit and before vkflow aborts the job
  itself) is a rank that died, and the thread prints ``vkflow: rank 0 of 2: rank 1 (pid 612 on vm)
  died ...`` and aborts the job. Rank 0 sees every rank; every rank sees rank 0. It works across
  hosts where rank 0's host name resolves to an address the others reach.
- The launcher learns late (:class:`Sentinel`, hydra only). A small shell process, started before
  MPI, holds this rank's stdout, stderr and PMI socket (``PMI_FD``). When the rank dies without a
  goodbye, it keeps them open ``HOLD_S`` longer, so the proxy sees no event of the death until a
  survivor speaks: the survivor's line is forwarded first, then hydra ends the job as before, with a
  non-zero exit status. Past ``HOLD_S``, the job ends in hydra's words, as without vkflow. Measured
  with 2 ranks on one 2-core machine running the test suite beside them: without the sentinel the
  line was lost in 1 of 10 runs, with it in none of 25.

Open MPI is not given that time: its daemon learns of the death from SIGCHLD on its own child and
ends the job at once, naming "process rank 1" itself; no sentinel is started there (no ``PMI_FD``)
and the watch thread's line may or may not come out first. (Not measured here: CI runs MPICH.)
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Mapping

# Why 3 s: the survivors' watch threads print within milliseconds of the death (a socket's end of
# file wakes them), loaded machines included; the hold only delays a job's end after a death.
HOLD_S = 3
GOODBYE = b"bye\n"
CONNECT_S = 60.0  # the longest the ranks' connections to rank 0 may take at the start


class Sentinel:
    """A child process holding this rank's stdout, stderr and PMI socket for ``HOLD_S`` after the
    rank dies (see the module docstring); :meth:`release` at a clean exit lets it go at once.

    Args:
        pmi_fd: the PMI socket hydra gave this rank (``PMI_FD``).
    """

    def __init__(self, pmi_fd: int) -> None:
        read, self._write = os.pipe()  # a clean exit writes the goodbye; a death closes it unsaid
        script = f'read -r said; [ "$said" = bye ] || sleep {HOLD_S}'
        self._process = subprocess.Popen(["/bin/sh", "-c", script], stdin=read, pass_fds=(pmi_fd,))
        os.close(read)
        atexit.register(self.release)

    def release(self) -> None:
        if self._write < 0:
            return
        try:
            os.write(self._write, GOODBYE)
            os.close(self._write)
            self._process.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            pass  # it ends on its own, at the latest HOLD_S after this process
        self._write = -1


def sentinel_for(environ: Mapping[str, str]) -> Sentinel | None:
    """A :class:`Sentinel` when hydra started this process (it names the PMI socket), else None."""
    fd = environ.get("PMI_FD", "")
    try:
        return Sentinel(int(fd)) if fd.isdigit() else None
    except OSError:  # no shell, or the socket is gone: the job ends in the launcher's words
        return None


def _local_address() -> tuple[str, socket.socket]:
    listener = socket.create_server(("", 0))
    return f"{socket.gethostname()}:{listener.getsockname()[1]}", listener


class PeerWatch:
    """Rank 0's connection to every other rank, watched on both ends (see the module docstring).

    Args:
        rank: this rank.
        size: the number of ranks.
        on_death: called (on the watch thread) with the rank that died.
    """

    def __init__(self, rank: int, size: int, on_death: Callable[[int], None]) -> None:
        self.rank, self.size, self.on_death = rank, size, on_death
        self.address, self._listener = _local_address() if rank == 0 else ("", None)
        self._peers: dict[socket.socket, int] = {}
        self._leaving = False

    def start(self, address_of_0: str) -> str | None:
        """Connect to rank 0 (rank 0: accept the others' connections on the watch thread) and watch.

        Args:
            address_of_0: ``host:port`` of rank 0's listener.

        Returns:
            None, or why this rank could not reach rank 0 (then only the deadline names a death).
        """
        if self.rank != 0:
            host, port = address_of_0.rsplit(":", 1)
            try:
                peer = socket.create_connection((host, int(port)), timeout=CONNECT_S)
                peer.sendall(struct.pack("<i", self.rank))
            except OSError as error:
                return f"rank {self.rank} cannot reach rank 0 at {address_of_0} ({error})"
            peer.settimeout(None)
            self._peers[peer] = 0
        threading.Thread(target=self._watch, name="vkflow peer watch", daemon=True).start()
        atexit.register(self.goodbye)
        return None

    def goodbye(self) -> None:
        """Tell the others this rank leaves on purpose (a clean exit, or an abort vkflow decided)."""
        self._leaving = True
        for peer in list(self._peers):
            try:
                peer.sendall(GOODBYE)
            except OSError:
                pass  # that one has gone already

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        listener.settimeout(CONNECT_S)
        try:
            while len(self._peers) < self.size - 1:
                peer, _ = listener.accept()
                peer.settimeout(CONNECT_S)
                (rank,) = struct.unpack("<i", peer.recv(4, socket.MSG_WAITALL))
                peer.settimeout(None)
                self._peers[peer] = rank
        except (OSError, struct.error):
            pass  # a rank that never connected: the deadline still names it
        listener.close()

    def _watch(self) -> None:
        if self._listener is not None:
            self._accept()
        selector = selectors.DefaultSelector()
        for peer in self._peers:
            selector.register(peer, selectors.EVENT_READ)
        said: dict[socket.socket, bytes] = dict.fromkeys(self._peers, b"")
        while selector.get_map():
            for key, _ in selector.select():
                peer = key.fileobj
                assert isinstance(peer, socket.socket)
                try:
                    data = peer.recv(64)
                except OSError:
                    data = b""
                said[peer] += data
                if data and GOODBYE not in said[peer]:
                    continue
                selector.unregister(peer)
                if GOODBYE not in said[peer] and not self._leaving:
                    self.on_death(self._peers[peer])
                    return
