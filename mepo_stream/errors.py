"""The one kind of error a user fixes by changing what they asked for, not the code.

A ``ConfigError`` says what is wrong and which option fixes it; the ``mepo`` command prints it as one line
(``mepo: error: ...``) and exits with status 2, before any work, where other exceptions keep their traceback.

A refusal is one of these, never a bare ``ValueError``: code that turns a refusal into a message or a metric catches
``ConfigError``, so a bug's ``ValueError`` keeps its traceback.

Example:
    >>> str(ConfigError("runs/b has no sigma_pre: use --mepo_rep runs/b"))
    'runs/b has no sigma_pre: use --mepo_rep runs/b'
"""


class ConfigError(ValueError):
    """A configuration that cannot work, with what to do instead."""


class StateRefused(ConfigError):
    """A saved state (a learner checkpoint, a partition's state) these options cannot take: another format, another
    model's, or one that cannot be split or merged; the message says whose it is and what to do."""
