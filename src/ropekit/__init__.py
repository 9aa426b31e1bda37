"""ropekit: positional encodings and cheap context extension for transformer LMs."""

__version__ = "0.1.0"
