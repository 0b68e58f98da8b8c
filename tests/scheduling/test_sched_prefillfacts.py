"""`PrefillFacts` (what `holdNewPrefixes` asks the scheduler): a request's uncached prompt tokens
from the prefix index, and each candidate's prefill backlog, read from the plugins."""

from __future__ import annotations

import dataclasses
import random

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import preset_config
from poolkeeper.scheduling.interfaces import ProfileResult
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from tests.scheduling.sched_factories import NOW, cycle, request, state

WINDOW = 256 * 64  # the default index window: maxPrefixBlocks x blockSize characters


def _facts() -> tuple[PrefillFacts, list[EndpointState]]:
    scheduler = build_scheduler(preset_config("prefill-backlog"), rng=random.Random(1))
    facts = PrefillFacts(scheduler)
    assert facts.prefix is not None
    assert facts.backlog is not None
    pool = [state(i, served_model="base") for i in (1, 2)]
    # Streamed: their first bytes will be seen (the backlog an absolute threshold may read).
    placed = dataclasses.replace(request(prompt="s" * 24_000, request_id="placed"), stream=True)
    short = dataclasses.replace(request(prompt="t" * 8_000, request_id="short"), stream=True)
    for req in (placed, short):
        scheduler.schedule(req, pool, now=NOW)
    return facts, pool


def test_uncached_tokens_are_the_prompt_less_the_longest_placed_prefix() -> None:
    facts, _pool = _facts()
    new = request(prompt="n" * 8_000)
    assert facts.uncached_tokens(new, NOW) == 2_000  # nothing placed: all of it
    within = request(prompt="t" * 8_000 + "u" * 400)  # the short prompt's 125 blocks placed
    assert facts.uncached_tokens(within, NOW) == 2_100 - 2_000
    # Past the window the index sees only its 16 KiB: a prompt whose whole window is placed
    # opens no new prefix (it was 6,002 - 4,096 = 1,906 uncached, over minPromptTokens).
    longer = request(prompt="s" * 24_000 + "and then?")
    assert facts.uncached_tokens(longer, NOW) == 0
    # Its window only partly placed: the prompt less what is.
    partly = request(prompt="s" * 8_000 + "v" * 16_000)
    assert facts.uncached_tokens(partly, NOW) == 6_000 - 2_000
    assert WINDOW < 24_000


def test_backlogs_are_the_tokens_sent_without_a_first_byte() -> None:
    facts, pool = _facts()
    assert facts.backlog is not None
    assert sum(facts.backlogs(pool)) == 6_000 + 2_000  # both prompts new, wherever they went
    facts.backlog.observe_first_token("placed", None, NOW + 1)
    assert sum(facts.backlogs(pool)) == 2_000


def test_a_non_streamed_request_is_not_in_the_holds_backlog() -> None:
    """A non-streamed request's first byte is never seen, so its entry lasts until it ends,
    decode included: the scorer still counts it (relative scores), the hold's absolute
    threshold does not (it held new prefixes behind prefills long over; review)."""
    facts, pool = _facts()
    assert facts.backlog is not None
    backlog = facts.backlog.backlog
    before = sum(facts.backlogs(pool))
    whole = request(prompt="w" * 40_000, request_id="whole")  # stream=False
    facts.backlog.post_cycle(cycle(), whole, ProfileResult("p", (pool[0],)))
    assert sum(facts.backlogs(pool)) == before
    assert sum(backlog.snapshot().values()) == before + 10_000
    facts.backlog.request_ended("whole")
    assert sum(backlog.snapshot().values()) == before


def test_cached_tokens_are_the_prefix_scorers_match_per_endpoint() -> None:
    # What a band's `avoidPrefillUnlessCached` reads: per endpoint, in tokens.
    facts, pool = _facts()
    within = request(prompt="t" * 8_000 + "u" * 400)
    cached = facts.cached_tokens(within, NOW)
    assert sum(cached.values()) == 2_000  # the short prompt's blocks, on one endpoint
    assert set(cached) <= {s.endpoint.hostport for s in pool}
    assert max(facts.cached_tokens(request(prompt="n" * 8_000), NOW).values(), default=0) == 0
    bare = build_scheduler(preset_config("random"), rng=random.Random(1))
    assert PrefillFacts(bare).cached_tokens(within, NOW) == {}
