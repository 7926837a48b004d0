"""The ``lightning-ckpt`` command: read, compare and check plan files from the shell."""

from lightning_ckpt.cli.main import main

__all__ = ["main"]
