"""Log lines at the price of the C call: rclpy's logger without its caller lookup.

rclpy's `logger.info(text)` finds its caller before the one C call that writes the line to the
console, /rosout and the log file: per line, 5 calls of `inspect.getframeinfo` (source lookups)
and 4-5 of `os.path.realpath` (an lstat per path component), 270 us p50 on the 2-core CPU
machine against 5 us for the C call alone, all of it holding the GIL. One such
line per served request (services.py then wrote them on a thread of its own) held the GIL while the
next request waited to be woken and while control ticks were due: service round trips went
from ~1.8 ms to ~1.1 ms and the 500 Hz loop's overruns from ~100 to ~15 in a few seconds of
back-to-back calls, on that machine, without it.

`FastLog` makes the same C call rclpy makes, with the caller taken from the frame itself (its
function, file and line, as rclpy reports them), so console, /rosout and log files see the same
line. No throttle/once/skip_first filters here: a throttled line keeps rclpy's logger.

`forward_core_logs` does the same for Python `logging` records: the core (runtime, capsules,
policies) never imports ROS and logs with `logging`, so without it an eviction (INFO) was
never seen and a warning reached only the process's stderr, bare, never /rosout.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from rclpy.logging import LoggingSeverity

try:  # the extension rclpy's own logger calls (rclpy/impl/rcutils_logger.py)
    from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

    _emit = _rclpy.rclpy_logging_rcutils_log
    _enabled = _rclpy.rclpy_logging_logger_is_enabled_for
except (ImportError, AttributeError):  # pragma: no cover - another rclpy: its logger it is
    _emit = _enabled = None


def printable(text: str) -> str:
    """`text` as the C logger takes it. A file name that is not UTF-8 (a capsule copied from a
    FAT stick) reaches Python as surrogates, which rcutils' logging refuses: the whole line was
    lost to a "Logging error" traceback on stderr. Such characters are written escaped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class FastLog:
    """`info`/`warning`/`error` of an rclpy logger (`node.get_logger()`), minus the lookup."""

    def __init__(self, logger) -> None:
        self.logger = logger
        self.name = logger.name

    def info(self, text: str) -> None:
        text = printable(text)
        if not self._write(LoggingSeverity.INFO, text):
            self.logger.info(text)  # one call site per severity: rclpy insists on it

    def warning(self, text: str) -> None:
        text = printable(text)
        if not self._write(LoggingSeverity.WARN, text):
            self.logger.warning(text)

    def error(self, text: str) -> None:
        text = printable(text)
        if not self._write(LoggingSeverity.ERROR, text):
            self.logger.error(text)

    def _write(self, severity: LoggingSeverity, text: str) -> bool:
        """True when done here (written, or below the logger's level); False: use rclpy's."""
        global _emit
        if _emit is None:
            return False
        try:
            if not _enabled(self.name, severity):
                return True
            f = sys._getframe(2)  # whoever called info/warning/error
            code = f.f_code
            _emit(severity, self.name, text, code.co_name, code.co_filename, f.f_lineno)
        except TypeError:  # pragma: no cover - another signature: rclpy's way from now on
            _emit = None
            return False
        return True


CORE_LOGGER = "flashrt_ros"


def _severity(levelno: int) -> LoggingSeverity:
    if levelno >= logging.ERROR:
        return LoggingSeverity.ERROR
    if levelno >= logging.WARNING:
        return LoggingSeverity.WARN
    return LoggingSeverity.INFO if levelno >= logging.INFO else LoggingSeverity.DEBUG


class RosLogHandler(logging.Handler):
    """Python log records written as lines of an rclpy logger (console, /rosout, log file),
    each prefixed with the module that logged it (`[runtime.engine] ...`)."""

    def __init__(self, logger) -> None:
        super().__init__()
        self.logger = logger
        self.name_ = logger.name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = printable(
                f"[{record.name.removeprefix(CORE_LOGGER + '.')}] {self.format(record)}"
            )
            severity = _severity(record.levelno)
            if _emit is not None:
                if _enabled(self.name_, severity):
                    _emit(
                        severity, self.name_, text, record.funcName, record.pathname, record.lineno
                    )
                return
            if severity >= LoggingSeverity.ERROR:  # pragma: no cover - another rclpy
                self.logger.error(text)
            elif severity == LoggingSeverity.WARN:  # pragma: no cover
                self.logger.warning(text)
            else:  # pragma: no cover
                self.logger.info(text)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def forward_core_logs(logger) -> Callable[[], None]:
    """Send the core's log records from INFO up, and any other library's from WARNING up (the
    root logger's level), to `logger` (the node's); returns what undoes it, for the exit,
    before rclpy shuts down."""
    handler = RosLogHandler(logger)
    root, core = logging.getLogger(), logging.getLogger(CORE_LOGGER)
    level = core.level
    core.setLevel(logging.INFO)
    root.addHandler(handler)

    def undo() -> None:
        root.removeHandler(handler)
        core.setLevel(level)

    return undo


class Throttle:
    """At most one line per `seconds` for a repeated event, saying how many were not written:
    a planner streaming goals at the control rate wrote a line per goal (100+ a second), and
    a poisoned session repeated its ERROR with every /diagnostics publish (86 400 a day).
    Thread-safe: events come from the executor, the control thread and the watchdog."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._last = -1e18
        self._quiet = 0  # events since the last line, not written
        self._text = ""
        self._held: str | None = None  # the newest event's line held back (due(line=...))

    def reset(self) -> None:
        """The condition ended: its next occurrence is written at once."""
        with self._lock:
            self._last, self._quiet, self._text, self._held = -1e18, 0, "", None

    def due(self, text: str = "", line: str | None = None) -> str | None:
        """The suffix to write with this event's line ("" or " (N more since the last line)"),
        or None when the line is held back. A new `text` is always written (a new reason).
        `line`: this event's line, kept while held back so that overdue() can write it."""
        with self._lock:
            now = time.monotonic()
            if text == self._text and now - self._last < self.seconds:
                self._quiet += 1
                self._held = line
                return None
            # the count is of this reason's lines (a new reason's line gets none)
            same = text == self._text
            more = f" ({self._quiet} more since the last line)" if self._quiet and same else ""
            self._last, self._quiet, self._text, self._held = now, 0, text, None
            return more

    def overdue(self) -> str | None:
        """The newest held-back line, with the count, once its window has passed; else None.
        Called now and then (each /diagnostics publish): the last goal of a stream that stopped
        is written, not left unsaid until the next goal minutes later."""
        with self._lock:
            now = time.monotonic()
            if self._held is None or now - self._last < self.seconds:
                return None
            line = f"{self._held} (the last of {self._quiet} since the last line)"
            self._last, self._quiet, self._held = now, 0, None
            return line
