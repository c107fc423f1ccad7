"""The scheduler extender's Ed25519 key: the extender signs placements, the nodes verify.

gpushare-scheduler holds the private key (PKCS#8 PEM, ``--placement-key``) and signs
the placement it writes on a pod at bind (``nodemgr.domain.extenderchoice``); nodes hold
only the public key (SubjectPublicKeyInfo PEM, ``kubernetes.placement_public_key``), so
neither a node nor a pod owner can make a placement a node believes.
``deploy/render.py placement-keys`` makes the pair.

Both PEM forms are a fixed DER prefix and the 32 key bytes (RFC 8410), so a key file is
read with the standard library; ``cryptography`` is imported at the first verification
or signature, so a node that never sees a signed placement never pays its memory.

What it must not do: accept a key of another type, or a file holding more
than one PEM block (a private key pasted next to the public one).
"""

from __future__ import annotations

import base64
import binascii
import re
import threading
from typing import Any

ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")  # SubjectPublicKeyInfo
ED25519_PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")  # PrivateKeyInfo
MAX_KEY_FILE_BYTES = 4096
_PEM = re.compile(
    r"-----BEGIN (?P<label>[A-Z ]+)-----\s*(?P<body>[A-Za-z0-9+/=\s]+?)\s*-----END (?P=label)-----"
)


class PlacementKeyError(ValueError):
    """A key file that is not the Ed25519 key it must be; the message says what is wrong."""


def _pem_der(text: str, label: str, path: str) -> bytes:
    blocks = list(_PEM.finditer(text))
    if len(blocks) != 1:
        raise PlacementKeyError(f"{path} must hold exactly one PEM block, not {len(blocks)}")
    block = blocks[0]
    if block["label"] != label:
        raise PlacementKeyError(f"{path} holds a {block['label']}, not a {label}")
    try:
        return base64.b64decode("".join(block["body"].split()), validate=True)
    except (binascii.Error, ValueError):
        raise PlacementKeyError(f"{path}: its PEM body is not base64") from None


def _read(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise PlacementKeyError(f"{path} is over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise PlacementKeyError(f"{path} is not a PEM file (not ASCII)") from None


def public_key_from_pem(text: str, path: str = "the public key") -> PublicKey:
    der = _pem_der(text, "PUBLIC KEY", path)
    if len(der) != len(ED25519_SPKI_PREFIX) + 32 or not der.startswith(ED25519_SPKI_PREFIX):
        raise PlacementKeyError(f"{path} is not an Ed25519 public key")
    return PublicKey(der[len(ED25519_SPKI_PREFIX) :])


def private_key_from_pem(text: str, path: str = "the private key") -> PrivateKey:
    der = _pem_der(text, "PRIVATE KEY", path)
    if len(der) != len(ED25519_PKCS8_PREFIX) + 32 or not der.startswith(ED25519_PKCS8_PREFIX):
        raise PlacementKeyError(f"{path} is not an unencrypted Ed25519 private key (PKCS#8)")
    return PrivateKey(der[len(ED25519_PKCS8_PREFIX) :])


def read_public_key(path: str) -> PublicKey:
    """The public key in ``path``; OSError when unreadable, PlacementKeyError when not one."""
    return public_key_from_pem(_read(path), path)


def read_private_key(path: str) -> PrivateKey:
    """The private key in ``path``; OSError when unreadable, PlacementKeyError when not one."""
    return private_key_from_pem(_read(path), path)


class PublicKey:
    def __init__(self, raw: bytes):
        if len(raw) != 32:
            raise PlacementKeyError("an Ed25519 public key has 32 bytes")
        self.raw = raw
        self._key: Any = None
        self._lock = threading.Lock()

    def pem(self) -> str:
        body = base64.b64encode(ED25519_SPKI_PREFIX + self.raw).decode("ascii")
        return f"-----BEGIN PUBLIC KEY-----\n{body}\n-----END PUBLIC KEY-----\n"

    def verify(self, message: bytes, signature: bytes) -> bool:
        if len(signature) != 64:
            return False
        with self._lock:
            if self._key is None:
                from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

                self._key = Ed25519PublicKey.from_public_bytes(self.raw)
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


class PrivateKey:
    def __init__(self, seed: bytes):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_key = PublicKey(raw)

    def sign(self, message: bytes) -> bytes:
        return bytes(self._key.sign(message))
