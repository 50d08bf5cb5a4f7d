"""Why a file a user handed isthmus did not decode, in words, for the one line that names
the file (issue 63: a safetensors header nested 100,000 deep stopped a job with a bare
``maximum recursion depth exceeded``), and ConfigError, what a job's wrong settings, files
and data raise. Each reader of a user's file catches :data:`DECODE_ERRORS` and raises its
own error with the path and :func:`decode_problem`.
"""

from __future__ import annotations

import struct

__all__ = ["DECODE_ERRORS", "ConfigError", "decode_problem"]


class ConfigError(ValueError):
    """A user's configuration is wrong; the message says what and where."""


DECODE_ERRORS = (OSError, ValueError, RecursionError, EOFError, struct.error)
"""What decoding a file raises when the file is wrong: unreadable (OSError); not UTF-8,
not the format or not the values (UnicodeDecodeError, JSONDecodeError, TOMLDecodeError
and numpy's refusals are ValueErrors); nested past the interpreter's recursion limit
(RecursionError: json and tomllib recurse once a level); cut short (EOFError,
struct.error)."""


def decode_problem(exc: BaseException) -> str:
    """What is wrong with the file, from what decoding it raised: one line, without the
    path (the caller names the file)."""
    if isinstance(exc, RecursionError):
        return "it nests too deep"
    if isinstance(exc, UnicodeDecodeError):
        byte = exc.object[exc.start : exc.start + 1].hex()
        return f"it is not UTF-8 text (byte 0x{byte} at offset {exc.start})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return " ".join(str(exc).split()) or type(exc).__name__
