"""The one exception type users see as a one-line message (see cli.main), and an argument parser whose
errors are one line too."""

import argparse
import sys


class DstrainError(Exception):
    """A user-facing error: one line that names the file, the key and the fix.

    The CLI prints it as ``dstrain: error: <message>`` and exits with status 2;
    no traceback, nothing the user had is touched.
    """


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's errors as one line naming the option and ``--help`` (argparse prints the usage first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(2)


class DiskFull(DstrainError):
    """A checkpoint that did not fit on its filesystem (ENOSPC/EDQUOT on any rank). The training command exits with
    ``DISK_FULL_EXIT``, which slurm/train.sbatch does not requeue: a requeue would meet the same full disk."""


DISK_FULL_EXIT = 28  # ENOSPC's errno number
