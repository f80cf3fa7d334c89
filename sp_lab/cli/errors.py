"""The one error type of the command line: a problem the user can fix."""


class CliError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""
