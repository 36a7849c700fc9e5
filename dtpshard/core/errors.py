"""The one exception that the CLI turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a config, a file, a flag. The message is one line naming it."""
