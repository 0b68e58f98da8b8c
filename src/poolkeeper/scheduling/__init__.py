"""Scheduling: pick the best endpoint for a request (filters -> weighted scorers -> picker).

Pure and synchronous: plugins read immutable snapshots; no I/O, injected clock and randomness.
"""
