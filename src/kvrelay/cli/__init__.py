"""The `kvrelay` command line: one Typer app (see ``app.py``), thin commands over the library."""

from kvrelay.cli.app import app, main

__all__ = ["app", "main"]
