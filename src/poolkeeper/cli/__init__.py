"""The `poolkeeper` command line: one module per group of subcommands."""
