"""Routing quality in virtual time: real routing code on the simulator's fleet, no sockets.

- `simrun`: one run (scenario, policy, load as a multiple of the fleet's capacity) and the
  capacity estimate itself;
- `sweep`: every policy at every load on one scenario (`bench sim`);
- `replicas`: prefix affinity when N EPP replicas each see 1/N of the requests;
- `flowbench`: flow control's fairness, flood and burst experiments (`bench flow`).
"""
