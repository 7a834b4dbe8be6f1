"""A slot file's name as llama-server checks it (``POST /slots/{id}``).

The frontend refuses a bad name before anything is sent, and the worker
checks it again before it touches its ``--slot-save-path``
(``workers.model.slot_files``): one rule, here, for both.
"""

from __future__ import annotations

#: llama-server's words for a name it refuses.
INVALID_FILENAME = "Invalid filename"

#: Characters llama.cpp refuses besides control characters: look-alikes of
#: ``.``, ``/`` and ``\\``, the replacement character, the byte order mark,
#: and the characters some file systems forbid.
_FORBIDDEN = frozenset('\uff0e\u2215\u2216\ufffd\ufeff:*?"<>|/\\')


def valid_filename(name: str) -> bool:
    """llama.cpp's ``fs_validate_filename`` (``common/common.cpp``): a bare
    file name of at most 255 bytes, no separators, no ``..``, no control or
    look-alike characters, no leading or trailing space, no trailing dot."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not name or len(encoded) > 255:
        return False
    for char in name:
        c = ord(char)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or char in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)
