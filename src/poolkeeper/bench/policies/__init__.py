"""What the routing benchmarks compare: every policy behind one interface (`routers.make_policy`).

- `baselines` (+ `prefixtrees`): peer routers' rules re-implemented from their descriptions;
- `schedpolicy`, `flowpolicy`: poolkeeper's real scheduler, admission and flow control;
- `reference_policies`: points of comparison that know more than a router can, never baselines;
  `kv_event_phase`: more of them, the step phase from the steps that publish KV events.
"""
