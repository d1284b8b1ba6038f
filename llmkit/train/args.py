"""The argument parser of every ``llmkit`` job's command line (``train``, ``plan``, ``rlhf``...)."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
