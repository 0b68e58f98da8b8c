"""Candidates for the default scheduling profile (issue 38), kept by name as plain data.

Each is a YAML-equivalent dict built from `presets.py`'s documents and builders, so that it can
be compared with the presets in the benchmarks (`bench.policies.schedpolicy.CANDIDATE_PRESETS`);
none is a user preset. Where each was measured: the comments beside it.
"""

from __future__ import annotations

import copy
from typing import Any

from poolkeeper.scheduling.presets import (
    CLASSIC,
    DEFAULT,
    answered_wait,
    cold_spread,
    default_plus,
    prefix_affinity,
    speed_weight,
    with_full_batch,
    with_scorer,
)

# Candidates for the default profile (issue 38; measured in
# docs/notes/2026-12-06-routing-quality-third-round.md), kept by name so that each can be
# compared in the benchmarks (`bench.policies.schedpolicy.CANDIDATE_PRESETS`); not user presets.
CANDIDATES: dict[str, dict[str, Any]] = {
    # the backlog as a wait in seconds, each endpoint's tokens over its measured drain rate.
    "prefill-backlog-drain": default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None
    ),
    # ... scored by a fixed span (2,048 tokens ahead halve the score) instead of the ratio.
    "prefill-backlog-span": default_plus("prefill-backlog-scorer", 2, spanTokens=2048),
    "prefill-backlog-span4k": default_plus("prefill-backlog-scorer", 2, spanTokens=4096),
    # ... at weight 1 (half the backlog's say against the load and affinity scorers).
    "prefill-backlog-w1": default_plus("prefill-backlog-scorer", 1),
    # ... at weight 0: the default's choices, but the router learns each first byte (which
    # unseen requests already answered), as every backlog candidate does.
    "prefill-backlog-w0": default_plus("prefill-backlog-scorer", 0),
    "prefill-backlog-drain-span": default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, spanTokens=2048
    ),
    # ... scored relative to the pool's mean backlog (span = lowest cost + mean backlog).
    "prefill-backlog-mean-span": default_plus("prefill-backlog-scorer", 2, meanSpan=True),
    # ... each cost over 1 - the endpoint's utilisation (the M/M/1 marginal cost's factor).
    "prefill-backlog-busy": default_plus("prefill-backlog-scorer", 2, busyPenalty=True),
    "prefill-backlog-drain-busy": default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, busyPenalty=True
    ),
    # ... as the marginal cost: the request's wait plus the wait it adds to the backlog's.
    "prefill-backlog-marginal": default_plus("prefill-backlog-scorer", 2, marginal=True),
    "prefill-backlog-drain-marginal": default_plus(
        "prefill-backlog-scorer", 2, drainRate=True, speedTolerance=None, marginal=True
    ),
    # issue 38, fourth round (docs/notes/2026-12-06-routing-quality-fourth-round.md): the
    # backlog's say fading from a pool busy share of 0.6 to none at 0.9, and the queue scorer
    # counting unseen requests that answered as waiting (as a profile without first bytes does).
    "prefill-backlog-fade": answered_wait(
        default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9)
    ),
    # ... the same without the fade, and the fade with the queue scorer as it was.
    "prefill-backlog-answered-wait": answered_wait(default_plus("prefill-backlog-scorer", 2)),
    "prefill-backlog-fade-only": default_plus(
        "prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9
    ),
    # ... fading from 0.5 to 0.8: screened on four points only (fourth round's note).
    "prefill-backlog-fade-early": answered_wait(
        default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)
    ),
    # fifth round (docs/notes/2026-12-06-routing-quality-fifth-round.md): `prefill-backlog-fade`
    # with the busy share rising with a 0.1 s (0.3 s) time constant and falling with 1 s, so a
    # burst that fills the pool at once is placed without the backlog.
    "prefill-backlog-fade-rise": answered_wait(
        default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9, fadeRiseS=0.1)
    ),
    "prefill-backlog-fade-rise3": answered_wait(
        default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9, fadeRiseS=0.3)
    ),
    # sixth round (docs/notes/2026-12-06-routing-quality-sixth-round.md): new shared prefixes
    # spread by index content (`coldSpread` 0.5) on the default and on the two fades, for the
    # cold start of shared-prefix below capacity.
    "default-cold-spread": cold_spread(copy.deepcopy(CLASSIC)),
    "prefill-backlog-fade-early-cold-spread": cold_spread(
        answered_wait(default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8))
    ),
    "prefill-backlog-fade-cold-spread": cold_spread(
        answered_wait(default_plus("prefill-backlog-scorer", 2, fadeFrom=0.6, fadeTo=0.9))
    ),
    # issue 38, fifth round: the default with the prefix-affinity preset's learned full-batch
    # filter (live 8 slots: docs/notes/2026-12-06-live-routing-fifth-round.md).
    "default-full-batch": with_full_batch(copy.deepcopy(CLASSIC)),
    # issue 38, sixth round: the same filter with the cost-of-a-miss gate (a prefix holder
    # stays unless its queue costs more than a miss elsewhere; live and three seeds:
    # docs/notes/2026-12-06-live-routing-sixth-round.md).
    "default-miss-gate": with_full_batch(copy.deepcopy(CLASSIC), miss_gate=True),
    # ... with the queue scorer counting unseen requests that answered as waiting, as the
    # default does without first bytes: the gate learns from first bytes, and that alone
    # moved the default's choices (heterogeneous 1.1x seed 1: 0.111 -> 0.134 s). With the
    # seventh round's gate (holders only, where dearer than every kept endpoint) this is the
    # candidate for the default: docs/notes/2026-12-06-live-routing-seventh-round.md.
    "default-miss-gate-aw": answered_wait(with_full_batch(copy.deepcopy(CLASSIC), True)),
    # ... and the `prefix-affinity` preset with its filter gated the same way.
    "prefix-affinity-miss-gate": prefix_affinity(miss_gate=True),
    # issue 38, the default switch (docs/notes/2026-12-07-default-switch.md): the gated preset's
    # filters (full batch with the miss gate, prefix affinity) on `prefill-backlog-fade-early`'s
    # profile (the backlog fading from a busy share of 0.5 to none at 0.8, the queue scorer
    # counting answered unseen requests as waiting): the gate for the live regimes, the fade
    # for heavy-tail and the heterogeneous fleet at 1.1x.
    "prefix-affinity-miss-gate-fade-early": answered_wait(
        prefix_affinity(miss_gate=True, fadeFrom=0.5, fadeTo=0.8)
    ),
    # ... and `prefill-backlog-fade-early` with only the gated full-batch filter (no prefix
    # affinity filter, whose holders-first rule lost the heterogeneous fleet at 1.1x and
    # multi-LoRA's goodput at 0.9x in the screen): the filter for live 8 slots, the fade's
    # placement everywhere else. With `holdNewPrefixes` it won the switch: now the default.
    "prefill-backlog-fade-early-miss-gate": with_full_batch(
        answered_wait(default_plus("prefill-backlog-scorer", 2, fadeFrom=0.5, fadeTo=0.8)),
        miss_gate=True,
    ),
    # The default with its observed-speed-scorer at 1.5 instead of 2: the backlog scorer
    # already scales its costs by observed speed, so the default counts a slow server's
    # slowness twice. Heterogeneous 1.1x, 8 servers: 0.82x aibrix-prefix's p90 (the default
    # 0.89x; lower on 7 of 9 seed and tie-break streams), but below capacity 2-12 % higher p90
    # and, where the speed scorer fires on identical servers, heavy-tail 1.1x goodput -0.6 %:
    # not the default (docs/notes/2026-12-07-heterogeneous-overload.md).
    "default-speed15": speed_weight(copy.deepcopy(DEFAULT), 1.5),
    # issue 38, step clock (docs/notes/2026-12-07-kv-step-clock.md): the default plus the
    # `step-phase-scorer` (the engines' KV-batch step clocks) at weight 1, 2, 4, 8 or 16.
    **{
        f"default-stepclock{suffix}": with_scorer(
            copy.deepcopy(DEFAULT), "step-phase-scorer", weight
        )
        for suffix, weight in (("-w1", 1), ("", 2), ("-w4", 4), ("-w8", 8), ("-w16", 16))
    },
}


def candidate_document(name: str) -> dict[str, Any]:
    """The YAML-equivalent dict of a candidate (a copy); KeyError for an unknown name."""
    return copy.deepcopy(CANDIDATES[name])
