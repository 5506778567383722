"""The one exception type users see as a one-line message (see cli.main)."""


class DstrainError(Exception):
    """A user-facing error: one line that names the file, the key and the fix.

    The CLI prints it as ``dstrain: error: <message>`` and exits with status 2;
    no traceback, nothing the user had is touched.
    """
