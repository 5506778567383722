"""The one exception type users see as a one-line message (see cli.main), an argument parser whose errors are one
line too, and ``warn``: every warning dstrain prints, as one line."""

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator


class DstrainError(Exception):
    """A user-facing error: one line that names the file, the key and the fix.

    The CLI prints it as ``dstrain: error: <message>`` and exits with status 2;
    no traceback, nothing the user had is touched.
    """


class InputError(DstrainError):
    """A bad value of one input, named by its key and with its fix, but not by its file: the check phase that read
    the file (``naming_files``) puts the file in front. ``input``: which of the check phase's files ("recipe",
    "ds_config") the key is in; ``also``: another input the message names as "the <input>" (a contradiction between
    two files), which the check phase names by its file too."""

    def __init__(self, message: str, input: str = "ds_config", also: str | None = None):
        super().__init__(message)
        self.input = input
        self.also = also


@contextlib.contextmanager
def naming_files(**files: str | os.PathLike) -> Iterator[None]:
    """Inside, an ``InputError`` about one of ``files`` (by its input's name) becomes the one line
    ``<file>: <message>``."""
    try:
        yield
    except InputError as e:
        if e.input not in files:
            raise
        message = str(e)
        if e.also in files:
            message = message.replace(f"the {e.also}", str(files[e.also]), 1)
        raise DstrainError(f"{files[e.input]}: {message}") from None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's errors as one line naming the option and ``--help`` (argparse prints the usage first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(2)


class DiskFull(DstrainError):
    """A checkpoint that did not fit on its filesystem (ENOSPC/EDQUOT on any rank). The training command exits with
    ``DISK_FULL_EXIT``, which slurm/train.sbatch does not requeue: a requeue would meet the same full disk."""


DISK_FULL_EXIT = 28  # ENOSPC's errno number


_quiet = 0  # > 0 inside ``quiet_warnings``


def warn(message: str) -> None:
    """Tell the user something went wrong that does not stop the command: ``dstrain: warning: <message>``, one line
    on stderr (a training rank's console copies it into its log). Not ``warnings.warn``: Python prints that with
    the path and the source line of its caller, and filters repeats by call site."""
    if _quiet:
        return
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"dstrain: warning: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_warnings(quiet: bool = True) -> Iterator[None]:
    """``warn`` prints nothing inside (when ``quiet``): what every rank finds is said once, by rank 0."""
    global _quiet
    _quiet += int(quiet)
    try:
        yield
    finally:
        _quiet -= int(quiet)
