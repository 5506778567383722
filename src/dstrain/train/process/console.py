"""What a training rank shows on the console, and where the rest goes.

By default the console shows dstrain's own lines (rank 0's progress and evaluation, dstrain's warnings, each one
``dstrain: warning: ...`` line from dstrain.errors.warn, errors); DeepSpeed's logger, Python warnings (only other
libraries raise them; one raised at a line of dstrain's, by stacklevel, is theirs too) and loggers go to the rank's
log, ``run_dir/logs/rank<r>.log``, which also gets a copy of everything the console shows. ``--verbose`` or
DSTRAIN_VERBOSE=1 (for launchers that pass no flags) shows it all on the console as well. Errors are never hidden:
ERROR records of any logger, tracebacks and whatever a C/C++ library writes straight to the process's file
descriptors still reach the console.

Until the run folder is claimed the log is kept in memory; a rank that fails before that prints it with its error.
``start`` must run before ``import deepspeed`` to catch the accelerator line DeepSpeed logs while importing
(``python -m dstrain.train`` does so in ``__main__``); it imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from dstrain.run_dir import RunDir

VERBOSE_ENV = "DSTRAIN_VERBOSE"
# Loggers that print through handlers of their own instead of propagating to the root logger (torch._logging's).
_OWN_HANDLERS = ("torch",)
_FORMAT = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s %(filename)s:%(lineno)d] %(message)s")


def verbose_requested(argv: list[str]) -> bool:
    return "--verbose" in argv or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _Log:
    """The rank's log: (text, hidden from the console) in memory until ``open``, then logs/rank<r>.log."""

    def __init__(self):
        self.lines: list[tuple[str, bool]] = []
        self.file = None
        self.disk_full = False  # the log stops on a full disk; the console goes on, and the save that hit it says so

    def write(self, text: str, hidden: bool) -> None:
        if self.file is None:
            self.lines.append((text, hidden))
        elif not self.disk_full:
            try:
                self.file.write(text)
                self.file.flush()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self.disk_full = True

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:  # the last buffered lines of a log on a full disk
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
        self.file.write("".join(text for text, _ in self.lines))
        self.file.flush()
        self.lines = []


class _Tee:
    """sys.stdout / sys.stderr: the console, copied into the log."""

    def __init__(self, stream, log: _Log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text, hidden=False)
        return self.stream.write(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


class _Route(logging.Handler):
    """A record goes to the log, and to the console (copied into the log there) only when verbose or an error.
    On the root logger: other libraries' loggers. On DeepSpeed's logger it is a filter that stops every record
    before DeepSpeed's own stdout handler, whose level (WARNING) would drop the INFO lines that --verbose shows."""

    def __init__(self, session: Session):
        super().__init__(logging.DEBUG)
        self.session = session

    def emit(self, record: logging.LogRecord) -> None:
        text = _FORMAT.format(record) + "\n"
        if record.levelno >= logging.ERROR:
            sys.stderr.write(text)
        elif self.session.verbose:
            sys.stdout.write(text)
        else:
            self.session.log.write(text, hidden=True)

    def stop(self, record: logging.LogRecord) -> bool:
        self.emit(record)
        return False


class Session:
    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.log = _Log()
        self.route = _Route(self)
        self.adopted: list[logging.Handler] = []
        self.streams = sys.stdout, sys.stderr
        self.showwarning = warnings.showwarning
        self.deepspeed = logging.getLogger("DeepSpeed")  # DeepSpeed's LoggerFactory takes this one and keeps filters
        self.deepspeed_level = self.deepspeed.level

    def install(self) -> None:
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.log), _Tee(sys.stderr, self.log)
        self.deepspeed.addFilter(self.route.stop)
        # INFO into the log; DeepSpeed's import sets WARNING, distributed.init sets INFO again
        self.deepspeed.setLevel(logging.INFO)
        logging.getLogger().addHandler(self.route)
        warnings.showwarning = self.show_warning
        self.adopt_handlers()

    def adopt_handlers(self) -> None:
        """Route the records of loggers with their own console handlers too (those set up since the last call)."""
        for name in _OWN_HANDLERS:
            for handler in logging.getLogger(name).handlers:
                if handler not in self.adopted:
                    handler.addFilter(self.route.stop)
                    self.adopted.append(handler)

    def show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if self.verbose:
            sys.stderr.write(text)
        else:
            self.log.write(text, hidden=True)

    def uninstall(self) -> None:
        sys.stdout, sys.stderr = self.streams
        self.deepspeed.removeFilter(self.route.stop)
        self.deepspeed.setLevel(self.deepspeed_level or logging.WARNING)  # NOTSET: DeepSpeed not loaded yet
        logging.getLogger().removeHandler(self.route)
        warnings.showwarning = self.showwarning
        for handler in self.adopted:
            handler.removeFilter(self.route.stop)
        if self.log.file is not None:
            self.log.close()


_session: Session | None = None


def start(verbose: bool) -> Session:
    """Route this process's output (idempotent: a second call only updates ``verbose``)."""
    global _session
    if _session is None:
        _session = Session(verbose)
        _session.install()
    _session.verbose = _session.verbose or verbose
    _session.adopt_handlers()
    return _session


def active() -> bool:
    return _session is not None


def open_log(files: RunDir, rank: int) -> Path | None:
    """Once the run folder is claimed: the log so far, and all that follows, into run_dir/logs/rank<r>.log."""
    if _session is None:
        return None
    path = files.log(rank)
    _session.adopt_handlers()
    _session.log.open(path)
    return path


def end(error: str | None = None) -> None:
    """Restore the process's output. ``error``: the traceback of a failed rank, which the interpreter prints on the
    console after this; it goes into the log, or, before the log file opened, what the rank hid is printed."""
    global _session
    if _session is None:
        return
    session, _session = _session, None
    if error is not None and session.log.file is not None:
        session.log.write(error, hidden=True)
    elif error is not None:
        session.streams[1].write("".join(text for text, hidden in session.log.lines if hidden))
    session.uninstall()
