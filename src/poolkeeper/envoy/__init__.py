"""Envoy in front of the EPP: bootstrap generation and the supervised Envoy child process."""
