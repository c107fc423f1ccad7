"""Pins the device ID scheme: the card is recoverable from any ID, IDs fit kubelet's limit."""

from nodemgr.domain.deviceids import (
    MAX_DEVICE_ID_LENGTH,
    ResourceKind,
    card_device_ids,
    card_of,
    cards_of,
    id_sort_key,
    parse_device_id,
)

UUID = "GPU-6a7c0d3e-1111-2222-3333-444455556666"


def test_memory_ids_follow_the_gpushare_convention():
    assert card_device_ids(ResourceKind.MEMORY, UUID, 3) == [
        f"{UUID}-_-0",
        f"{UUID}-_-1",
        f"{UUID}-_-2",
    ]


def test_each_card_has_100_share_ids_and_one_whole_id():
    assert len(card_device_ids(ResourceKind.CORE, UUID, 15)) == 100
    assert card_device_ids(ResourceKind.WHOLE, UUID, 15) == [UUID]


def test_card_is_recovered_from_every_id_of_every_resource():
    for kind in ResourceKind:
        for device_id in card_device_ids(kind, UUID, 15):
            assert card_of(kind, device_id) == UUID


def test_ids_of_one_resource_are_not_taken_for_another():
    assert card_of(ResourceKind.CORE, f"{UUID}-_-3") is None
    assert card_of(ResourceKind.MEMORY, f"{UUID}-_-c3") is None
    assert card_of(ResourceKind.WHOLE, f"{UUID}-_-3") is None
    assert card_of(ResourceKind.MEMORY, "garbage") is None
    assert card_of(ResourceKind.MEMORY, f"{UUID}-_-03") is None
    assert card_of(ResourceKind.CORE, f"{UUID}-_-c100") is None


def test_parse_gives_the_card_and_the_index_of_every_id():
    """parse_device_id returns (card, unit or percent index), None for a whole card's index."""
    for kind in ResourceKind:
        for position, device_id in enumerate(card_device_ids(kind, UUID, 15)):
            expected_index = None if kind is ResourceKind.WHOLE else position
            assert parse_device_id(kind, device_id) == (UUID, expected_index)
    assert parse_device_id(ResourceKind.MEMORY, f"{UUID}-_-x1") is None
    assert parse_device_id(ResourceKind.CORE, "-_-c1") is None


def test_longest_uuid_allowed_by_config_stays_within_63_characters():
    longest = "G" * 52
    for kind in ResourceKind:
        assert max(len(i) for i in card_device_ids(kind, longest, 200)) <= MAX_DEVICE_ID_LENGTH


def test_sort_is_numeric_within_a_card():
    ids = [f"{UUID}-_-10", f"{UUID}-_-9", f"{UUID}-_-0"]
    assert sorted(ids, key=id_sort_key) == [f"{UUID}-_-0", f"{UUID}-_-9", f"{UUID}-_-10"]


def test_cards_of_answers_as_card_of_for_every_id_in_order():
    """cards_of (the allocator's lookup over kubelet's whole free list) gives card_of of
    each ID in order, for IDs of this resource, of another, and garbage; asked again (from
    what it remembered), and after its memory was cleared for being full."""
    from nodemgr.domain import deviceids

    ids = [
        *card_device_ids(ResourceKind.MEMORY, UUID, 3),
        f"{UUID}-_-c3",
        "garbage",
        f"{UUID}-_-03",
        UUID,
    ]
    expected = [card_of(ResourceKind.MEMORY, i) for i in ids]
    assert cards_of(ResourceKind.MEMORY, ids) == expected
    assert cards_of(ResourceKind.MEMORY, ids) == expected
    assert cards_of(ResourceKind.CORE, ids) == [card_of(ResourceKind.CORE, i) for i in ids]
    seen = deviceids._CARDS_SEEN[ResourceKind.MEMORY]
    for n in range(deviceids._CARDS_SEEN_LIMIT + 1):
        seen[f"filler-{n}"] = None
    assert cards_of(ResourceKind.MEMORY, [*ids, "new-id"]) == [*expected, None]
    assert len(seen) <= len(ids) + 1
