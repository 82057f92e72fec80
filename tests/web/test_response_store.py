"""The stored responses: each visible to its owner only, kept for a time, within a count and a size."""

from __future__ import annotations

from vlm_demo.web.api.response_store import ResponseStore, Thread

THREAD = Thread({"url": "data:image/png;base64," + "A" * 1000}, (), (("What colour?", "Green."),))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_response_is_its_owners_alone_until_deleted() -> None:
    store = ResponseStore()
    store.put("ann", {"id": "resp_1"}, THREAD)
    assert store.get("ann", "resp_1").thread == THREAD
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.delete("ann", "resp_1") and store.get("ann", "resp_1") is None and not store.delete("ann", "resp_1")


def test_responses_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=60, clock=clock)
    store.put("", {"id": "resp_1"}, THREAD)
    clock.now = 30
    store.put("", {"id": "resp_2"}, THREAD)
    clock.now = 60
    assert store.get("", "resp_1") is None and store.get("", "resp_2") is not None
    assert not store.delete("", "resp_1")
    clock.now = 90
    assert len(store) == 0


def test_the_oldest_make_room_past_the_count_or_the_bytes_and_one_too_big_is_not_kept() -> None:
    store = ResponseStore(max_responses=3)
    for i in range(5):
        store.put("", {"id": f"resp_{i}"}, THREAD)
    assert [store.get("", f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    size = THREAD.size() + len('{"id": "resp_0"}')
    store = ResponseStore(max_bytes=2 * size)
    for i in range(3):
        store.put("", {"id": f"resp_{i}"}, THREAD)
    assert [store.get("", f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    store.put("", {"id": "resp_big"}, Thread(b"x" * 3 * size, (), ()))
    assert store.get("", "resp_big") is None and len(store) == 2
