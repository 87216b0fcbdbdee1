"""What the argument parsers of wcache's commands (``wcache``, ``wcache-server``, ``wcache-keeper``) share: errors
of one line, as every other start-up error of theirs is."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["CommandParser", "plain_text"]


class CommandParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose usage errors (a bad value, a missing argument, a check of the
    command's own through ``error``) are one line on stderr, ``PROG: error: MESSAGE (PROG --help for usage)``,
    with argparse's exit status 2 — not the whole usage block before the line that matters. A subcommand's parser
    is of this class too (``add_subparsers`` makes its parsers of the parent's class), its PROG ``wcache status``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help for usage)\n")


def plain_text(doc: str | None) -> str:
    """A module docstring as a command's ``--help`` description: its literal markup (````wcache````) is no help to
    a terminal."""
    return (doc or "").replace("``", "")
