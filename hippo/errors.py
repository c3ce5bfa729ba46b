"""User-facing error hierarchy.

Every error names what is wrong and what to do about it; the CLI prints the message on one line.
"""


class HippoError(Exception):
    """Base class of every error hippo raises on purpose."""


class ConfigError(HippoError, ValueError):
    """An option has a bad value (keep ratio out of range, gamma < 1, unknown option...)."""


class PluginError(HippoError, LookupError):
    """Unknown plugin name, duplicate registration, or a broken plugin package."""


class ModelError(HippoError):
    """A model or checkpoint cannot be used: missing weights, unsupported backbone, vocabulary mismatch."""


class InputError(HippoError, ValueError):
    """The generation inputs are unusable: missing keys, batch > 1, prompt longer than the context."""


class VideoError(InputError):
    """A video file is missing, unreadable, corrupt or has no frames."""


class UnsupportedError(HippoError, NotImplementedError):
    """A generation feature hippo cannot keep lossless (beam search, some logits processors...)."""


class MemoryBudgetError(HippoError, MemoryError):
    """A video context would not fit: its KV cache and features exceed the memory left or the budget."""


def one_line(exc: BaseException) -> str:
    """The error's message on one line, as the CLI prints it after 'hippo: error: '."""
    return " ".join(str(exc).split()) or type(exc).__name__
