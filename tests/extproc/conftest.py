"""Fixtures for the ext_proc protocol tests (helpers live in extproc_fakes)."""

from extproc_fakes import envoy, router

__all__ = ["envoy", "router"]
