"""`python -m poolkeeper` runs the CLI."""

from poolkeeper.cli.main import main

raise SystemExit(main())
