"""Composition root of `poolkeeper serve`: builds every part and runs them until drained."""
