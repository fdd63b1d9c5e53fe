"""End-to-end processing latency (nsqd's ``--e2e-processing-latency-percentile``): pure.

Theory of operation
-------------------
A channel records, for every message a client FINs, the time from its
publish (the timestamp in NSQ's message encoding) to the FIN, as nsqd does.
As in nsqd, the window (``--e2e-processing-latency-window-time``) is two
halves: observations go to the current half; when half a window has
passed, the older half is dropped and a new one starts, so what is reported
covers between half a window and a whole one.

nsqd keeps a targeted-quantile stream per half.  Here each half keeps a
uniform sample (reservoir sampling with Li's Algorithm L, at most
:data:`SAMPLES` values) and the
count of what it saw; a percentile is read from the samples of both halves,
each sample weighted by how many observations it stands for.  A topic's
figures merge its channels' samples the same way (nsqd merges its channels'
streams).  Nothing of this runs unless percentiles were asked for.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

SAMPLES = 2048
"""Values kept per half window."""

E2E_SAMPLES = "_e2e_samples"
"""The key of a channel's stats that carries its weighted samples to its topic."""


class _Half:
    __slots__ = ("count", "next", "samples", "w")

    def __init__(self) -> None:
        self.count = 0
        self.samples: list[int] = []
        self.w = 1.0  # Algorithm L's running weight, once the reservoir is full
        self.next = 0  # the 1-based observation that replaces a sample next

class LatencyWindow:
    """Latencies in ns over the last window; :meth:`result` is nsqd's JSON object."""

    def __init__(self, quantiles: Sequence[float], window_ns: int,
                 clock: Callable[[], int] = time.time_ns, rng: random.Random | None = None,
                 samples: int = SAMPLES) -> None:
        self.quantiles = tuple(quantiles)
        self.half_ns = max(1, window_ns // 2)
        self.clock = clock
        self.rng = rng or random.Random()
        self.cap = samples
        self.halves = (_Half(), _Half())
        self.current = 0
        self.moved_at = clock()

    def _roll(self, now: int) -> _Half:
        if now - self.moved_at > self.half_ns:
            if now - self.moved_at > 2 * self.half_ns:  # idle for a whole window
                self.halves = (_Half(), _Half())
                self.moved_at = now
            else:
                self.current ^= 1
                self.halves[self.current].__init__()
                self.moved_at += self.half_ns
        return self.halves[self.current]

    def add_encoded(self, messages: Sequence[bytes]) -> None:
        """Record the messages (NSQ's encoding: an 8-byte ns timestamp first) as
        finished now.  Once a half's reservoir is full, only the observations that
        replace a sample are decoded (Li's Algorithm L: the gap to the next one is
        drawn, not a number per message), so a busy channel pays almost nothing."""
        now = self.clock()
        half = self._roll(now)
        samples, cap = half.samples, self.cap
        start = half.count
        room = cap - len(samples)
        if room > 0:
            samples.extend(now - int.from_bytes(m[:8], "big") for m in messages[:room])
            if len(samples) == cap:
                half.w = 1.0
                self._advance(half, cap)
        half.count = start + len(messages)
        while half.next and half.next <= half.count:
            m = messages[half.next - start - 1]
            samples[self.rng.randrange(cap)] = now - int.from_bytes(m[:8], "big")
            self._advance(half, half.next)

    def _advance(self, half: _Half, position: int) -> None:
        rng, cap = self.rng, self.cap
        half.w *= math.exp(math.log(1.0 - rng.random()) / cap)
        gap = math.floor(math.log(1.0 - rng.random()) / math.log1p(-half.w)) if half.w < 1 \
            else 0
        half.next = position + gap + 1

    def weighted(self) -> tuple[int, list[tuple[int, float]]]:
        """``(count, [(latency, weight), ...])`` over the window, for merging."""
        self._roll(self.clock())
        out: list[tuple[int, float]] = []
        count = 0
        for half in self.halves:
            if half.samples:
                weight = half.count / len(half.samples)
                out.extend((v, weight) for v in half.samples)
            count += half.count
        return count, out

    def result(self) -> dict[str, Any]:
        count, samples = self.weighted()
        return result(self.quantiles, count, samples)


def result(quantiles: Sequence[float], count: int,
           samples: list[tuple[int, float]]) -> dict[str, Any]:
    """nsqd's ``e2e_processing_latency``: ``{"count", "percentiles": [{"quantile",
    "value"}]}`` (values in ns; with no observation, each value is 0, as nsqd's)."""
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    percentiles = []
    for q in quantiles:
        value = 0
        if ordered:
            target, seen = q * total, 0.0
            value = ordered[-1][0]
            for v, w in ordered:
                seen += w
                if seen >= target:
                    value = v
                    break
        percentiles.append({"quantile": q, "value": value})
    return {"count": count, "percentiles": percentiles}
