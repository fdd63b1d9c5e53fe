"""How fast is this machine next to the one ``../shared/ANCHORS.md`` was measured on?

nsqd cannot run beside the broker here (no Go toolchain or nsqd binary), so
its figures come from ANCHORS.md, measured on another machine of "this kind".
Machines of one kind differ: the same Python peer can run twice as fast on
one as on another.  This module measures, in the same run as a benchmark,
two things ANCHORS.md also measured on its machine:

* queuelib's ``FifoDiskQueue`` push and pop of 100-byte messages (a Python
  library doing a ``write`` or ``read`` per message: Python work plus
  syscalls, like the broker); ANCHORS: 250,000 and 218,000 per second;
* one small ``write()`` syscall; ANCHORS: 2.6-4 µs.

The *speed factor* is the geometric mean of the two queuelib ratios.  A
figure divided by it is what this machine's result would be on the anchor
machine, to compare with nsqd's numbers there; both the raw and the
normalised ratio are printed, and neither is hidden.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass

ANCHOR_QUEUELIB_PUSH = 250_000
ANCHOR_QUEUELIB_POP = 218_000
ANCHOR_WRITE_US = (2.6, 4.0)


@dataclass(frozen=True)
class Speed:
    push: float  # queuelib pushes per second here
    pop: float
    write_us: float  # one 100-byte write() here

    @property
    def factor(self) -> float:
        """How many times faster than the anchor machine (geometric mean of push and pop)."""
        return ((self.push / ANCHOR_QUEUELIB_PUSH) * (self.pop / ANCHOR_QUEUELIB_POP)) ** 0.5

    def describe(self) -> str:
        return (f"calibration: queuelib push {self.push:,.0f}/s "
                f"({self.push / ANCHOR_QUEUELIB_PUSH:.2f}x ANCHORS' {ANCHOR_QUEUELIB_PUSH:,}), "
                f"pop {self.pop:,.0f}/s ({self.pop / ANCHOR_QUEUELIB_POP:.2f}x "
                f"{ANCHOR_QUEUELIB_POP:,}); write() {self.write_us:.2f} us "
                f"(ANCHORS {ANCHOR_WRITE_US[0]}-{ANCHOR_WRITE_US[1]} us); "
                f"speed factor {self.factor:.2f}")


def _queuelib_once(n: int) -> tuple[float, float]:
    from queuelib import FifoDiskQueue

    body = b"x" * 100
    with tempfile.TemporaryDirectory(prefix="calib") as d:
        q = FifoDiskQueue(os.path.join(d, "q"))
        t = time.perf_counter()
        for _ in range(n):
            q.push(body)
        push = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n):
            q.pop()
        pop = n / (time.perf_counter() - t)
        q.close()
    return push, pop


def _write_us(n: int) -> float:
    body = b"x" * 100
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, body)
        return (time.perf_counter() - t) / n * 1e6


def measure(n: int = 200_000, runs: int = 3) -> Speed | None:
    """Medians of `runs`; None when queuelib is not installed (``pip install -e '.[bench]'``)."""
    try:
        import queuelib  # noqa: F401
    except ImportError:
        return None
    results = [_queuelib_once(n) for _ in range(runs)]
    return Speed(statistics.median(r[0] for r in results),
                 statistics.median(r[1] for r in results),
                 statistics.median(_write_us(n) for _ in range(runs)))


if __name__ == "__main__":
    speed = measure()
    print(speed.describe() if speed else "queuelib is not installed: pip install -e '.[bench]'")
