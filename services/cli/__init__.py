"""The `baton` command line: serve, up (the launcher), generate, check-stack, health, trace."""
from baton.services.cli.main import main

__all__ = ["main"]
