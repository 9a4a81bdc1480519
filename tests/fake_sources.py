"""Sources of the tests' own making, for the loader's inline/thread decisions."""

from __future__ import annotations

import threading
import time

import numpy as np


class CostlySource:
    """Reads that burn ``cost`` seconds of CPU, noting whether each ran on the event loop's thread;
    ``in_memory`` is what the source declares to the loader (actors.loader pins such reads inline)."""

    def __init__(self, cost: float, in_memory: bool = False) -> None:
        self.cost = cost
        self.in_memory = in_memory
        self.on_loop: list[bool] = []

    def read(self, indices):
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        end = time.thread_time() + self.cost
        while time.thread_time() < end:
            pass
        return np.zeros((len(indices), 2), np.float32), np.zeros(len(indices), np.int32), 0
