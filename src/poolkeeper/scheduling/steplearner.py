"""How a router can learn a server's step-time model from the step ends it sees (issue #38).

`StepLearner` (pure, synchronous; one per server) follows the step sequence between observed
step ends (first bytes and ends; KV-event batches, each the end of one step at the engine's
`ts`). The events at one instant form a group; when time moves on, the gap g from the
previous known step boundary (an end, or a send to an idle server) to the group is a whole
number n of steps whose make-up is known: the prefill of the requests with their first byte
in the group (P uncached of their `prompt` tokens) is in the last step (a prefill completed
earlier would have shown a first byte), no request ended in between, so every step decodes
the same D requests and their context grows by D a step. With C0 the decoding requests'
context (prompt + outputs so far) and step = a + b * prefill + c * decoding + d * context:

    g = n * a + P * b + n * D * c + (n * C0 + D * n * (n - 1) / 2 + prompt) * d

Chunked prefills (prompts past the token budget) and other routers' requests break this.

n is the integer the model in use fits best, and (features, g) is a sample of a
least-squares fit with exponential forgetting (about 200 gaps) and a ridge toward the model
in use (directions the window cannot tell apart stay put). A gap is fitted only if the model
1.15 times shorter and longer counts it the same (a gap near a half-step boundary may be
miscounted, and a wrong count teaches the fit its own error).

A model far off miscounts and learns its own error (2x too long rounds a 2-step gap to one).
The count that breaks the loop: a request's first byte and end are `out - 1` steps apart
(`out`: the usage the EPP reads at the end). Two phases:

- bootstrap: the model is prior * r; at each end r moves toward its mean over the request's
  span times counted / (out - 1) (a target, not a step from today's r: the count arrives a
  request's life late, and steps from today's r oscillate). Once the counts agree (moving
  mean of |log ratio| under 3 % over 10 ends begun in this phase), fitting starts;
- fitting: the fit is the model (r = 1 at each solve); counts that drift over 15 % again
  (30 ends begun in this phase) reset to the bootstrap from the prior.

With steps counted the context is too: a decoding request's is its prompt + 1 + the steps
since its first byte."""

from __future__ import annotations

import math
from collections import deque

Coefficients = tuple[float, float, float, float]  # s: overhead, /prefill token, /decoding, /context
# Feature scales: the solve works on features of order one (1 step, 100 tokens, ...).
SCALES: Coefficients = (1.0, 100.0, 100.0, 10_000.0)
FORGET = 0.995  # per gap: an effective window of ~200 gaps
RIDGE = 5.0  # the model in use weighs as much as five gaps
# A gap is fitted only if the model 1.15 times shorter or longer counts it the same: a gap near a
# half-step boundary may be miscounted, and a wrong count teaches the fit its own error.
SLACK = (0.87, 1.15)
RESET = 0.15  # counts this far off (log) after 30 requests: the fit restarts from the prior
TRUSTED = 0.03  # gaps are fitted once the steps counted per request are this close (log)
SOLVE_EVERY = 8  # gaps between solves
MAX_STEPS = 4096  # a gap longer than this many modelled steps is not counted (idle, stalled)


def _features(n: int, prefill: int, prompt: int, d: int, c0: float) -> Coefficients:
    """The summed features of n back-to-back steps: d requests decoding with context c0 at
    the first, growing by d a step; the last also prefills `prefill` of `prompt` tokens."""
    return (n, prefill, n * d, n * c0 + d * n * (n - 1) / 2 + prompt)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (4x4, kept positive definite by the ridge)."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class StepLearner:
    """One server's step model learnt from its observed step ends (see the module docstring)."""

    def __init__(self, prior: Coefficients, *, learn: bool = True, merge_s: float = 0.0) -> None:
        self.prior = prior
        self.theta: list[float] = list(prior)
        self.learn = learn
        self.merge_s = merge_s  # reports this close to a group's first are of the same step
        self.scale = 1.0  # r: corrects the fit's scale from the steps counted per request
        self.boot_scale = 1.0  # r when the bootstrap ended
        self.miscount = 1.0  # moving mean of |log(counted / true)| over the requests ended
        self.anchors = 0  # requests ended since the start or the last reset
        self.resets = 0
        self.epoch = 0  # the step count when the phase (bootstrap or fitting) began
        self.fitting = False  # bootstrap: prior * r, r from the counts; fitting: the gaps' fit
        self.log_r = 0.0  # sum of log r over the steps counted
        self.gram = [[0.0] * 4 for _ in range(4)]  # forgetting sums, normalised features
        self.moment = [0.0] * 4
        self.gaps = 0
        self.boundary: float | None = None  # last known step boundary (an end, or a start)
        self.steps = 0  # steps counted up to `boundary`
        # sent, no first byte: id -> (time sent, prompt tokens, those not cached)
        self.waiting: dict[str, tuple[float, int, int]] = {}
        # id -> (prompt tokens, steps counted and log_r at its first byte)
        self.decoding: dict[str, tuple[int, int, float]] = {}
        self.group_at: float | None = None  # the instant of the events not yet counted
        self.group_d = 0  # decoding requests before that instant's events
        self.group_c = 0.0  # and their context
        self.group_prefill = 0  # uncached prompt tokens with their first byte at that instant
        self.group_prompt = 0  # and all of their prompt tokens (their context)
        self.group_firsts: list[tuple[str, int]] = []
        self.group_ends: list[tuple[int, float, int]] = []  # (step, log_r of first byte, out)
        # (steps counted, out - 1) of the last requests ended: for tests and the note's script
        self.counts: deque[tuple[int, int]] = deque(maxlen=1000)

    def coefficients(self) -> Coefficients:
        s = self.scale
        return (s * self.theta[0], s * self.theta[1], s * self.theta[2], s * self.theta[3])

    def step_s(self, prefill: float, decoding: float, context: float) -> float:
        a, b, c, d = self.coefficients()
        return a + b * prefill + c * decoding + d * context

    def context(self) -> float:
        """Context of the decoding requests in the step after `boundary`: prompt + outputs."""
        total = sum(p + 1 + self.steps - k for p, k, _ in self.decoding.values())
        return total + sum(p for _, p in self.group_firsts)

    def busy(self) -> bool:
        return bool(self.waiting or self.decoding or self.group_firsts)

    def advance(self, now: float) -> None:
        """Count the open group's gap once time has moved past it."""
        if self.group_at is not None and now > self.group_at + self.merge_s:
            self._close()

    def prefill_sent(self, by: float) -> int:
        """Uncached prompt tokens of the requests sent by `by` that are waiting for a step."""
        return sum(new for t, _, new in self.waiting.values() if t <= by)

    def prompt_sent(self, by: float) -> int:
        return sum(n for t, n, _ in self.waiting.values() if t <= by)

    def sent(self, request_id: str, prompt_tokens: int, now: float, cached: int = 0) -> None:
        self.advance(now)
        if not self.busy() and self.group_at is None:
            self.boundary = now  # an idle engine starts a step when a request arrives
        self.waiting[request_id] = (now, prompt_tokens, prompt_tokens - cached)

    def drop(self, request_id: str) -> tuple[int, int, float] | None:
        """Forget a request with no step end to count (an error, a cancel, an end told without
        its time): out of `waiting`, `decoding` and the open group's first bytes, so that it
        neither keeps the learner busy nor adds to its context. Its `decoding` entry, if any."""
        self.waiting.pop(request_id, None)
        self.group_firsts = [f for f in self.group_firsts if f[0] != request_id]
        return self.decoding.pop(request_id, None)

    def observed(self, request_id: str, now: float, *, first: bool, out: int | None) -> None:
        """A first byte (`first`) or an end (`out`: output tokens, None if unknown) at `now`."""
        self._open(now)
        if first:
            waiting = self.waiting.pop(request_id, None)
            if waiting is not None:
                self.group_prefill += waiting[2]
                self.group_prompt += waiting[1]
                self.group_firsts.append((request_id, waiting[1]))
            return
        ended = self.decoding.pop(request_id, None)
        if ended is None:
            # Its first byte is in the open group (one output token: both at one step end):
            # it never decodes, so `_close` must not start counting it.
            self.group_firsts = [f for f in self.group_firsts if f[0] != request_id]
        elif out is not None and out >= 2:
            self.group_ends.append((ended[1], ended[2], out))

    def step_ended(self, now: float) -> None:
        """A step ended at `now` with no first byte or end the router knows of in it (a
        KV-event batch stamped `now` by the engine): a boundary that only counts steps. One
        at or before a boundary already counted, or before the open group, arrived out of
        order (a batch later than the step's first byte): dropped, it would count a step
        twice."""
        if (self.boundary is not None and now <= self.boundary) or (
            self.group_at is not None and now < self.group_at
        ):
            return
        self._open(now)

    def _open(self, now: float) -> None:
        self.advance(now)
        if self.group_at is None:
            self.group_at = now
            self.group_d = len(self.decoding)
            self.group_c = self.context()

    def _close(self) -> None:
        assert self.group_at is not None
        now, d, c0 = self.group_at, self.group_d, self.group_c
        p, prompt = self.group_prefill, self.group_prompt
        n = 0
        if self.boundary is not None and now > self.boundary:
            gap = now - self.boundary
            n = self._count(gap, p, prompt, d, c0)
            features = _features(n, p, prompt, d, c0)
            robust = all(self._count(gap, p, prompt, d, c0, f) == n for f in SLACK)
            if n and self.fitting and robust:
                self._add(features, gap)
        self.steps += max(n, 1)
        self.log_r += max(n, 1) * math.log(self.scale)
        self.boundary = now
        for request_id, prompt in self.group_firsts:
            self.decoding[request_id] = (prompt, self.steps, self.log_r)
        for first_step, log_r, out in self.group_ends:
            if first_step >= self.epoch:  # counted with the model in use since then
                counted = self.steps - first_step
                self._anchor(counted, out - 1, (self.log_r - log_r) / max(1, counted))
        self.group_at = None
        self.group_prefill = self.group_prompt = 0
        self.group_firsts = []
        self.group_ends = []

    def _count(
        self, gap: float, p: int, prompt: int, d: int, c0: float, factor: float = 1.0
    ) -> int:
        """The number of steps n >= 1 whose modelled length (times `factor`) is nearest
        `gap` (0: too many)."""
        theta = [factor * t for t in self.coefficients()]
        best, best_err = 0, math.inf
        for n in range(1, MAX_STEPS + 1):
            features = _features(n, p, prompt, d, c0)
            err = gap - sum(x * t for x, t in zip(features, theta, strict=True))
            if abs(err) < best_err:
                best, best_err = n, abs(err)
            if err < 0:
                return best
        return 0

    def anchor_span(self, first: tuple[int, float], end: tuple[int, float], out: int) -> None:
        """A request ended `out` tokens after its first byte, told late: `first` and `end` are
        (steps counted, log r summed) at its first byte's step and at its end's (the live step
        clock back-dates an end to the boundary its report time less a lateness falls after:
        `stepclock.py`). As an end in a group would, if counted with the model in use."""
        counted = end[0] - first[0]
        if first[0] >= self.epoch and counted > 0 and out >= 2:
            self._anchor(counted, out - 1, (end[1] - first[1]) / counted)

    def _anchor(self, counted: int, true: int, span_log_r: float) -> None:
        """A request's first byte and end are `true` steps apart; the learner counted
        `counted` with r averaging exp(`span_log_r`) meanwhile: a model too long counts too
        few. Bootstrap: r moves toward that average times counted / true (a target, not a
        step from today's r: the count is a request's life late). Fitting: a count too far
        off means the fit went wrong in a shape r cannot fix; start again from the prior."""
        self.counts.append((counted, true))
        if not self.learn or counted <= 0:
            return
        weight = min(1.0, true / 50)  # a short request's count says little about the scale
        off = math.log(min(8.0, max(0.125, counted / true)))
        self.miscount += 0.2 * weight * (abs(off) - self.miscount)
        self.anchors += 1
        if not self.fitting:
            log_scale = math.log(self.scale)
            self.scale = math.exp(log_scale + 0.5 * weight * (span_log_r + off - log_scale))
            if self.miscount < TRUSTED and self.anchors >= 10:
                self.fitting, self.epoch, self.anchors = True, self.steps, 0
        elif self.miscount > RESET and self.anchors >= 30:
            self.theta, self.scale = list(self.prior), self.boot_scale
            self.fitting, self.epoch, self.anchors = False, self.steps, 0
            self.miscount = 1.0
            self.gram = [[0.0] * 4 for _ in range(4)]
            self.moment = [0.0] * 4
            self.resets += 1
        if not self.fitting:
            self.boot_scale = self.scale

    def _add(self, features: tuple[float, float, float, float], gap: float) -> None:
        # The fit learns the real scale (features with the right n), so it is fitted to the
        # gap itself; r only corrects the counting until the fit gets there.
        z = [f / s for f, s in zip(features, SCALES, strict=True)]
        for i in range(4):
            self.moment[i] = FORGET * self.moment[i] + z[i] * gap
            row = self.gram[i]
            for j in range(4):
                row[j] = FORGET * row[j] + z[i] * z[j]
        self.gaps += 1
        if self.gaps % SOLVE_EVERY == 0:
            self._solve()

    def _solve(self) -> None:
        # The ridge pulls toward the model in use (r * fit): the features' directions the
        # window does not tell apart (overhead, decoding and context grow together) stay put.
        current = [t * s for t, s in zip(self.coefficients(), SCALES, strict=True)]
        matrix = [[g + (RIDGE if i == j else 0.0) for j, g in enumerate(row)]
                  for i, row in enumerate(self.gram)]  # fmt: skip
        rhs = [m + RIDGE * q for m, q in zip(self.moment, current, strict=True)]
        fitted = [f / s for f, s in zip(_solve(matrix, rhs), SCALES, strict=True)]
        if min(fitted) < 0.0:
            # Collinear gaps (one-step gaps between KV batches: overhead, decoding and context
            # grow together) can fit a negative term; keep the model's shape and fit only its
            # scale (least squares along it), or a wrong prior's scale would stay for good.
            along = sum(g * q for g, q in zip(self.moment, current, strict=True))
            norm = sum(
                current[i] * sum(self.gram[i][j] * current[j] for j in range(4)) for i in range(4)
            )
            if along <= 0.0 or norm <= 0.0:
                return
            fitted = [along / norm * c for c in self.coefficients()]
        # The fit is on the gaps themselves: the real scale, r = 1.
        self.theta, self.scale = fitted, 1.0
