"""Built-in scheduler plugins: filters, scorers, pickers, the prefix index scorer, profile handlers.

`builtins.builtin_registry()` registers every one of them in one place.
"""
