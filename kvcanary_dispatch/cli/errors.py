"""The command line's one error type."""


class CliError(Exception):
    """A run-time error reported as one line, exit status 2."""
