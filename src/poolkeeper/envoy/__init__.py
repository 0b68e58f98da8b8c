"""Envoy in front of the EPP: bootstrap generation, the supervised Envoy child process, and the
GatewayConfig sections about the network edge (`config.py`: listeners, edge)."""
