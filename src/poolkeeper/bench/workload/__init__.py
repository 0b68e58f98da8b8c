"""What the benchmarks offer: seeded workloads (`workloads`), the fleets they run on (`scenarios`).

Shared by the virtual-time (`bench.fleet`) and loopback (`bench.live`) runs, so both replay the
same arrivals on the same simulated engines.
"""
