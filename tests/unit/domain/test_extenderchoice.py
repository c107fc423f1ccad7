"""nodemgr.domain.extenderchoice: which card the extender chose, and whether to believe it.

Pins: under ``signed`` trust only a placement signed with the extender's key, for this
pod's UID and node, is believed (its cards and assume time), and the unsigned gpushare
annotations are ignored with a note on a pending, not yet assigned pod (none on a pod the
node itself annotated); a copy on another pod or node, an edit, a wrong key, no key and
an unreadable value are each ignored with the reason; under ``annotations`` trust the old
extender's annotations are believed; no annotation content raises (deep nesting, huge
values, wrong types), and what is quoted from a pod owner is escaped and cut.
"""

from __future__ import annotations

import pytest

from nodemgr.common.placementkey import private_key_from_pem
from nodemgr.domain.extenderchoice import (
    ALLOCATION_ANNOTATION,
    ASSUME_TIME_ANNOTATION,
    IDX_ANNOTATION,
    ExtenderChoice,
    PlacementTrust,
    choice_from_annotations,
    decide,
    parse_signed,
    show,
    signed_message,
    signed_text,
    with_signature,
)
from standins.placementkeys import new_private_key_pem

KEY = private_key_from_pem(new_private_key_pem())
OTHER_KEY = private_key_from_pem(new_private_key_pem())
SIGNED = PlacementTrust("signed", "gpushare.aliyun.com/", KEY.public_key)
SIGNED_KEY = "gpushare.aliyun.com/placement"
UID = "0f6d5d1e-3b1c-4c2b-9a53-7d3e2f1a0b9c"


def signed(uid=UID, node="node-a", t=42, cards=None, key=KEY) -> str:
    text = signed_text(uid, node, t, {0: 1, -1: 0} if cards is None else cards)
    return with_signature(text, key.sign(signed_message(text)))


def test_a_signed_placement_for_this_pod_and_node_is_believed():
    """Cards per container (init containers negative) and the assume time, nothing pod-wide."""
    choice, note = decide({SIGNED_KEY: signed()}, UID, "node-a", True, SIGNED)
    assert note == ""
    assert choice == ExtenderChoice({0: 1, -1: 0}, None, 42, signed=True)
    assert (choice.card_for(0), choice.card_for(-1), choice.card_for(1)) == (1, 0, None)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (signed(uid="another-uid"), "was signed for pod UID another-uid, not this pod's"),
        (signed(node="node-b"), "was signed for node node-b, not node-a"),
        (signed(key=OTHER_KEY), "does not carry the scheduler extender's signature"),
        (signed().replace("cards=-1:0,0:1", "cards=-1:0,0:0"), "does not carry the scheduler"),
        (signed().replace(";t=42;", ";t=1;"), "does not carry the scheduler extender's"),
        (signed()[:-2], "is unreadable (it is not in the form v1;uid=...;node="),
        ("v1;uid=x;sig=" + "A" * 86, "is unreadable (it is not in the form"),
        ("garbage", "is unreadable (it has no ;sig= part)"),
        ("x" * 100_000, "is unreadable (it is 100000 characters long, over 4096)"),
        (signed(cards={0: 1}).replace("cards=0:1", "cards=0:1,0:0"), "names container 0 twice"),
    ],
)
def test_a_signed_placement_that_does_not_verify_is_ignored_with_the_reason(value, reason):
    choice, note = decide({SIGNED_KEY: value}, UID, "node-a", True, SIGNED)
    assert choice is None
    assert note.startswith("its gpushare.aliyun.com/placement annotation ") and reason in note
    assert note.endswith(": ignored, this node places it")


def test_a_signed_placement_on_a_pod_not_bound_yet_waits_for_the_binding():
    """The extender patches the placement just before it creates the Binding: until the
    pod is bound there is nothing to check it against, and nothing to report."""
    assert decide({SIGNED_KEY: signed()}, UID, "", True, SIGNED) == (None, "")
    assert decide({SIGNED_KEY: "junk"}, UID, "", True, SIGNED) == (None, "")


def test_without_a_key_no_signature_is_believed():
    trust = PlacementTrust("signed", "gpushare.aliyun.com/", None, "no key here")
    choice, note = decide({SIGNED_KEY: signed()}, UID, "node-a", True, trust)
    assert choice is None and "cannot be checked: no key here" in note


def test_unsigned_gpushare_annotations_are_ignored_under_signed_trust():
    """What a pod owner writes (IDX, ASSUME_TIME, the allocation map) chooses nothing; the
    note names them on a pending pod not yet assigned, and is silent on a pod the node
    itself annotated (ASSIGNED=true) or one that is running."""
    owner = {
        IDX_ANNOTATION: "1",
        ASSUME_TIME_ANNOTATION: "1",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
    }
    choice, note = decide(owner, UID, "node-a", True, SIGNED)
    assert choice is None
    assert note == (
        "ALIYUN_COM_GPU_MEM_IDX, ALIYUN_COM_GPU_MEM_ASSUME_TIME on it are not signed by the "
        "scheduler extender (no gpushare.aliyun.com/placement; kubernetes.placement_trust: "
        "signed): ignored, this node places it"
    )
    assigned = {**owner, "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    assert decide(assigned, UID, "node-a", True, SIGNED) == (None, "")
    assert decide(owner, UID, "node-a", False, SIGNED) == (None, "")
    assert decide({}, UID, "node-a", True, SIGNED) == (None, "")


def test_an_unreadable_gpushare_annotation_is_noted_whatever_the_phase():
    """Neither the extender nor a node writes an allocation map nested 3,000 deep: noted
    (for the Event) also on a running pod, under signed trust."""
    choice, note = decide({ALLOCATION_ANNOTATION: NESTED}, UID, "node-a", False, SIGNED)
    assert choice is None
    assert note == (
        "its scheduler.framework.gpushare.allocation annotation is unreadable (it is nested too "
        "deep): ignored (kubernetes.placement_trust: signed)"
    )


def test_annotations_trust_believes_the_old_extender():
    trust = PlacementTrust("annotations", "gpushare.aliyun.com/", None)
    annotations = {
        IDX_ANNOTATION: "1",
        ASSUME_TIME_ANNOTATION: "40000000000",
        ALLOCATION_ANNOTATION: '{"0":{"0":4},"1":{"1":2}}',
    }
    choice, note = decide(annotations, UID, "node-a", True, trust)
    assert note == "" and choice == ExtenderChoice({0: 0, 1: 1}, 1, 40000000000)
    assert choice.card_for(5) == 1 and choice.card_for(-1) == 1
    # a signed placement that verifies still wins; one that does not falls back, noted
    trust = PlacementTrust("annotations", "gpushare.aliyun.com/", KEY.public_key)
    assert decide({**annotations, SIGNED_KEY: signed()}, UID, "node-a", True, trust)[0].signed
    choice, note = decide({**annotations, SIGNED_KEY: "junk"}, UID, "node-a", True, trust)
    assert choice == ExtenderChoice({0: 0, 1: 1}, 1, 40000000000) and "unreadable" in note


NESTED = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize(
    "annotations",
    [
        {ALLOCATION_ANNOTATION: NESTED},
        {ALLOCATION_ANNOTATION: "[" * 10_000},
        {ALLOCATION_ANNOTATION: '{"0":' * 3000},
        {ALLOCATION_ANNOTATION: "{" + ",".join(f'"{i}":{{"0":1}}' for i in range(5000)) + "}"},
        {ALLOCATION_ANNOTATION: '{"0":{"0":true}}'},
        {ALLOCATION_ANNOTATION: '{"0":{"²":1}}'},
        {ALLOCATION_ANNOTATION: '{"0":[1]}'},
        {ALLOCATION_ANNOTATION: '{"00000000000000000000000":{"0":1}}'},
        {ASSUME_TIME_ANNOTATION: "1" * 5000},
        {ASSUME_TIME_ANNOTATION: "٣"},
        {IDX_ANNOTATION: "9" * 100_000},
        {IDX_ANNOTATION: "-1"},
        {SIGNED_KEY: NESTED},
    ],
)
@pytest.mark.parametrize("mode", ["signed", "annotations"])
def test_no_annotation_content_raises(annotations, mode):
    """Deep nesting, huge values and wrong types are ignored (with a note where a placement
    was written), under either trust, and choose no card."""
    trust = PlacementTrust(mode, "gpushare.aliyun.com/", KEY.public_key)
    choice, note = decide(annotations, UID, "node-a", True, trust)
    assert choice is None or choice.card_for(0) is None
    assert choice is None or choice.assumed_at_ns is None


def test_choice_from_annotations_notes_what_was_unreadable():
    choice, note = choice_from_annotations({ALLOCATION_ANNOTATION: NESTED, IDX_ANNOTATION: "1"})
    assert choice == ExtenderChoice({}, 1, None)
    assert note == (
        "its scheduler.framework.gpushare.allocation annotation is unreadable "
        "(it is nested too deep)"
    )


def test_signed_text_refuses_what_it_cannot_write_and_parse_reads_what_it_wrote():
    with pytest.raises(ValueError, match="outside its form"):
        signed_text("uid;node=x", "node-a", 1, {0: 0})
    with pytest.raises(ValueError, match="outside its form"):
        signed_text(UID, "node-a", 1, {})
    value = signed(cards={2: 3, 0: 1, -2: 0})
    parsed = parse_signed(value)
    assert (parsed.uid, parsed.node, parsed.assumed_at_ns) == (UID, "node-a", 42)
    assert parsed.cards == {-2: 0, 0: 1, 2: 3}


def test_show_quotes_escapes_and_cuts():
    assert show('a"b\n') == '"a\\"b\\n"'
    assert show("é" * 50) == '"' + "\\u00e9" * 40 + '..."'
