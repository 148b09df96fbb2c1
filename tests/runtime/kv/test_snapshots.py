"""The policy's book of recurrent-state snapshots (runtime/kv/snapshots.py): every id it
plans is named or dropped, named ones live under a count, least recently used first, and
go when their block leaves the cache."""

from runtime.kv.snapshots import SnapshotBook


def named_by(hashes):
    """A resolver naming each save by `hashes[position]` (None: its row failed or left)."""
    return lambda save: hashes.get(save.position)


def test_a_save_is_named_by_its_blocks_hash_or_dropped():
    book = SnapshotBook(capacity=4)
    kept = book.plan_save(1, "a", 8, is_decode=False)
    failed = book.plan_save(1, "b", 8, is_decode=False)
    book.on_step_done(1, lambda save: b"h8" if save.request_id == "a" else None)
    assert book.has(b"h8") and book.take(b"h8") == kept
    assert book.take_drops({b"h8"}) == (failed,)
    assert book.take_drops({b"h8"}) == ()  # each drop is handed over once


def test_a_second_snapshot_of_one_prefix_is_dropped_and_the_first_kept():
    book = SnapshotBook(capacity=4)
    first = book.plan_save(1, "a", 8, is_decode=False)
    book.on_step_done(1, named_by({8: b"h8"}))
    second = book.plan_save(2, "b", 8, is_decode=False)
    book.on_step_done(2, named_by({8: b"h8"}))
    assert book.take(b"h8") == first and book.take_drops({b"h8"}) == (second,)


def test_past_its_capacity_the_least_recently_used_goes():
    book = SnapshotBook(capacity=2)
    ids = {}
    for step, name in enumerate([b"x", b"y"], 1):
        ids[name] = book.plan_save(step, name.decode(), 4, is_decode=False)
        book.on_step_done(step, lambda save, name=name: name)
    book.take(b"x")  # a hit: x is now the most recently used
    ids[b"z"] = book.plan_save(3, "z", 4, is_decode=False)
    book.on_step_done(3, lambda save: b"z")
    assert not book.has(b"y") and book.has(b"x") and book.has(b"z")
    assert book.take_drops({b"x", b"y", b"z"}) == (ids[b"y"],)


def test_a_snapshot_goes_when_its_block_leaves_the_cache():
    book = SnapshotBook(capacity=4)
    sid = book.plan_save(1, "a", 4, is_decode=False)
    book.on_step_done(1, named_by({4: b"h4"}))
    assert book.take_drops({b"h4"}) == ()
    assert book.take_drops(set()) == (sid,) and not book.has(b"h4")


def test_a_decoding_rows_newer_boundary_replaces_its_older_but_not_its_prompts():
    book = SnapshotBook(capacity=8)
    hashes = {4: b"p", 8: b"d8", 12: b"d12"}
    prompt = book.plan_save(1, "a", 4, is_decode=False)
    older = book.plan_save(2, "a", 8, is_decode=True)
    book.on_step_done(1, named_by(hashes))
    book.on_step_done(2, named_by(hashes))
    newer = book.plan_save(3, "a", 12, is_decode=True)
    book.on_step_done(3, named_by(hashes))
    assert book.take_drops(set(hashes.values())) == (older,)
    assert book.take(b"p") == prompt and book.take(b"d12") == newer
    book.forget("a")  # it finished: its newest boundary stays for the next turn
    other = book.plan_save(4, "b", 16, is_decode=True)
    book.on_step_done(4, named_by({16: b"d16"}))
    assert book.has(b"d12") and book.take(b"d16") == other
    again = book.plan_save(5, "a", 20, is_decode=True)  # "a" back (preempted, resumed)
    book.on_step_done(5, named_by({20: b"d20"}))
    assert book.has(b"d12") and book.take(b"d20") == again  # its boundary before it left stays
    assert book.take_drops(set(hashes.values()) | {b"d16", b"d20"}) == ()


def test_the_longest_usable_prefix_ends_at_a_block_with_a_snapshot():
    book = SnapshotBook(capacity=4)
    book.plan_save(1, "a", 8, is_decode=False)
    book.on_step_done(1, named_by({8: b"h2"}))
    assert book.longest_usable([b"h1", b"h2", b"h3"]) == 2
    assert book.longest_usable([b"h1"]) == 0
    book.plan_save(2, "b", 4, is_decode=False)
    book.on_step_done(2, named_by({4: b"h1"}))
    assert book.longest_usable([b"h1", b"h9"]) == 1  # a snapshot after the first block
    assert book.longest_usable([]) == 0
