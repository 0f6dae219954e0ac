"""The one exception type the command line turns into a single line on stderr instead of a traceback."""


class UserError(Exception):
    """Something the user can fix: a malformed input, an unreachable host, a failed job. The message says what
    is wrong, where (file and line, host, node), and what to do."""

    exit_code = 2
    prefix = "error: "  # how the command line introduces the message ("" for an outcome that is no error)
