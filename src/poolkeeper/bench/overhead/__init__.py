"""What the gateway costs (`bench overhead`).

- `scheduler_decision`: CPU time of one scheduling decision at 10 / 100 / 1,000 endpoints;
- `gateway_overhead`: latency Envoy + EPP add over a direct call, EPP requests/s per core;
  `overhead_peers` the same for peer routers, `overhead_floor` for Envoy alone and Envoy + a
  do-nothing ext_proc;
- `promtext_parse`: CPU per scraped metrics page;
- `overhead`: runs the first two in child processes and stores their output.
"""
