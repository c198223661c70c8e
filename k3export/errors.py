"""The one error type a user sees.

`UserError` is raised where input is validated: its message names the file, the field or
tensor, what was expected and what was found. The CLI prints it in a few lines and exits 2;
any other exception is an internal error and is reported with its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (a path, a config field, a checkpoint tensor, an export folder, a request)."""
