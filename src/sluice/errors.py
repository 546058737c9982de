"""Errors that reach a person: each carries a one-line message that says what to do."""


class SluiceError(Exception):
    """Base class for errors shown to a user as one line."""


class CLIError(SluiceError):
    """A command-line problem (bad flag, missing directory, port in use)."""


class ConfigError(SluiceError):
    """An invalid configuration file or environment override."""
