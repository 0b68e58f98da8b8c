"""Routing quality over loopback: the same workload through `poolkeeper serve` and peer routers.

- `live`: fresh simulator processes and the router under test per run (`bench live`);
- `loadgen`: the open-loop streaming HTTP load generator (127.0.0.1 only);
- `sim_capacity`: how many streams one simulator process sustains before it distorts latency
  (what bounds a live run's fleet size).
"""
