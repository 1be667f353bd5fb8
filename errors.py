"""
The project's one error type for bad input. It lives alone so that what only reads and writes files (the
configurator, tokenizer.py, the prepare scripts) can raise it without importing torch.
"""


class UserError(ValueError):
    """Bad input from a user. The message says what was wrong and how to fix it; scripts print it alone, as one
    `error: ...` line, with exit code 2."""
