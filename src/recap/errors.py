"""Errors the user can act on.

`InputError` marks bad input (a missing image, an unknown model, an empty prompt...). The CLI
prints its message on one line and exits with status 2 instead of showing a traceback.
"""


class RecapError(Exception):
    """Base class of the errors RECAP raises on purpose."""


class InputError(RecapError, ValueError):
    """The user asked for something that cannot be done; the message says what and why."""
