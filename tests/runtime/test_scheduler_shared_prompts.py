"""Requests sharing a prompt that arrive together (n choices of one request) compute its
blocks once: the policy holds the later ones until the first has cached them."""

from runtime.kv.blocks import BlockPool
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams

from tests.runtime.test_scheduler import done, spans

PROMPT = tuple(range(1, 42))  # 41 tokens: ten full blocks of 4 and one token over


def siblings_policy(*, caching=True, max_batch=4, num_blocks=64):
    pool = BlockPool(num_blocks, 4, is_caching=caching)
    return FcfsScheduler(max_batch, pool, 256, 16, 20, solo_prefill_tokens=0)


def params(prompt=PROMPT, priority=0, max_tokens=64):
    return SequenceParams(prompt_tokens=prompt, max_tokens=max_tokens, priority=priority)


def run_to_first_tokens(p, names):
    """Schedule and report steps until every named request has sampled once."""
    sampled, peak = set(), 0
    while not set(names) <= sampled:
        plan = p.schedule()
        sampled |= {s.request_id for s in plan.spans if s.samples}
        peak = max(peak, p.pool.num_used_blocks)
        done(p, plan)
    return peak


def test_choices_of_one_prompt_share_its_blocks_and_compute_only_their_tails():
    p = siblings_policy()
    names = [f"c{i}" for i in range(4)]
    for name in names:
        p.add(name, params())
    first = p.schedule()
    assert [o[0] for o in first.opens] == ["c0"]  # the others wait for c0's blocks
    assert spans(first) == [("c0", 0, 16)]
    done(p, first)
    peak = run_to_first_tokens(p, names)
    opened = {r.request_id: r.num_cached_tokens for r in p.running.values()}
    assert opened == {"c0": 0, "c1": 40, "c2": 40, "c3": 40}  # all ten full blocks shared
    shared = p.running["c0"].blocks[:10]
    assert all(p.running[n].blocks[:10] == shared for n in names)
    assert all(p.pool.refcount[b] == 4 for b in shared)
    # One prompt's eleven blocks plus a tail block for each other choice, not 4 x 11.
    assert peak == 11 + 3

    unshared = siblings_policy(caching=False)
    for name in names:
        unshared.add(name, params())
    assert run_to_first_tokens(unshared, names) >= 4 * 11  # every choice its own prompt


def test_a_held_request_does_not_hold_up_an_unrelated_one_behind_it():
    p = siblings_policy()
    p.add("a0", params())
    p.add("a1", params())
    p.add("other", params(prompt=tuple(range(100, 110))))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["a0", "other"]
    assert [r.request_id for r in p.waiting] == ["a1"]


def test_a_request_is_never_held_behind_one_of_lower_priority():
    p = siblings_policy()
    p.add("background", params(priority=5))
    p.schedule()  # background is computing the prompt's blocks
    p.add("urgent", params(priority=0))
    plan = p.schedule()
    assert [o[0] for o in plan.opens] == ["urgent"]  # computes its own copy at once


def test_a_sibling_is_released_when_the_first_leaves_before_caching_its_blocks():
    p = siblings_policy()
    p.add("c0", params())
    p.add("c1", params())
    assert [o[0] for o in p.schedule().opens] == ["c0"]
    p.abort("c0")  # its blocks will never be cached
    assert [o[0] for o in p.schedule().opens] == ["c1"]


def test_a_request_sharing_only_a_short_head_is_not_held():
    """A chat template's common first block is not worth a step of waiting: the second
    request is admitted beside the first and computes its own copy of that block."""
    p = siblings_policy()
    head = PROMPT[:4]  # one shared block of ten
    p.add("a", params())
    p.add("b", params(head + tuple(range(100, 137))))
    first = p.schedule()
    assert [o[0] for o in first.opens] == ["a", "b"]
    p2 = siblings_policy()
    p2.add("a", params())
    p2.add("b", params(PROMPT[:24] + tuple(range(100, 117))))  # six shared blocks of ten: held
    assert [o[0] for o in p2.schedule().opens] == ["a"]
    p3 = siblings_policy()
    p3.add("a", params())
    p3.add("b", params(PROMPT[:20] + tuple(range(100, 121))))  # five of ten, half: held
    assert [o[0] for o in p3.schedule().opens] == ["a"]
    p4 = siblings_policy()
    p4.add("a", params())
    p4.add("b", params(PROMPT[:16] + tuple(range(100, 121))))  # four of nine: not held
    assert [o[0] for o in p4.schedule().opens] == ["a", "b"]


def test_a_request_is_held_behind_the_best_priority_computing_its_prompt():
    """Two running requests compute the prompt, one of priority 5 and one of 0: a third
    of priority 0 waits for their blocks, since one of them ranks as high as it does."""
    p = siblings_policy()
    p.add("background", params(priority=5))
    p.schedule()
    p.add("urgent", params(priority=0))
    assert [o[0] for o in p.schedule().opens] == ["urgent"]
    p.add("sibling", params(priority=0))
    p.schedule()
    assert [r.request_id for r in p.waiting] == ["sibling"]


def test_the_block_holding_the_last_token_does_not_count_against_holding():
    """b's 12 tokens look up 2 blocks (the last is computed whatever is cached); a is
    computing the first: half of them, so b waits for it."""
    p = siblings_policy()
    head = tuple(range(1, 5))
    p.add("a", params(head + tuple(range(100, 105))))
    first = p.schedule()
    p.add("b", params(head + tuple(range(200, 208))))
    assert p.schedule().opens == () and p.num_waiting == 1
    done(p, first)
    assert p.schedule().opens[0][::2] == ("b", 4)
