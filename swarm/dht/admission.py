"""Private swarms: the run owner admits a peer by signing an invite bound to that peer's id (`swarm-peer invite`),
the peer puts it in every entry it writes and presents it on every stream it opens, and every node of a private run
refuses entries and streams of peers without a valid invite of the owner. Records stay readable by anyone who can
reach a node: admission keeps strangers from taking part, not from reading.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPublicKey

from swarm.config import RecipeError
from swarm.dht.validation import CLOCK_SLACK, Identity, subkey_owner

INVITE_DOMAIN = b"swarm invite v1\x00"  # what an owner's signature is about, so it signs nothing else
INVITE_FIELD = "invite"  # where a peer of a private run puts its token in every entry it writes
MAX_TOKEN_CHARS = 2048  # a 2048-bit owner key gives tokens of about 480 characters
MAX_CHECKED = 4096  # tokens whose verdict a node remembers (an RSA check each is cheap, but not free)
DAY = 86400.0
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")  # base58, as libp2p prints peer ids
_OWNER_MARKER = b"[owner:"


class InviteError(ValueError):
    """An invite token that cannot be used; the message says why in one line."""


class AdmissionError(RecipeError):
    """This peer may not take part in the private run it tried to join; the message says what to do."""


@dataclass(frozen=True)
class Invite:
    """The run owner's word that `peer_id` may take part in its private runs until `expires` (unix seconds)."""

    owner: str  # the owner's peer id
    peer_id: str
    expires: int
    signature: bytes  # the owner's RSA signature (PKCS#1 v1.5, SHA-256, as hivemind signs) of `message()`

    def message(self) -> bytes:
        return INVITE_DOMAIN + msgpack.packb([self.owner, self.peer_id, self.expires])

    @classmethod
    def sign(cls, owner: Identity, peer_id: str, days: float, now: Optional[float] = None) -> "Invite":
        """An invite for `peer_id`, valid `days` days from `now`, signed with the owner's identity key. Raises
        InviteError for something that is not a peer id or a non-positive lifetime."""
        if not _PEER_ID.match(peer_id):
            raise InviteError(f"{peer_id!r} is not a peer id (the volunteer prints theirs with `swarm-peer id`)")
        if not 0 < days <= 3650:
            raise InviteError(f"an invite lasts between 0 and 3650 days, not {days:g}")
        expires = int((time.time() if now is None else now) + days * DAY)
        unsigned = cls(owner.peer_id, peer_id, expires, b"")
        signature = base64.b64decode(owner.private_key.sign(unsigned.message()))
        return cls(owner.peer_id, peer_id, expires, signature)

    def token(self) -> str:
        """One line of URL-safe base64, to paste after `swarm-peer join --invite`."""
        packed = msgpack.packb([self.owner, self.peer_id, self.expires, self.signature])
        return base64.urlsafe_b64encode(packed).rstrip(b"=").decode()

    @classmethod
    def parse(cls, token: Any) -> "Invite":
        """The invite a token carries (not yet checked against any owner); InviteError if it is not one."""
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
            raise InviteError("not an invite token (copy the whole line `swarm-peer invite` printed)")
        try:
            fields = msgpack.unpackb(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        except (binascii.Error, ValueError, msgpack.UnpackException):
            raise InviteError("not an invite token (copy the whole line `swarm-peer invite` printed)") from None
        if not (isinstance(fields, list) and len(fields) == 4 and isinstance(fields[0], str)
                and isinstance(fields[1], str) and isinstance(fields[2], int) and not isinstance(fields[2], bool)
                and isinstance(fields[3], bytes)):
            raise InviteError("not an invite token (copy the whole line `swarm-peer invite` printed)")
        return cls(*fields)

    def problem(self, owner: str, owner_key: str, peer_id: str, now: float) -> Optional[str]:
        """Why this invite does not admit `peer_id` to a run of `owner` (whose public key, OpenSSH form, is
        `owner_key`) at `now`, or None if it does."""
        if self.owner != owner:
            return f"it was signed by {self.owner}, not by this run's owner {owner}"
        if self.peer_id != peer_id:
            return f"it is for peer {self.peer_id}, not for {peer_id}"
        if not _verify(owner_key, self.message(), self.signature):
            return "its signature is not the run owner's (a forged or damaged token)"
        if self.expires < now - CLOCK_SLACK:
            return f"it expired on {_utc(self.expires)}"
        return None


def _verify(public_key: str, message: bytes, signature: bytes) -> bool:
    try:
        return RSAPublicKey.from_bytes(public_key.encode()).verify(message, base64.b64encode(signature))
    except Exception:  # noqa: BLE001 - a key that does not parse admits nobody
        return False


def _utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Admission:
    """Who may take part in one private run: its owner, and each peer whose invite of that owner checks out.
    Peers admitted are remembered (until their invite expires) from the invites seen in entries and streams."""

    def __init__(self, owner: str, owner_key: str, clock: Callable[[], float] = time.time):
        self.owner, self.owner_key, self.clock = owner, owner_key, clock
        self.token: Optional[str] = None  # ours: added to every entry we write, presented on every stream we open
        self.offered: dict[str, str] = {}  # peer id -> invite the owner publishes with its recipe (--allowlist)
        self._checked: dict[str, Optional[Invite]] = {}  # token -> the invite if owner and signature check out
        self._admitted: dict[str, int] = {}  # peer id -> expiry of the latest valid invite seen for it

    def admits(self, peer_id: str, token: Any = None) -> bool:
        """Whether `peer_id` may take part: it is the owner, or `token` is a valid invite for it; without a token,
        whether a valid invite for it was seen before (and has not expired)."""
        if peer_id == self.owner:
            return True
        if token is not None:
            return self._valid(peer_id, token)
        return self._admitted.get(peer_id, -1) >= self.clock() - CLOCK_SLACK

    def entry_admitted(self, writer: str, value: Any) -> bool:
        """Whether an entry that `writer` signed counts: the owner's, or one that carries a valid invite for
        `writer` itself (each entry stands on its own, whatever this node saw before)."""
        if writer == self.owner:
            return True
        return isinstance(value, dict) and self._valid(writer, value.get(INVITE_FIELD))

    def _valid(self, peer_id: str, token: Any) -> bool:
        invite = self._check(token)
        if invite is None or invite.peer_id != peer_id or invite.expires < self.clock() - CLOCK_SLACK:
            return False
        self._admitted[peer_id] = max(invite.expires, self._admitted.get(peer_id, 0))
        return True

    def _check(self, token: Any) -> Optional[Invite]:
        if not isinstance(token, str):
            return None
        if token not in self._checked:
            if len(self._checked) >= MAX_CHECKED:  # bounded against writers minting endless tokens
                self._checked.clear()
            try:
                invite = Invite.parse(token)
            except InviteError:
                invite = None
            if invite is not None and invite.problem(self.owner, self.owner_key, invite.peer_id, -float("inf")):
                invite = None  # expiry is checked at each use, the rest once
            self._checked[token] = invite
        return self._checked[token]

    def join_with(self, identity: Identity, token: Optional[str]) -> None:
        """Take `token` (else the owner's allowlist invite for us, see `offered`) as this peer's invite;
        AdmissionError, one line saying what to do, if it does not admit us."""
        peer_id = identity.peer_id
        if peer_id == self.owner:
            return
        token = token or self.offered.get(peer_id)
        if not token:
            if identity.ephemeral:
                raise AdmissionError("this run is private: print your peer id with `swarm-peer id --identity-path "
                                     "FILE`, ask the run owner for an invite (swarm-peer invite <your peer id>), "
                                     "then join with --identity-path FILE --invite TOKEN")
            raise AdmissionError(f"this run is private: ask the run owner for an invite (swarm-peer invite "
                                 f"{peer_id}), then join with --invite TOKEN")
        try:
            problem = Invite.parse(token).problem(self.owner, self.owner_key, peer_id, self.clock())
        except InviteError as e:
            problem = str(e)
        if problem is not None:
            raise AdmissionError(f"this run is private and your invite does not admit you: {problem}; ask the run "
                                 f"owner for an invite (swarm-peer invite {peer_id})")
        self.token = token
        self.admits(peer_id, token)


class AdmissionValidator(RecordValidatorBase):
    """Every node of a private run refuses, for any key, entries under an owned subkey whose writer is neither the
    run owner nor carries a valid invite of the owner for its own peer id in the entry (`INVITE_FIELD`). Unowned
    entries are left to SwarmValidator's rules (readers ignore them)."""

    def __init__(self, owner: str, owner_key: str):
        self.admission = Admission(owner, owner_key)

    def validate(self, record: DHTRecord) -> bool:
        if _OWNER_MARKER not in record.subkey:
            return True
        try:
            writer = subkey_owner(DHTProtocol.serializer.loads(record.subkey))
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # noqa: BLE001 - an entry that does not decode is hostile or broken
            return False
        return writer is not None and self.admission.entry_admitted(writer, value)

    @property
    def priority(self) -> int:
        return 4  # after RSASignatureValidator (10) stripped the signature, which also proves the writer

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, AdmissionValidator):
            return False
        self.admission = other.admission  # a node follows one run: the newest owner's
        return True


def allowlist_invites(owner: Identity, path: str, days: float) -> dict[str, str]:
    """{peer id: token} for the peer ids in file `path` (one a line; blank lines and # comments skipped), signed
    by `owner`. Raises InviteError naming the file and line of a bad entry."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise InviteError(f"cannot read allowlist {path}: {e.strerror}") from None
    invites = {}
    for number, line in enumerate(lines, 1):
        peer_id = line.split("#", 1)[0].strip()
        if peer_id:
            try:
                invites[peer_id] = Invite.sign(owner, peer_id, days).token()
            except InviteError as e:
                raise InviteError(f"allowlist {path} line {number}: {e}") from None
    return invites
