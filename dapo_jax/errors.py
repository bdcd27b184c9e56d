"""The errors a user can fix: `launch` prints their message as one line and exits 1.

Every such error of the library derives from `UserError` (and from the builtin it always was, so
`except ValueError` still catches a `ConfigError`). A leaf module: anything may import it.
"""


class UserError(Exception):
  """An error in what the user gave (a setting, a file, a directory, a host): its message names the culprit."""


class ConfigError(UserError, ValueError):
  """A config value that cannot work; the message names the field and the allowed values."""


class DataError(UserError, ValueError):
  """A dataset problem; the message names the file and row."""
