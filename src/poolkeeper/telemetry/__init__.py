"""Observability of the gateway: Prometheus metrics, gRPC health, structured logs."""
