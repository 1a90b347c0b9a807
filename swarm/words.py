"""How log lines and messages count things ("1 peer", "2 peers", never "1 peers" or "peer(s)") and quote what a peer
sent (`shown`)."""

from __future__ import annotations

import reprlib
from typing import Optional


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """`n` and `noun` in the number `n` asks for: counted(1, "peer") is "1 peer", counted(3, "peer") "3 peers"
    (`plural` for nouns that do not take an s: counted(2, "batch", "batches"))."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 60, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 6


def shown(value: object, width: int = 80) -> str:
    """repr(value) in at most `width` characters, its lists and maps cut at 3 levels: how a message quotes what a peer
    sent, which repr() could not print (a list nested a thousand deep raises RecursionError) or would make one line
    of a log as long as the message."""
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a value that cannot be shown is named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[:width - 3] + "..."
