"""The error every configuration check raises."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""
