"""Ed25519 key pairs for tests: the extender's signing key and the nodes' public key.

Made with the ``cryptography`` package as ``deploy/render.py placement-keys`` makes
them (PKCS#8 and SubjectPublicKeyInfo PEM), so the product reads test keys exactly as it
reads real ones.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)


def new_private_key_pem() -> str:
    key = Ed25519PrivateKey.generate()
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode("ascii")


def write_pair(directory: str) -> tuple[str, str]:
    """A new pair in ``directory``: (placement.key path, placement.pub path)."""
    key = Ed25519PrivateKey.generate()
    private = os.path.join(directory, "placement.key")
    public = os.path.join(directory, "placement.pub")
    with open(private, "wb") as f:
        f.write(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    os.chmod(private, 0o600)
    with open(public, "wb") as f:
        f.write(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return private, public
