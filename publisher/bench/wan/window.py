"""A TCP sender's congestion window over the simulated path, for the delaying relay.

The relay terminates TCP on both sides, so the real connections see a sub-millisecond round
trip and open their windows at once: without this model a fresh (or idle) transfer over the
simulated 40 ms link would start at full rate, which no real 40 ms path does. The model is the
part of Linux TCP that matters for a few-MB transfer across a WAN:

- slow start: ``initial_bytes`` (10 segments, RFC 6928) may leave in the first round trip, and
  the window doubles after every round trip in which it was used up (a sender that was not
  window-limited does not grow it, like Linux's ``tcp_is_cwnd_limited``);
- restart after idle (``tcp_slow_start_after_idle``): each RTO of silence halves the window,
  down to the initial window, and the slow-start threshold is raised to at least 3/4 of the
  window before it (``tcp_cwnd_restart``); the RTO is ``rtt + 200 ms`` (Linux's minimum RTO term);
- random loss (``loss``, the chance that one segment is lost): bytes granted with a lost
  segment among them are delivered one round trip late (the segment is resent after the
  duplicate acks, and TCP hands bytes over in order), and the window is cut to ``BETA`` of
  itself (CUBIC's factor), at most once per round trip (one recovery per window of data);
  past a loss the window grows by one segment per used-up round trip (congestion avoidance);
- the window stops growing at ``max_bytes``; the link rate (tbf) limits throughput long
  before that.

Invariant: ``grant`` never allows more than the current window per round trip, and is pure
bookkeeping on the times it is given and the random source it was handed (no clock of its
own), so it is tested without sleeping.
"""

from __future__ import annotations

import random

SEGMENT_BYTES = 1448
INITIAL_SEGMENTS = 10
MIN_RTO_S = 0.2
BETA = 0.7  # the window kept after a loss (CUBIC)
_EPSILON_S = 1e-6


def check_loss(loss: float, tcp_window: bool = True) -> None:
    """Raise ``ValueError`` unless ``loss`` is a segment's chance in [0, 1), and (when not 0)
    there is a TCP window to model it (``tcp_window``: slow start over a delay > 0)."""
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss is a segment's chance of being lost, in [0, 1), got {loss}")
    if loss and not tcp_window:
        raise ValueError("loss is modelled by the TCP window: it needs slow_start and a delay > 0")


class SlowStartWindow:
    def __init__(
        self,
        rtt_s: float,
        *,
        initial_bytes: int = INITIAL_SEGMENTS * SEGMENT_BYTES,
        max_bytes: int = 16 * 1024 * 1024,
        loss: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if rtt_s <= 0:
            raise ValueError(f"rtt_s must be > 0, got {rtt_s}")
        check_loss(loss)
        self.loss = loss
        self._rng = rng if rng is not None else random.Random()
        self.ssthresh = max_bytes  # slow start up to here; set by a loss
        self.losses = 0  # grants that carried a lost segment
        self._cut_round: float | None = None  # the round trip whose loss last cut the window
        self.rtt_s = rtt_s
        self.rto_s = rtt_s + MIN_RTO_S
        self.initial_bytes = initial_bytes
        self.max_bytes = max_bytes
        self.cwnd = initial_bytes
        self._round_start: float | None = None
        self._used = 0
        self._last_send: float | None = None

    def grant(self, now: float, wanted: int) -> tuple[float, int]:
        """``(at, n)``: ``n > 0`` bytes of ``wanted`` leave now and arrive by ``at`` (``now``, or a
        round trip later when one of their segments was lost), or none may leave until ``at``."""
        if self._last_send is not None and now - self._last_send > self.rto_s:
            idle = now - self._last_send
            self.ssthresh = max(self.ssthresh, self.cwnd * 3 // 4)  # Linux's tcp_cwnd_restart
            while idle > self.rto_s and self.cwnd > self.initial_bytes:
                self.cwnd = max(self.initial_bytes, self.cwnd // 2)
                idle -= self.rto_s
            self._round_start, self._used = now, 0
        if self._round_start is None:
            self._round_start = now
        # A tolerance of a microsecond: timers wake a hair early and float sums drift.
        rounds = int((now - self._round_start + _EPSILON_S) // self.rtt_s)
        if rounds >= 1:
            if self._used >= self.cwnd:
                grown = min(self.cwnd * 2, self.ssthresh) if self.cwnd < self.ssthresh else self.cwnd + SEGMENT_BYTES
                self.cwnd = min(self.max_bytes, grown)
            self._round_start += rounds * self.rtt_s
            self._used = 0
        if self._used >= self.cwnd:
            return self._round_start + self.rtt_s, 0
        n = min(wanted, self.cwnd - self._used)
        self._used += n
        self._last_send = now
        if not self._lost(n):
            return now, n
        self.losses += 1
        if self._cut_round != self._round_start:
            self.cwnd = self.ssthresh = max(2 * SEGMENT_BYTES, int(self.cwnd * BETA))
            self._cut_round = self._round_start
        return now + self.rtt_s, n

    def _lost(self, n: int) -> bool:
        """Whether one of the ``n`` bytes' segments is lost."""
        if self.loss == 0.0:
            return False
        segments = -(-n // SEGMENT_BYTES)
        return self._rng.random() < 1.0 - (1.0 - self.loss) ** segments
