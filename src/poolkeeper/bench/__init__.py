"""Benchmarks: workloads, baseline routing policies, virtual-time and live runs, reports."""
