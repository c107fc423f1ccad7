"""nodemgr.common.placementkey: the extender's Ed25519 key, read with the standard library.

Pins: both PEM forms render.py writes read back (the public key derived from the private
one equals the file's); a signature verifies with the public key and fails for another
message, another key or a cut signature; a file with another key type, two PEM blocks, a
public key where the private one is wanted, non-ASCII or oversized content is refused
naming why; and reading a public key does not load ``cryptography`` (the node daemon's
memory), which the first verification does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nodemgr.common.placementkey import (
    PlacementKeyError,
    public_key_from_pem,
    read_private_key,
    read_public_key,
)
from standins import placementkeys
from standins.extender_tls import render


def test_a_pair_reads_back_signs_and_verifies(tmp_path):
    private, public = placementkeys.write_pair(str(tmp_path))
    key, verifier = read_private_key(private), read_public_key(public)
    assert key.public_key.raw == verifier.raw
    assert public_key_from_pem(verifier.pem()).raw == verifier.raw
    signature = key.sign(b"message")
    assert verifier.verify(b"message", signature)
    assert not verifier.verify(b"another message", signature)
    assert not verifier.verify(b"message", signature[:-1])
    (tmp_path / "other").mkdir()
    other = read_private_key(placementkeys.write_pair(str(tmp_path / "other"))[0])
    assert not verifier.verify(b"message", other.sign(b"message"))


def test_what_is_not_the_key_is_refused_naming_why(tmp_path):
    private, public = placementkeys.write_pair(str(tmp_path))
    render.make_tls(str(tmp_path / "tls"))
    cases = {
        str(tmp_path / "tls" / "tls.key"): "not an unencrypted Ed25519 private key",
        public: "holds a PUBLIC KEY, not a PRIVATE KEY",
    }
    for path, why in cases.items():
        with pytest.raises(PlacementKeyError, match=why):
            read_private_key(path)
    with pytest.raises(PlacementKeyError, match="holds a CERTIFICATE, not a PUBLIC KEY"):
        read_public_key(str(tmp_path / "tls" / "tls.crt"))
    both = tmp_path / "both.pem"
    both.write_text(open(public).read() + open(private).read())
    with pytest.raises(PlacementKeyError, match="exactly one PEM block, not 2"):
        read_public_key(str(both))
    big = tmp_path / "big.pem"
    big.write_text("x" * 5000)
    with pytest.raises(PlacementKeyError, match="over 4096 bytes"):
        read_public_key(str(big))
    latin = tmp_path / "latin.pem"
    latin.write_bytes(b"\xff\xfe")
    with pytest.raises(PlacementKeyError, match="not ASCII"):
        read_public_key(str(latin))
    with pytest.raises(FileNotFoundError):
        read_public_key(str(tmp_path / "absent.pub"))


def test_reading_the_public_key_does_not_load_cryptography(tmp_path):
    _, public = placementkeys.write_pair(str(tmp_path))
    code = (
        "import sys\n"
        "from nodemgr.common.placementkey import read_public_key\n"
        f"key = read_public_key({public!r})\n"
        "print('cryptography' in sys.modules)\n"
        "key.verify(b'm', bytes(64))\n"
        "print('cryptography' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stderr
