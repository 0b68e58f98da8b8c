"""The KV-event path on /metrics: each prefix scorer with kvEvents, its subscription per endpoint
and its exact index, read at scrape time (`scheduling/kvstats.py`: plain counters, no cost on
the event path). Present whenever a prefix scorer subscribes (kvEvents with
kvEventsSubscribe), with no opt-in like upstream's `enableMetrics`: upstream's counters are
global instruments updated per event, ours cost nothing until scraped, and whoever turns the
events on needs to see whether they arrive.

Upstream's names (llm-d-router `pkg/kvcache/metrics/collector.go`, the `llm_d_epp_` subsystem)
where the meaning is the same, with `plugin_name` added (several scorers may subscribe) and
upstream's `pod_identifier` for the endpoint (its ip:port); poolkeeper's own
`poolkeeper_kv_*` where upstream has none. Labels are the configured plugins and the pool's
endpoints (an endpoint leaves when the pool forgets it), never anything a client sends.
docs/gateway.md lists them; docs/notes/2026-12-08-kv-metrics.md says what was left out and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from poolkeeper.scheduling.kvstats import STALENESS_REASONS, EndpointReading, KVEventsReading

UPSTREAM = "llm_d_epp_kv_cache_"
OWN = "poolkeeper_kv_"
PLUGIN = ["plugin_name"]
ENDPOINT = ["plugin_name", "pod_identifier"]
Family = CounterMetricFamily | GaugeMetricFamily


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def kv_event_families(readings: list[tuple[str, KVEventsReading]]) -> Iterator[Metric]:
    """The families of every subscribing prefix scorer (none without one)."""
    if not readings:
        return
    # Per scorer: (family, value of the reading) for the unlabelled-by-endpoint families.
    per_plugin: list[tuple[Family, Callable[[KVEventsReading], int]]] = [
        (_counter(UPSTREAM + "index_admissions", "KV blocks stored into the exact index as the "
                  "engines reported them.", PLUGIN), lambda r: r.admissions),
        (_counter(UPSTREAM + "index_evictions", "KV blocks removed from the exact index because "
                  "their engine reported them removed (BlockRemoved).", PLUGIN),
         lambda r: r.removals),
        (_counter(UPSTREAM + "index_lookup_requests", "Exact index lookups (one per "
                  "scheduling decision whose prompt fills a block of the approximate index).",
                  PLUGIN),
         lambda r: r.lookups),
        (_counter(UPSTREAM + "index_lookup_hits", "Leading prompt blocks the best endpoint "
                  "holds, summed over lookups.", PLUGIN), lambda r: r.lookup_hits),
        (_counter(UPSTREAM + "index_max_pod_hit_count", "Longest per-endpoint prefix match "
                  "per lookup, summed (as upstream: the same as lookup_hits).", PLUGIN),
         lambda r: r.lookup_hits),
        (_counter(OWN + "index_lookup_blocks", "Prompt blocks the exact index lookups asked for "
                  "(lookup_hits over this is the exact index's hit ratio).", PLUGIN),
         lambda r: r.lookup_blocks),
        (_counter(OWN + "index_bound_evictions", "KV blocks dropped by kvIndexMaxBlocksPerEndpoint"
                  " (still cached by their engine as far as it reported).", PLUGIN),
         lambda r: r.evictions),
        (_counter(OWN + "index_unanchored_blocks", "Stored KV blocks refused: they continue a "
                  "block the exact index does not hold for that endpoint.", PLUGIN),
         lambda r: r.unanchored),
        (_gauge(OWN + "index_max_blocks_per_endpoint", "The exact index's bound per endpoint "
                "(kvIndexMaxBlocksPerEndpoint).", PLUGIN), lambda r: r.max_blocks_per_endpoint),
        (_gauge(UPSTREAM + "events_active_subscribers", "Endpoints whose KV events are "
                "subscribed to, connected or not.", PLUGIN), lambda r: len(r.endpoints)),
        (_gauge(UPSTREAM + "events_pool_queue_depth", "KV-event messages the receive thread "
                "handed to the event loop and not yet applied (0 without kvEventsReceiveThread)"
                ".", PLUGIN), lambda r: r.queued),
    ]  # fmt: skip
    fallback = _gauge(
        OWN + "events_fallback_endpoints",
        "Subscribed endpoints scored from the approximate index alone now, by reason: "
        "no_events (none received yet), lost (distrusted after a gap or an undecodable batch), "
        "silent (routed to, no events since kvEventsStaleAfterS).",
        ["plugin_name", "reason"],
    )
    per_endpoint: list[tuple[Family, Callable[[EndpointReading], int]]] = [
        (_counter(UPSTREAM + "events_messages_received", "KV-event messages received from the "
                  "endpoint.", ENDPOINT), lambda e: e.feed.messages),
        (_counter(UPSTREAM + "events_subscriber_reconnections", "Times the endpoint's "
                  "subscription was closed and reopened: routed to, no KV events since "
                  "kvEventsStaleAfterS (ZMQ does not reconnect after some errors).", ENDPOINT),
         lambda e: e.feed.reconnections),
        (_counter(OWN + "events_batches_applied", "KV-event batches applied to the exact index.",
                  ENDPOINT), lambda e: e.feed.applied),
        (_counter(OWN + "events_sequence_gaps", "Breaks in the sequence of the endpoint's KV events"
                  " (one per break, however many messages it skipped; its exact view is"
                  " dropped and rebuilt).", ENDPOINT),
         lambda e: e.feed.gaps),
        (_gauge(OWN + "events_exact_view", "1 while the endpoint's exact view is used, 0 while it"
                " is on the approximate fallback.", ENDPOINT), lambda e: int(e.staleness is None)),
        (_gauge(OWN + "index_blocks", "KV blocks the exact index holds for the endpoint.",
                ENDPOINT), lambda e: e.blocks),
    ]  # fmt: skip
    decode_errors = _counter(
        OWN + "events_decode_errors",
        "KV-event messages that could not be used: frames (not topic, 8-byte sequence, "
        "payload: ignored), payload (not a KV-event batch: the endpoint's view is dropped) or "
        "bounds (past a bound on what one batch may hold: dropped, the endpoint's view too).",
        ["plugin_name", "pod_identifier", "reason"],
    )
    zmq_errors = _counter(
        UPSTREAM + "events_zmq_errors",
        "ZMQ errors of the endpoint's subscription (connect: its address refused as"
        " malformed; an unreachable one shows as no_events).",
        ["plugin_name", "pod_identifier", "operation"],
    )
    for name, reading in readings:
        for family, value in per_plugin:
            family.add_metric([name], value(reading))
        stale = dict.fromkeys(STALENESS_REASONS, 0)
        for row in reading.endpoints:
            labels = [name, row.endpoint]
            for family_e, value_e in per_endpoint:
                family_e.add_metric(labels, value_e(row))
            decode_errors.add_metric([*labels, "frames"], row.feed.bad_frames)
            decode_errors.add_metric([*labels, "payload"], row.feed.bad_payloads)
            decode_errors.add_metric([*labels, "bounds"], row.feed.over_bounds)
            zmq_errors.add_metric([*labels, "connect"], row.feed.connect_errors)
            if row.staleness is not None:
                stale[row.staleness] += 1
        for reason, count in stale.items():
            fallback.add_metric([name, reason], count)
    for family, _ in per_plugin:
        yield family
    yield fallback
    for family_e, _ in per_endpoint:
        yield family_e
    yield decode_errors
    yield zmq_errors
