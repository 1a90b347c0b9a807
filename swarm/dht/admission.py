"""Private swarms: the run owner admits a peer to one run by signing an invite bound to that run and that peer's id
(`swarm-peer invite`), and takes invites back with a signed revocation list that its bootstrap publishes
(`swarm-peer revoke`). The peer puts its invite in every entry it writes and presents it on every stream it opens,
and every node of a private run refuses entries and streams of peers without a valid, unrevoked invite of the owner
for that run. Records stay readable by anyone who can reach a node: admission keeps strangers from taking part, not
from reading.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import os
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPublicKey

from swarm.config import RecipeError
from swarm.dht.validation import CLOCK_SLACK, Identity, subkey_owner
from swarm.words import shown

INVITE_DOMAIN = b"swarm invite v2\x00"  # what an owner's signature is about, so it signs nothing else
REVOCATION_DOMAIN = b"swarm revocation v1\x00"
INVITE_FIELD = "invite"  # where a peer of a private run puts its token in every entry it writes
REVOCATION_FIELD = "revocation"  # where the owner's entry under revocations_key(run id) holds its signed list
MAX_TOKEN_CHARS = 2048  # a 2048-bit owner key gives tokens of about 520 characters
MAX_CHECKED = 4096  # tokens whose verdict a node remembers (an RSA check each is cheap, but not free)
MAX_REVOKED = 4096  # peers one revocation list names (~60 bytes each: far within a record's 1 MiB)
REVOCATION_SECONDS = 15.0  # how often a node of a private run re-reads its owner's revocation list
DAY = 86400.0
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")  # base58, as libp2p prints peer ids
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as a recipe's run_id
_OWNER_MARKER = b"[owner:"
_NOT_A_TOKEN = "not an invite token (copy the whole line `swarm-peer invite` printed)"
_UNBOUND = ("it is an invite of an older swarm-peer, valid for none of the owner's runs since invites name their "
            "run")


class InviteError(ValueError):
    """An invite token or revocation list that cannot be used; the message says why in one line."""


class AdmissionError(RecipeError):
    """This peer may not take part in the private run it tried to join; the message says what to do."""


def revocations_key(run_id: str) -> str:
    """Where the owner of private run `run_id` publishes its revocation list (under its owned subkey)."""
    return f"swarm.{run_id}.revoked"


def revocation_file(identity_path: str, run_id: str) -> str:
    """Where `swarm-peer revoke` keeps the owner's list for `run_id`, and the bootstrap with that key reads it:
    beside the key."""
    return f"{identity_path}.{run_id}.revoked"


@dataclass(frozen=True)
class Invite:
    """The run owner's word, given at `issued`, that `peer_id` may take part in its run `run_id` until `expires`
    (both unix seconds). A revocation naming the peer voids its invites given up to the revocation's time."""

    owner: str  # the owner's peer id
    run_id: str
    peer_id: str
    issued: int
    expires: int
    signature: bytes  # the owner's RSA signature (PKCS#1 v1.5, SHA-256, as hivemind signs) of `message()`

    def message(self) -> bytes:
        return INVITE_DOMAIN + msgpack.packb([self.owner, self.run_id, self.peer_id, self.issued, self.expires])

    @classmethod
    def sign(cls, owner: Identity, run_id: str, peer_id: str, days: float,
             now: Optional[float] = None) -> "Invite":
        """An invite for `peer_id` to run `run_id`, valid `days` days from `now`, signed with the owner's identity
        key. Raises InviteError for something that is not a run id or a peer id, or a non-positive lifetime."""
        _check_ids(run_id, [peer_id])
        if not 0 < days <= 3650:
            raise InviteError(f"an invite lasts between 0 and 3650 days, not {days:g}")
        now = time.time() if now is None else now
        unsigned = cls(owner.peer_id, run_id, peer_id, int(now), int(now + days * DAY), b"")
        return replace(unsigned, signature=_sign(owner, unsigned.message()))

    def token(self) -> str:
        """One line of URL-safe base64, to paste after `swarm-peer join --invite`."""
        packed = msgpack.packb([self.owner, self.run_id, self.peer_id, self.issued, self.expires, self.signature])
        return base64.urlsafe_b64encode(packed).rstrip(b"=").decode()

    @classmethod
    def parse(cls, token: Any) -> "Invite":
        """The invite a token carries (not yet checked against any owner); InviteError if it is not one, or is one
        of the older form that named no run."""
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
            raise InviteError(_NOT_A_TOKEN)
        fields = _unpack(base64_text=token)
        if _typed(fields, (str, str, int, bytes)):  # (owner, peer id, expiry, signature): valid for any run
            raise InviteError(_UNBOUND)
        if not _typed(fields, (str, str, str, int, int, bytes)):
            raise InviteError(_NOT_A_TOKEN)
        return cls(*fields)

    def problem(self, owner: str, owner_key: str, run_id: str, peer_id: str, now: float) -> Optional[str]:
        """Why this invite does not admit `peer_id` to run `run_id` of `owner` (whose public key, OpenSSH form, is
        `owner_key`) at `now`, or None if it does (revocations are the caller's: see Revocation.voids)."""
        if self.owner != owner:
            return f"it was signed by {self.owner}, not by this run's owner {owner}"
        if self.peer_id != peer_id:
            return f"it is for peer {self.peer_id}, not for {peer_id}"
        if not _verify(owner_key, self.message(), self.signature):
            return "its signature is not the run owner's (a forged or damaged token)"
        if self.run_id != run_id:  # after the signature: the run it names is the owner's word
            return f"it was made for run {self.run_id}, not for this run {run_id}"
        if self.expires < now - CLOCK_SLACK:
            return f"it expired on {_utc(self.expires)}"
        return None


@dataclass(frozen=True)
class Revocation:
    """The run owner's list of peers whose invites to run `run_id` it took back: each peer id with the time (unix
    seconds) up to which its invites are void, so an invite signed later admits it again. `issued` (unix
    milliseconds, strictly increasing from one list to the next) orders lists: a node keeps the newest it saw."""

    owner: str
    run_id: str
    issued: int
    revoked: Mapping[str, int] = field(hash=False)
    signature: bytes = b""

    def message(self) -> bytes:
        return REVOCATION_DOMAIN + msgpack.packb([self.owner, self.run_id, self.issued, sorted(self.revoked.items())])

    @classmethod
    def sign(cls, owner: Identity, run_id: str, peer_ids: Iterable[str], previous: Optional["Revocation"] = None,
             now: Optional[float] = None) -> "Revocation":
        """`previous`'s list (None: an empty one) with `peer_ids` revoked at `now`, signed with the owner's key and
        issued after `previous`. InviteError for what is not a run or peer id, or a list over MAX_REVOKED."""
        peer_ids = list(peer_ids)
        _check_ids(run_id, peer_ids)
        now = time.time() if now is None else now
        revoked = dict(previous.revoked) if previous is not None else {}
        revoked.update((peer_id, int(now)) for peer_id in peer_ids)
        if len(revoked) > MAX_REVOKED:
            raise InviteError(f"a revocation list names at most {MAX_REVOKED} peers: move the run to a new owner key")
        issued = max(int(now * 1000), previous.issued + 1 if previous is not None else 0)
        unsigned = cls(owner.peer_id, run_id, issued, revoked)
        return cls(owner.peer_id, run_id, issued, revoked, _sign(owner, unsigned.message()))

    def pack(self) -> bytes:
        return msgpack.packb([self.owner, self.run_id, self.issued, sorted(self.revoked.items()), self.signature])

    @classmethod
    def unpack(cls, packed: Any) -> "Revocation":
        """The list `packed` carries (not yet checked against any owner); InviteError if it is not one."""
        try:
            fields = msgpack.unpackb(packed) if isinstance(packed, bytes) and len(packed) < 1 << 20 else None
        except (ValueError, msgpack.UnpackException):
            fields = None
        if not (_typed(fields, (str, str, int, list, bytes)) and len(fields[3]) <= MAX_REVOKED
                and all(_typed(entry, (str, int)) for entry in fields[3])):
            raise InviteError("not a revocation list")
        owner, run_id, issued, revoked, signature = fields
        return cls(owner, run_id, issued, dict(revoked), signature)

    def problem(self, owner: str, owner_key: str, run_id: str) -> Optional[str]:
        """Why this is not `owner`'s list for run `run_id` (`owner_key`: its public key), or None if it is."""
        if self.owner != owner:
            return f"it was signed by {self.owner}, not by this run's owner {owner}"
        if not _verify(owner_key, self.message(), self.signature):
            return "its signature is not the run owner's (a forged or damaged list)"
        if self.run_id != run_id:
            return f"it is for run {self.run_id}, not for this run {run_id}"
        return None

    def voids(self, invite: Invite) -> Optional[int]:
        """When the owner revoked `invite`'s peer, if that was not before the invite was given; else None."""
        revoked_at = self.revoked.get(invite.peer_id)
        return revoked_at if revoked_at is not None and invite.issued <= revoked_at else None


def load_revocation(path: str, owner: Identity, run_id: str) -> Optional[Revocation]:
    """The owner's revocation list for `run_id` kept in `path` (see revocation_file), None if there is no such
    file; InviteError, naming the file, if it cannot be read or is not this owner's list for this run."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InviteError(f"cannot read revocation list {path}: {e.strerror}") from None
    try:
        revocation = Revocation.unpack(_unpack(base64_text=text, raw=True))
    except InviteError:
        revocation, problem = None, "not a revocation list (made by `swarm-peer revoke`)"
    else:
        problem = revocation.problem(owner.peer_id, owner.public_key.decode(), run_id)
    if problem is not None:
        raise InviteError(f"revocation list {path}: {problem}: remove it or pass the key and run it was made for")
    return revocation


def save_revocation(path: str, revocation: Revocation) -> None:
    """Write `revocation` to `path` at once (a reader sees the old list or the new one, never a part)."""
    staged = f"{path}.{os.getpid()}.tmp"
    with open(staged, "w") as f:
        f.write(base64.urlsafe_b64encode(revocation.pack()).rstrip(b"=").decode() + "\n")
    os.replace(staged, path)


def _check_ids(run_id: str, peer_ids: Iterable[str]) -> None:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise InviteError(f"{shown(run_id)} is not a run id (the recipe's run_id: letters, digits, '_', '.', '-')")
    for peer_id in peer_ids:
        if not isinstance(peer_id, str) or not _PEER_ID.match(peer_id):
            raise InviteError(f"{shown(peer_id)} is not a peer id (the volunteer prints theirs with `swarm-peer id`)")


def _typed(fields: Any, types: tuple[type, ...]) -> bool:
    return isinstance(fields, list) and len(fields) == len(types) and all(
        isinstance(value, kind) and not isinstance(value, bool) for value, kind in zip(fields, types))


def _unpack(base64_text: str, raw: bool = False) -> Any:
    """The msgpack fields (or with `raw`, the bytes) that a line of URL-safe base64 carries; InviteError if none."""
    try:
        packed = base64.urlsafe_b64decode(base64_text + "=" * (-len(base64_text) % 4))
        return packed if raw else msgpack.unpackb(packed)
    except (binascii.Error, ValueError, msgpack.UnpackException):
        raise InviteError(_NOT_A_TOKEN) from None


def _sign(owner: Identity, message: bytes) -> bytes:
    return base64.b64decode(owner.private_key.sign(message))


def _verify(public_key: str, message: bytes, signature: bytes) -> bool:
    try:
        return RSAPublicKey.from_bytes(public_key.encode()).verify(message, base64.b64encode(signature))
    except Exception:  # noqa: BLE001 - a key that does not parse admits nobody
        return False


def _utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Admission:
    """Who may take part in one private run: its owner, and each peer whose invite of that owner for that run checks
    out and is not voided by the newest revocation list of the owner seen. Peers admitted are remembered (until
    their invite expires, or a list revokes them) from the invites seen in entries and streams."""

    def __init__(self, owner: str, owner_key: str, run_id: str, clock: Callable[[], float] = time.time):
        self.owner, self.owner_key, self.run_id, self.clock = owner, owner_key, run_id, clock
        self.token: Optional[str] = None  # ours: added to every entry we write, presented on every stream we open
        self.offered: dict[str, str] = {}  # peer id -> invite the owner publishes with its recipe (--allowlist)
        self.revocation: Optional[Revocation] = None  # the owner's newest list seen (see follow)
        self._checked: dict[str, Optional[Invite]] = {}  # token -> the invite if owner, run and signature check out
        self._admitted: dict[str, int] = {}  # peer id -> expiry of the latest valid invite seen for it
        self._last_packed: Optional[bytes] = None  # the list last offered to follow (most often the same again)
        self._revocations_read = -float("inf")  # time.monotonic() of the last read (see revocations_due)

    def admits(self, peer_id: str, token: Any = None) -> bool:
        """Whether `peer_id` may take part: it is the owner, or `token` is a valid invite for it; without a token,
        whether a valid invite for it was seen before (and has not expired or been revoked since)."""
        if peer_id == self.owner:
            return True
        if token is not None:
            return self._valid(peer_id, token)
        return self._admitted.get(peer_id, -1) >= self.clock() - CLOCK_SLACK

    def entry_admitted(self, writer: str, value: Any) -> bool:
        """Whether an entry that `writer` signed counts: the owner's (a revocation list in it is followed), or one
        that carries a valid invite for `writer` itself (each entry stands on its own, whatever this node saw
        before)."""
        if writer == self.owner:
            if isinstance(value, dict) and REVOCATION_FIELD in value:
                self.follow(value[REVOCATION_FIELD])
            return True
        return isinstance(value, dict) and self._valid(writer, value.get(INVITE_FIELD))

    def follow(self, packed: Any) -> bool:
        """Take `packed` (Revocation.pack) as the owner's revocation list if it is the owner's, for this run, and
        newer than the one held; from then on the peers it names are refused (those invited again after it aside).
        Returns whether it replaced the list held. Anything else, a forged or an older list, changes nothing."""
        if not isinstance(packed, bytes) or packed == self._last_packed:
            return False
        self._last_packed = packed
        try:
            revocation = Revocation.unpack(packed)
        except InviteError:
            return False
        if self.revocation is not None and revocation.issued <= self.revocation.issued:
            return False
        if revocation.problem(self.owner, self.owner_key, self.run_id) is not None:
            return False
        self.revocation = revocation
        for peer_id in revocation.revoked:  # their next entry or stream shows an invite again, or is refused
            self._admitted.pop(peer_id, None)
        return True

    def follow_entries(self, entries: Mapping[str, Any]) -> bool:
        """Follow the owner's list among the entries read under revocations_key (subkey -> value); whether the list
        held changed. Marks the read done (see revocations_due)."""
        self._revocations_read = time.monotonic()
        changed = False
        for subkey, value in entries.items():
            if subkey_owner(subkey) == self.owner and isinstance(value, dict):
                changed = self.follow(value.get(REVOCATION_FIELD)) or changed
        return changed

    def revocations_due(self) -> bool:
        """Whether REVOCATION_SECONDS passed since the revocation list was last read (or it never was); if so, the
        caller reads it now, and reads started meanwhile do not also read it."""
        if time.monotonic() - self._revocations_read < REVOCATION_SECONDS:
            return False
        self._revocations_read = time.monotonic()
        return True

    def _valid(self, peer_id: str, token: Any) -> bool:
        invite = self._check(token)
        if invite is None or invite.peer_id != peer_id or invite.expires < self.clock() - CLOCK_SLACK:
            return False
        if self.revocation is not None and self.revocation.voids(invite) is not None:
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
            if invite is not None and invite.problem(self.owner, self.owner_key, self.run_id, invite.peer_id,
                                                     -float("inf")):
                invite = None  # expiry and revocation are checked at each use, the rest once
            self._checked[token] = invite
        return self._checked[token]

    def join_with(self, identity: Identity, token: Optional[str]) -> None:
        """Take `token` (else the owner's allowlist invite for us, see `offered`) as this peer's invite;
        AdmissionError, one line saying what to do, if it does not admit us to this run."""
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
            invite = Invite.parse(token)
            problem = invite.problem(self.owner, self.owner_key, self.run_id, peer_id, self.clock())
        except InviteError as e:
            invite, problem = None, str(e)
        revoked_at = None if problem or self.revocation is None else self.revocation.voids(invite)
        if revoked_at is not None:
            problem = f"the owner revoked it on {_utc(revoked_at)}"
        if problem is not None:
            raise AdmissionError(f"this run is private and your invite does not admit you: {problem}; ask the run "
                                 f"owner for a new invite (swarm-peer invite {peer_id} --run-id {self.run_id})")
        self.token = token
        self.admits(peer_id, token)


class AdmissionValidator(RecordValidatorBase):
    """Every node of a private run refuses, for any key, entries under an owned subkey whose writer is neither the
    run owner nor carries a valid, unrevoked invite of the owner to this run for its own peer id in the entry
    (`INVITE_FIELD`). The owner's revocation lists that pass through (see Admission.follow) are followed. Unowned
    entries are left to SwarmValidator's rules (readers ignore them)."""

    def __init__(self, owner: str, owner_key: str, run_id: str):
        self.admission = Admission(owner, owner_key, run_id)

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


def allowlist_invites(owner: Identity, run_id: str, path: str, days: float) -> dict[str, str]:
    """{peer id: token} for the peer ids in file `path` (one a line; blank lines and # comments skipped), invites to
    run `run_id` signed by `owner`. Raises InviteError naming the file and line of a bad entry."""
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
                invites[peer_id] = Invite.sign(owner, run_id, peer_id, days).token()
            except InviteError as e:
                raise InviteError(f"allowlist {path} line {number}: {e}") from None
    return invites
