"""What the gateway costs (`bench overhead`).

- `scheduler_decision`: CPU time of one scheduling decision at 10 / 100 / 1,000 endpoints;
- `gateway_overhead`: latency Envoy + EPP add over a direct call, EPP requests/s per core
  (its command line; `overhead_gateway` the gateway under test, `overhead_loads` what is sent
  through it, `overhead_protocol` the ext_proc layer alone); `overhead_peers` the same for
  peer routers, `overhead_floor` for Envoy alone and Envoy + a do-nothing ext_proc;
- `promtext_parse`: CPU per scraped metrics page;
- `overhead`: runs the first two in child processes and stores their output.
"""
