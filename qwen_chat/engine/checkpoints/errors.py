"""The one error of checkpoint and adapter checks (``layout``, ``fp8_format``, ``adapters``), in a module of its
own so that those modules import it without importing each other."""


class CheckpointError(ValueError):
    """A checkpoint (or adapter) folder is incomplete or does not fit this model; the message is one line
    that names the file."""
