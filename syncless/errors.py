"""Errors that carry a message meant for the user, not a traceback."""


class UsageError(Exception):
    """Bad input: the message says what was wrong, what was expected and what to do.

    The CLI prints it as ``syncless: error: <message>`` and exits with status 2.
    """
