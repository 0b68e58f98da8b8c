"""Benchmarks: routing quality on a virtual-time fleet and over loopback, and the gateway's cost.

Subpackages, from the inputs up (each imports only those listed before it):

- `workload`: what is offered: seeded workloads and the simulated fleets they run on;
- `policies`: what is compared: peer routers' rules re-implemented (baselines), poolkeeper's
  real scheduler and flow control, and reference policies that know more than a router can;
- `results`: what is reported: metric definitions (TTFT, ITL, goodput under the SLO), result
  files, plots and tables, means over seeds;
- `fleet`: routing quality in virtual time (no sockets): sweeps over load, EPP replicas, flow
  control's fairness / flood / burst experiments;
- `live`: routing quality over loopback through `poolkeeper serve` and peer routers in front of
  simulator processes, and how many streams one simulator process sustains;
- `overhead`: what the gateway costs: added latency, CPU per request and per scheduling
  decision, the floor under it, metrics-page parsing.

`allbench` (`poolkeeper bench all`, `make bench`) runs them together. docs/benchmarks.md is the
reference for what each measures and its current results.
"""
