"""The `freight` command (jobs/cli/main.py) and its subcommands, the HTTP client and progress display.
The only part of jobs/ that may use the worker package, and only lazily (inside functions)."""
