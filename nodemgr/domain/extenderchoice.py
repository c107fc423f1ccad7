"""Which card the scheduler extender chose for a pod, and whether to believe it (pure).

A pod owner writes its pod's annotations, so the gpushare extender's annotations
(``ALIYUN_COM_GPU_MEM_IDX``, ``_ASSUME_TIME``, ``scheduler.framework.gpushare.allocation``)
say nothing about who wrote them: ``IDX=1`` picks a card, ``ASSUME_TIME=1`` jumps the
queue. gpushare-scheduler also writes ``<label_prefix>placement``, signed with its
Ed25519 key (nodes hold only the public key), on one line::

    v1;uid=<pod UID>;node=<node>;t=<assume time, Unix ns>;
      cards=<container index>:<card>,...;sig=<base64url>

The signature covers ``SIGNED_DOMAIN`` and the text before ``;sig=`` (init containers
by negative index), so a copy on another pod or node, or any edit, fails.

``decide`` reads a pod's annotations under the trust mode: ``signed`` (default) counts
only a verified signature for this pod's UID and node; ``annotations`` also believes the
gpushare extender's annotations (for clusters that run it and accept that pod owners
choose their card and place in the queue). It also gives a *note*: why a placement on
the pod was not believed, for the log and a pod Event. No annotation content raises:
each value is read with a size limit and a strict form.

What it must not do: I/O or cryptography (the verifier is passed in).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

# docs/gpushare-compat.md
IDX_ANNOTATION = "ALIYUN_COM_GPU_MEM_IDX"
ASSIGNED_ANNOTATION = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ASSUME_TIME_ANNOTATION = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
ALLOCATION_ANNOTATION = "scheduler.framework.gpushare.allocation"
SIGNED_ANNOTATION = "placement"  # after the label prefix

TRUST_MODES = ("signed", "annotations")
SIGNED_DOMAIN = b"gpushare-placement\n"  # signatures made for this and nothing else
SIGNATURE_BYTES = 64  # Ed25519

MAX_SIGNED_CHARS = 4096
MAX_ALLOCATION_CHARS = 16384
MAX_CONTAINERS = 256
_MAX_NUMBER_DIGITS = 19  # a Unix time in ns; an index is far shorter

_UID = r"[A-Za-z0-9][A-Za-z0-9-]{0,127}"
_NODE = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_CARD = r"-?[0-9]{1,4}:[0-9]{1,4}"
_SIGNED = re.compile(
    rf"v1;uid=(?P<uid>{_UID});node=(?P<node>{_NODE});t=(?P<t>[0-9]{{1,19}});"
    rf"cards=(?P<cards>{_CARD}(,{_CARD}){{0,{MAX_CONTAINERS - 1}}})"
)
_SIGNATURE = re.compile(r"[A-Za-z0-9_-]{86}")  # 64 bytes, base64url without padding


class Verifier(Protocol):
    """nodemgr.common.placementkey.PublicKey"""

    def verify(self, message: bytes, signature: bytes) -> bool: ...


@dataclass(frozen=True)
class ExtenderChoice:
    cards: Mapping[int, int] = field(default_factory=dict)  # container index -> card index
    pod_card: int | None = None  # the pod-wide card (IDX) for containers not in ``cards``
    assumed_at_ns: int | None = None  # orders pending pods
    signed: bool = False

    def card_for(self, container_index: int) -> int | None:
        card = self.cards.get(container_index)
        return card if card is not None else self.pod_card


@dataclass(frozen=True)
class PlacementTrust:
    """What a node (or the extender's own cache) believes of a pod's placement annotations."""

    mode: str = "signed"  # one of TRUST_MODES
    label_prefix: str = "gpushare.aliyun.com/"
    verifier: Verifier | None = None
    verifier_problem: str = "no public key of the scheduler extender is configured"

    @property
    def signed_key(self) -> str:
        return self.label_prefix + SIGNED_ANNOTATION


# --- the signed annotation ------------------------------------------------------------


def signed_text(uid: str, node: str, assumed_at_ns: int, cards: Mapping[int, int]) -> str:
    """The text the signature covers (ValueError: a field outside its form)."""
    listed = ",".join(f"{index}:{card}" for index, card in sorted(cards.items()))
    text = f"v1;uid={uid};node={node};t={assumed_at_ns};cards={listed}"
    if not _SIGNED.fullmatch(text):
        raise ValueError(f"cannot sign the placement {text!r}: a field is outside its form")
    return text


def signed_message(text: str) -> bytes:
    return SIGNED_DOMAIN + text.encode("ascii")


def with_signature(text: str, signature: bytes) -> str:
    if len(signature) != SIGNATURE_BYTES:
        raise ValueError(f"an Ed25519 signature has {SIGNATURE_BYTES} bytes, not {len(signature)}")
    return f"{text};sig={base64.urlsafe_b64encode(signature).decode('ascii').rstrip('=')}"


@dataclass(frozen=True)
class SignedPlacement:
    text: str  # what the signature covers
    uid: str
    node: str
    assumed_at_ns: int
    cards: Mapping[int, int]
    signature: bytes


def parse_signed(value: str) -> SignedPlacement:
    if len(value) > MAX_SIGNED_CHARS:
        raise ValueError(f"it is {len(value)} characters long, over {MAX_SIGNED_CHARS}")
    text, sep, encoded = value.rpartition(";sig=")
    if not sep:
        raise ValueError("it has no ;sig= part")
    match = _SIGNED.fullmatch(text)
    if match is None or not _SIGNATURE.fullmatch(encoded):
        raise ValueError("it is not in the form v1;uid=...;node=...;t=...;cards=...;sig=...")
    try:
        signature = base64.urlsafe_b64decode(encoded + "==")
    except (binascii.Error, ValueError):
        raise ValueError("its signature is not base64url") from None
    cards: dict[int, int] = {}
    for pair in match["cards"].split(","):
        index, card = pair.split(":")
        if int(index) in cards:
            raise ValueError(f"it names container {int(index)} twice")
        cards[int(index)] = int(card)
    return SignedPlacement(text, match["uid"], match["node"], int(match["t"]), cards, signature)


# --- the gpushare extender's annotations, read defensively ---------------------------


def _number(value: str | None) -> int | None:
    if value is None or not 0 < len(value) <= _MAX_NUMBER_DIGITS:
        return None
    return int(value) if value.isascii() and value.isdigit() else None


def _allocation_map(text: str) -> dict[int, int]:
    """``{"<container index>": {"<card>": units}}`` -> {index: card}; ValueError if it is not."""
    if len(text) > MAX_ALLOCATION_CHARS:
        raise ValueError(f"it is {len(text)} characters long, over {MAX_ALLOCATION_CHARS}")
    try:
        document = json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deep") from None
    except ValueError:
        raise ValueError("it is not JSON") from None
    if not isinstance(document, dict) or len(document) > MAX_CONTAINERS:
        raise ValueError("it is not an object of at most 256 containers")
    cards = {}
    for key, value in document.items():
        index = _number(key) if len(key) <= 4 else None
        if index is None or not isinstance(value, dict) or len(value) != 1:
            raise ValueError(f"container {show(key)} is not one index with one card")
        ((card_text, units),) = value.items()
        card = _number(card_text) if len(card_text) <= 4 else None
        if card is None or not isinstance(units, int) or isinstance(units, bool):
            raise ValueError(f"container {show(key)} names no card index with a number")
        cards[index] = card
    return cards


def choice_from_annotations(annotations: Mapping[str, str]) -> tuple[ExtenderChoice | None, str]:
    """The gpushare extender's choice as written; the note says what was unreadable."""
    notes = []
    cards: dict[int, int] = {}
    text = annotations.get(ALLOCATION_ANNOTATION)
    if text:
        try:
            cards = _allocation_map(text)
        except ValueError as e:
            notes.append(f"its {ALLOCATION_ANNOTATION} annotation is unreadable ({e})")
    pod_card = _number(annotations.get(IDX_ANNOTATION))
    if IDX_ANNOTATION in annotations and pod_card is None:
        notes.append(f"its {IDX_ANNOTATION} {show(annotations[IDX_ANNOTATION])} is no index")
    assumed = _number(annotations.get(ASSUME_TIME_ANNOTATION))
    if not cards and pod_card is None and assumed is None:
        return None, "; ".join(notes)
    return ExtenderChoice(cards, pod_card, assumed), "; ".join(notes)


# --- the decision -----------------------------------------------------------------------


def decide(
    annotations: Mapping[str, str],
    uid: str,
    node: str,
    pending: bool,
    trust: PlacementTrust,
) -> tuple[ExtenderChoice | None, str]:
    """The extender's choice for this pod as ``trust`` believes it, and the note."""
    signed = annotations.get(trust.signed_key)
    if signed is not None and not node:
        # Written just before the Binding; an unbound pod holds no card anywhere.
        return None, ""
    if signed is not None:
        choice, problem = _verified(signed, uid, node, trust)
        if choice is not None:
            return choice, ""
        note = f"its {trust.signed_key} annotation {problem}: ignored, this node places it"
        if trust.mode == "annotations":
            fallback, more = choice_from_annotations(annotations)
            return fallback, "; ".join(n for n in (note, more) if n)
        return None, note
    if trust.mode == "annotations":
        return choice_from_annotations(annotations)
    _, unreadable = choice_from_annotations(annotations)
    if unreadable:  # neither the extender nor a node writes such a thing: say so
        return None, f"{unreadable}: ignored (kubernetes.placement_trust: signed)"
    written = [
        key
        for key in (IDX_ANNOTATION, ALLOCATION_ANNOTATION, ASSUME_TIME_ANNOTATION)
        if key in annotations
    ]
    # The node writes them itself, with ASSIGNED=true, once it admitted the pod.
    if written and pending and annotations.get(ASSIGNED_ANNOTATION) != "true":
        return None, (
            f"{', '.join(written)} on it {'is' if len(written) == 1 else 'are'} not signed by "
            f"the scheduler extender (no {trust.signed_key}; kubernetes.placement_trust: "
            "signed): ignored, this node places it"
        )
    return None, ""


def _verified(
    value: str, uid: str, node: str, trust: PlacementTrust
) -> tuple[ExtenderChoice | None, str]:
    try:
        placement = parse_signed(value)
    except ValueError as e:
        return None, f"is unreadable ({e})"
    if placement.uid != uid:
        return None, f"was signed for pod UID {placement.uid}, not this pod's {uid or '(none)'}"
    if placement.node != node:
        return None, f"was signed for node {placement.node}, not {node}"
    if trust.verifier is None:
        return None, f"cannot be checked: {trust.verifier_problem}"
    if not trust.verifier.verify(signed_message(placement.text), placement.signature):
        return None, "does not carry the scheduler extender's signature"
    return ExtenderChoice(placement.cards, None, placement.assumed_at_ns, signed=True), ""


def show(value: str, limit: int = 40) -> str:
    """A pod owner's value for a log or Event: quoted, escaped, cut at ``limit``."""
    quoted = json.dumps(value[:limit], ensure_ascii=True)
    return quoted if len(value) <= limit else quoted[:-1] + '..."'
