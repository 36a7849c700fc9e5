"""The one exception that the CLI turns into a single line and exit code 2, and the one place that
turns other libraries' and the OS's errors into such a line (`explain`)."""
from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a config, a file, a flag. The message is one line naming it."""


def explain(exc: BaseException) -> str | None:
    """One line saying what went wrong and what to do, for errors a user can cause or fix
    (bad files, a full disk, permissions); None for a bug, which should keep its traceback."""
    if isinstance(exc, UserError):
        return str(exc)
    return None
