"""How log lines and messages count things: "1 peer", "2 peers", never "1 peers" or "peer(s)"."""

from __future__ import annotations

from typing import Optional


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """`n` and `noun` in the number `n` asks for: counted(1, "peer") is "1 peer", counted(3, "peer") "3 peers"
    (`plural` for nouns that do not take an s: counted(2, "batch", "batches"))."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
