"""Who may write what in the DHT. A node's libp2p identity is an RSA key; the same key signs its records, so a
signed subkey `<peer id>[owner:<public key>]` proves the writer is that peer. Every node accepts only such signed
entries, with a bounded size and lifetime (tighter for protected keys: the recipe, a run's peer announcements).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

import base58
import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

# hivemind's marker, as text: RSASignatureValidator finds it in the serialized subkey and checks the signature.
_OWNED_SUBKEY = re.compile(r"^([1-9A-HJ-NP-Za-km-z]{1,128})\[owner:(ssh-rsa [A-Za-z0-9+/=]{1,2048})\]$")
_OWNER_MARKER = re.compile(rb"\[owner:")
# Clocks of honest peers differ by a few seconds (hivemind warns past 3 s); allow more before calling it hostile.
CLOCK_SLACK = 30.0


class IdentityError(ValueError):
    """The identity file cannot be used; the message says why."""


@dataclass(frozen=True)
class Identity:
    """This node's RSA key, the file p2pd reads it from, and the peer id it gives."""

    private_key: RSAPrivateKey
    path: str
    ephemeral: bool  # a temporary file of a fresh key: delete it once p2pd has read it

    @property
    def public_key(self) -> bytes:
        """OpenSSH form, as it appears in owned subkeys."""
        return self.private_key.get_public_key().to_bytes()

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key.decode())

    @property
    def owned_subkey(self) -> str:
        return owned_subkey(self.peer_id, self.public_key.decode())

    @classmethod
    def load_or_create(cls, path: str) -> "Identity":
        """The key in `path` (hivemind's format: a libp2p protobuf of an RSA key), created there if missing."""
        if not os.path.exists(path):
            try:
                P2P.generate_identity(path)  # the same file format and permissions (0400) hivemind uses
            except OSError as e:
                raise IdentityError(f"cannot create identity file {path}: {e.strerror or e}") from None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
        return cls(_parse_identity(data, path), path, ephemeral=False)

    @classmethod
    def ephemeral(cls) -> "Identity":
        """A fresh key for a node without --identity-path, written to a private temporary file for p2pd."""
        directory = tempfile.mkdtemp(prefix="swarm-identity-")
        path = os.path.join(directory, "identity.key")
        P2P.generate_identity(path)
        with open(path, "rb") as f:
            return cls(_parse_identity(f.read(), path), path, ephemeral=True)

    def discard_file(self) -> None:
        """Remove an ephemeral key file (p2pd reads it only at start-up); keeps a persistent one."""
        if self.ephemeral:
            for remove in (lambda: os.remove(self.path), lambda: os.rmdir(os.path.dirname(self.path))):
                try:
                    remove()
                except OSError:
                    pass


def _parse_identity(data: bytes, path: str) -> RSAPrivateKey:
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise IdentityError(f"identity file {path} holds a {crypto_pb2.KeyType.Name(proto.key_type)} key; "
                                "swarm needs an RSA key (delete the file to have a new one generated)")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": proto.data})  # hivemind's own unpickling path: DER, no new key made
        return key
    except IdentityError:
        raise
    except Exception as e:  # noqa: BLE001 - protobuf and DER parsers raise many types for a corrupt file
        raise IdentityError(f"identity file {path} is not a hivemind/libp2p private key: {e}") from None


@functools.lru_cache(maxsize=4096)
def peer_id_of(public_key: str) -> str:
    """The libp2p peer id of an RSA public key in OpenSSH form (sha256 multihash of its protobuf), as p2pd
    computes it. Raises ValueError if the key does not parse."""
    try:
        key = serialization.load_ssh_public_key(public_key.encode())
    except UnsupportedAlgorithm as e:  # (a key type cryptography does not know, e.g. "SSH-RSA")
        raise ValueError(str(e)) from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(multihash.encode(hashlib.sha256(proto).digest(), "sha2-256")).decode()


def owned_subkey(peer_id: str, public_key: str) -> str:
    return f"{peer_id}[owner:{public_key}]"


def subkey_owner(subkey: object) -> Optional[str]:
    """The peer id that an owned subkey names, if its public key really gives that id; None otherwise.

    Together with hivemind's signature check this means: only that peer wrote the entry."""
    owner = subkey_owner_key(subkey)
    return owner[0] if owner is not None else None


def subkey_owner_key(subkey: object) -> Optional[tuple[str, str]]:
    """(peer id, public key in OpenSSH form) of an owned subkey whose key gives that id; None otherwise."""
    if not isinstance(subkey, str):
        return None
    match = _OWNED_SUBKEY.match(subkey)
    if match is None:
        return None
    try:
        return (match.group(1), match.group(2)) if peer_id_of(match.group(2)) == match.group(1) else None
    except Exception:  # noqa: BLE001 - cryptography raises several types for a key that does not parse
        return None


@dataclass(frozen=True)
class KeyRule:
    """What a protected key accepts: only owned, signed subkeys, each at most `max_bytes` long and expiring at
    most `max_ttl` seconds from now (so a hostile or broken writer cannot pin an entry for days)."""

    max_ttl: float
    max_bytes: int


# Any key no rule names: matchmaking's per-round keys (entries live 3 x matchmaking_timeout + 30 s, at most about
# 3 h; a group's member list of 4096 peers is ~250 kB).
DEFAULT_RULE = KeyRule(max_ttl=6 * 3600.0, max_bytes=1 << 20)


class SwarmValidator(RecordValidatorBase):
    """Our rules, run on every node for every record it stores or receives (after the signature check):

    - every record is an owned entry: a subkey `<peer id>[owner:<key>]` with the peer id of that key, which
      hivemind signs with that key. So nobody can write in another peer's name, and there are no plain values,
      which would replace a key's whole dictionary (a round's matchmaking entries, say) and, with a later
      expiration, keep new entries out; our own nodes write nothing else;
    - within its key's rule (a protected key's, or DEFAULT_RULE) for size and lifetime.
    """

    def __init__(self, rules: Mapping[str, KeyRule] = ()):
        self._rules: dict[bytes, KeyRule] = {DHTID.generate(source=key).to_bytes(): rule
                                             for key, rule in dict(rules).items()}

    def validate(self, record: DHTRecord) -> bool:
        rule = self._rules.get(record.key, DEFAULT_RULE)
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY):
            return False
        if _OWNER_MARKER.search(record.subkey) is None:
            return False
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - a subkey that does not decode is hostile or broken
            return False
        if subkey_owner(subkey) is None:
            return False
        if len(record.value) > rule.max_bytes:
            return False
        return record.expiration_time <= get_dht_time() + rule.max_ttl + CLOCK_SLACK

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator (10): it checks the signature and strips it before we look

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SwarmValidator):
            return False
        self._rules.update(other._rules)  # protecting a run's keys later adds them to the same rule set
        return True


def make_validators(identity: Identity, rules: Mapping[str, KeyRule]) -> list[RecordValidatorBase]:
    """The validators every node of a swarm runs: hivemind's signature check with our key, and our rules."""
    return [RSASignatureValidator(identity.private_key), SwarmValidator(rules)]

