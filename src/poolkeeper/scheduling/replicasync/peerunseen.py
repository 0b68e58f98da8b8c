"""The peers' unseen sends: what the other replicas sent since each endpoint's last scrape.

Why: between two scrapes the scheduler's load scorers and filters read the scraped queue plus
the router's own sends since that scrape (`EndpointState.unseen_requests`, `unseen_tokens`,
`unseen_answered`, filled by the in-flight tracker, `datastore/inflight.py`). With N replicas
each one adds only its own, about 1/N of them: a burst between two scrapes herds onto the
endpoint that looked idle at the last one, once per replica. Measured on heavy-tail, 8 servers,
0.9x (docs/notes/2026-12-07-replicas-every-workload.md): p90 TTFT 1.06x one replica's with 2
replicas and 1.13x with 4, sync on.

`PeerUnseen` is a `PeerSink` of the hub (`hub.ReplicaSync.bind`, beside the fold): a peer's
`Sent` is recorded under `(origin, request_id)` at its endpoint, stamped with its delivery time;
`Answered` marks it answered (running there, not queued); `Ended` (also what an open statement
that no longer covers it delivers, `openset.py`) and a peer gone drop it. `apply(states)` adds,
per endpoint, the peers' sends stamped at or after the endpoint's `metrics.updated_at` (the
rule the tracker applies to its own: a scrape stamped T is taken before any change at T or
later) to `unseen_requests`, `unseen_tokens` and `unseen_answered`; older ones are in the
scraped queue, so they are dropped there. `inflight_requests` / `inflight_tokens` stay the
replica's own (a peer's streamed send tells no end after its first byte, `fold.py`), so with
peers `unseen_requests` may exceed `inflight_requests`.

Measured (the same note): with every replica's unseen sends at once, one replica's p90 comes
back (heavy-tail, 4 replicas: 1.01x); folded D ms late it does so only well below 1 ms (at 1 ms:
1.14x), as the sends that collide are the last millisecond's. So `serve` runs it
(`spec.replicaSync.peerUnseen`, on by default) with decisions sent at once (`sendAtOnce`: a peer
folds one in about 0.3 ms on 127.0.0.1): heavy-tail 4 replicas 1.05x of one replica's p90
against 1.13x as shipped before (docs/notes/2026-12-07-replicas-sub-ms.md). The bench runs it
when asked (`--sync-with unseen`).

A pool serving LoRA adapters is left as it is (the sends a scrape covers are still dropped).
First measured on multi-LoRA seed 2, 0.9x, 2 replicas: folded everywhere, p90 63x one
replica's and goodput -7.5 %; left out for the whole pool, 1.99x and -4.8 %. That was the
multi-LoRA replica cliff, since found to be the backlog scorer's fade dropping its adapter
term and fixed (docs/notes/2026-12-07-lora-replicas-cliff.md). Re-measured after the fix
(docs/notes/2026-12-07-lora-unseen.md; `adapters_gate=False` here, the bench's `--sync-with
unseen-lora`; `serve` always runs the gate), multi-LoRA, 8 servers, D 0.3 ms, p90 over one
replica with 2 / 4 replicas: 20 s runs at 12 points (0.9x seeds 1-6, 1.0x and 0.7x seeds
1-3), the fold's means 0.996x / 0.988x against the gate's 0.996x / 1.006x, but single points
up to 1.10x / 1.14x the gate's and goodput to -1.3 % / -1.9 %; 60 s runs at 9 points (0.9x,
1.0x), means 0.983x / 0.973x against 0.980x / 0.969x, points up to 1.14x / 1.22x, goodput
-0.6 % summed, p99 higher at 13 of 18 (4 replicas' mean 6.8 s against 3.8 s). Not level, so
the gate stays. Why the fold loses at those points was not traced (the first reason given, a
`Sent` naming no adapter, holds for the replica's own unseen sends too: the scorers read
adapter residency from the scrape alone).

The adapters a server lists are only those with requests, so an idle LoRA pool lists none:
the pool is told by its endpoints having listed adapters at any read (sticky: once one of the
candidates with sends kept lists one, all the candidates are marked). Not `max_adapters`: the
simulator reports vLLM's `max_loras` 1 on every server, so every benchmarked pool would count
as a LoRA pool. Left: a LoRA pool's very first burst, before any of its endpoints listed an
adapter, is folded: in the replays at most 2 reads per run, with 4 replicas only, and closing
that changed no figure (the same note).

A delivery D ms after the peer's send counts a send that a scrape within those D ms already
holds once more, until the next scrape (with the shipped 1 ms against a 50 ms scrape: rare).

Bounded: at most `max_entries` sends (the oldest go first), none older than `max_age_s` (on
a new send, or at a read, by the newest scrape stamp read); with a `pool` (the server seeds it
from the datastore and `forget_endpoints` replaces it, as the fold's), a send to an endpoint
outside it is ignored and counted (`ignored`), and those to endpoints that left are dropped.
Cheap when there is nothing to add: `apply` works nothing out unless a candidate has sends
kept, and an endpoint's answer is the same object while its input state and its sends are
(the decision cache, `datastore/columns.py`, compares states by identity).
Pure: no clock, no I/O; `now` is the hub's delivery time, on the clock that stamps the scrapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.replicasync.events import Answered, Sent, SyncEvent

_Key = tuple[str, str]  # (origin, request_id)


@dataclass(slots=True)
class _Send:
    at: float  # delivered at
    endpoint: str
    tokens: int
    answered: bool = False


class PeerUnseen:
    """Peers' sends by endpoint, until a scrape covers them (the module docstring)."""

    __slots__ = (
        "_by_endpoint", "_lora", "_memo", "_pool", "_sends", "adapters_gate", "ignored",
        "max_age_s", "max_entries",
    )  # fmt: skip

    def __init__(
        self,
        *,
        max_entries: int = 65_536,
        max_age_s: float = 60.0,
        pool: set[str] | None = None,
        adapters_gate: bool = True,
    ) -> None:
        if max_entries < 1 or not max_age_s > 0.0:
            raise ValueError("max_entries and max_age_s must be positive")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.adapters_gate = adapters_gate  # False: fold in LoRA pools too (bench A/B)
        self._pool: frozenset[str] | None = None if pool is None else frozenset(pool)
        self.ignored = 0  # peers' sends to an endpoint outside the pool
        self._sends: dict[_Key, _Send] = {}  # in delivery order (delivery times never go back)
        # endpoint -> its sends' keys, in delivery order: those a scrape covers are a prefix
        self._by_endpoint: dict[str, dict[_Key, None]] = {}
        # endpoint -> (the state last read, the answer): kept while neither changes, so the
        # decision cache (`datastore/columns.py`, by identity) sees the same object
        self._memo: dict[str, tuple[EndpointState, EndpointState]] = {}
        self._lora: set[str] = set()  # endpoints of a pool seen serving adapters (sticky)

    def __len__(self) -> int:
        return len(self._sends)

    # -- PeerSink ---------------------------------------------------------------------------

    def fold(self, origin: str, event: SyncEvent, now: float) -> None:
        key = (origin, event.request_id)
        if isinstance(event, Sent):
            self._drop(key)
            self._age(now)
            endpoint = event.endpoint
            if self._pool is not None and endpoint not in self._pool:
                self.ignored += 1
                return
            while len(self._sends) >= self.max_entries:
                self._drop(next(iter(self._sends)))
            self._sends[key] = _Send(now, endpoint, event.tokens)
            self._by_endpoint.setdefault(endpoint, {})[key] = None
            self._memo.pop(endpoint, None)
        elif isinstance(event, Answered):
            send = self._sends.get(key)
            if send is not None and not send.answered:
                send.answered = True
                self._memo.pop(send.endpoint, None)
        else:
            self._drop(key)

    def peer_gone(self, origin: str) -> None:
        for key in [k for k in self._sends if k[0] == origin]:
            self._drop(key)

    def forget_endpoints(self, keep: set[str]) -> None:
        """The pool is now `keep`: peers' sends elsewhere are ignored from now on, and those
        kept for the endpoints that left are dropped (as the fold's `forget_endpoints`)."""
        self._pool = frozenset(keep)
        for endpoint in [e for e in self._by_endpoint if e not in keep]:
            for key in list(self._by_endpoint[endpoint]):
                self._drop(key)
        self._lora &= keep
        for endpoint in [e for e in self._memo if e not in keep]:
            del self._memo[endpoint]

    # -- the scheduler's view ---------------------------------------------------------------

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        """`states` with the peers' sends since each endpoint's scrape added to its unseen
        counts, unless the pool serves LoRA adapters (the module docstring); the sends a
        scrape now covers are dropped. Nothing is worked out unless a candidate has sends
        kept; an endpoint's answer is the same object while its state and sends are."""
        by_endpoint = self._by_endpoint
        out = list(states)
        if not by_endpoint:
            return out
        hits = [i for i, s in enumerate(out) if s.endpoint.hostport in by_endpoint]
        if not hits:
            return out
        sends = self._sends
        newest = 0.0
        for i in hits:  # the sends a scrape covers are in its queue: dropped
            s = out[i]
            scraped = s.metrics.updated_at
            newest = max(newest, scraped)
            keys = by_endpoint[s.endpoint.hostport]
            while keys and sends[next(iter(keys))].at < scraped:
                self._drop(next(iter(keys)))
        self._age(newest)  # (a scrape's stamp is on the delivery clock)
        if self.adapters_gate and self._serves_adapters(out, hits):
            return out
        memo = self._memo
        for i in hits:
            s = out[i]
            endpoint = s.endpoint.hostport
            kept = memo.get(endpoint)
            if kept is not None and kept[0] is s:
                out[i] = kept[1]
                continue
            pending = by_endpoint.get(endpoint)
            if not pending:
                continue
            tokens = answered = 0
            for key in pending:
                send = sends[key]
                tokens += send.tokens
                answered += send.answered
            # (positional, as the tracker builds them: `dataclasses.replace` costs ~9 µs each;
            # tests/scheduling/test_sched_sync_peerunseen.py checks every field is carried)
            folded = EndpointState(
                s.endpoint, s.metrics, s.inflight_requests, s.inflight_tokens,
                s.unseen_requests + len(pending), s.unseen_tokens + tokens,
                s.seconds_per_output_token, s.unseen_answered + answered, s.inflight_models,
            )  # fmt: skip
            memo[endpoint] = (s, folded)
            out[i] = folded
        return out

    def _serves_adapters(self, states: list[EndpointState], hits: list[int]) -> bool:
        """Whether the candidates are a pool serving LoRA adapters: one of those with sends
        kept was seen with adapters (active or waiting) at this read or an earlier one. The
        first time, every candidate is marked: the pool's idle moments (no adapter listed)
        and its endpoints without sends yet are left as they are too."""
        lora = self._lora
        for i in hits:
            s = states[i]
            if s.endpoint.hostport in lora:
                return True
            if s.metrics.active_adapters or s.metrics.waiting_adapters:
                lora.update(state.endpoint.hostport for state in states)
                return True
        return False

    def _age(self, now: float) -> None:
        sends, horizon = self._sends, now - self.max_age_s
        while sends and sends[key := next(iter(sends))].at < horizon:
            self._drop(key)

    def _drop(self, key: _Key) -> None:
        send = self._sends.pop(key, None)
        if send is None:
            return
        endpoint = send.endpoint
        keys = self._by_endpoint[endpoint]
        del keys[key]
        if not keys:
            del self._by_endpoint[endpoint]
        self._memo.pop(endpoint, None)
