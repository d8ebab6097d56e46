"""The dispatch-order policies alone: shares by weight, idle share, newcomers, due order."""

from __future__ import annotations

import collections
import heapq
import random

import pytest

from herdwick.actors.fairness import DrrPolicy, FifoPolicy


def item(due: int, n: int = 0) -> int:
    return due << 32 | n  # the due time in the high bits, as the fair queue's items


def fill(policy, tenant: str, count: int, first_due: int = 0) -> None:
    for n in range(count):
        policy.add(tenant, item(first_due + n, n))


def shares(taken) -> collections.Counter:
    return collections.Counter(tenant for tenant, _ in taken)


@pytest.mark.parametrize("budget", [7, 100, 1_000, 5_000])
def test_weights_1_2_4_get_1_2_4_of_the_dispatch(budget: int) -> None:
    weights = {"a": 1, "b": 2, "c": 4}
    policy = DrrPolicy(weights.__getitem__)
    for tenant in weights:
        fill(policy, tenant, 100_000)
    taken = []
    for _ in range(70_000 // budget):
        taken += policy.take(budget)
    got = shares(taken)
    total = sum(got.values())
    for tenant, weight in weights.items():
        assert got[tenant] / total == pytest.approx(weight / 7, rel=0.05), (tenant, got)


def test_an_idle_tenant_s_share_goes_to_the_others_at_once() -> None:
    policy = DrrPolicy({"a": 1, "b": 1, "quiet": 2}.__getitem__)
    fill(policy, "a", 10_000)
    fill(policy, "b", 10_000)
    fill(policy, "quiet", 10)
    taken = policy.take(1_000)
    got = shares(taken)
    assert len(taken) == 1_000  # nothing of the budget is held back for anyone
    assert got["quiet"] == 10
    assert got["a"] + got["b"] == 990
    for _ in range(9):
        got += shares(policy.take(1_000))
    assert got["a"] == pytest.approx(got["b"], rel=0.05)


def test_a_tenant_that_becomes_active_is_served_within_one_round() -> None:
    policy = DrrPolicy()
    fill(policy, "noisy", 100_000)
    policy.take(1_000)
    fill(policy, "new", 5, first_due=10**6)  # due later than all the noisy work
    got = shares(policy.take(1_000))
    assert got["new"] == 5


def test_within_a_tenant_work_goes_in_due_order() -> None:
    policy = DrrPolicy()
    dues = list(range(500))
    random.Random(7).shuffle(dues)
    for due in dues:
        policy.add("t", item(due))
    fill(policy, "other", 500)
    taken = [i for t, i in policy.take(300) + policy.take(700) if t == "t"]
    assert [i >> 32 for i in taken] == sorted(i >> 32 for i in taken) == list(range(500))


def test_a_round_cut_short_continues_the_turn_without_a_second_quantum() -> None:
    policy = DrrPolicy()
    fill(policy, "a", 1_000)
    fill(policy, "b", 1_000)
    got = shares(policy.take(3) + policy.take(3) + policy.take(2) + policy.take(2))
    assert got["a"] == got["b"] == 5


def test_ineligible_tenants_wait_and_the_rest_take_their_share() -> None:
    policy = DrrPolicy()
    fill(policy, "limited", 100)
    fill(policy, "free", 100)
    taken = policy.take(50, eligible=lambda t: t != "limited")
    assert shares(taken) == {"free": 50}
    assert policy.waiting("limited") == 100
    policy.put_back("free", [i for _, i in taken[:10]])
    assert policy.backlog == 160


def test_dropping_a_moved_shard_s_items_forgets_them() -> None:
    policy = DrrPolicy()
    fill(policy, "a", 10)
    fill(policy, "b", 10)
    assert len(policy.drop(lambda i: i & 1 == 0)) == 10
    assert policy.backlog == 10
    assert len(policy.take(100)) == 10


def test_fifo_serves_every_tenant_in_due_order_alone() -> None:
    policy = FifoPolicy()
    fill(policy, "noisy", 1_000, first_due=0)
    fill(policy, "quiet", 10, first_due=500)
    first = policy.take(500)
    assert shares(first) == {"noisy": 500}  # the quiet tenant waits behind the herd
    second = policy.take(20)  # due 500..509: both tenants' work, interleaved by due time
    assert shares(second) == {"quiet": 10, "noisy": 10}
    assert [i >> 32 for _, i in second] == sorted(i >> 32 for _, i in second)


@pytest.mark.parametrize("policy_type", [DrrPolicy, FifoPolicy])
def test_work_handed_over_early_is_taken_only_once_due(policy_type) -> None:
    policy = policy_type()
    fill(policy, "a", 10, first_due=100)  # due 100..109
    fill(policy, "b", 10, first_due=105)  # due 105..114
    assert policy.due(item(100)) == 0  # bound: the least item not yet due
    assert policy.take(50, bound=item(100)) == []
    assert policy.earliest() == item(100, 0)
    bound = item(106)
    assert policy.due(bound) == 6 + 1
    assert policy.due(bound, limit=3) == 3
    taken = policy.take(50, bound=bound)
    assert sorted(taken) == sorted([("a", item(100 + n, n)) for n in range(6)] + [("b", item(105))])
    assert policy.backlog == 20 - 7
    assert policy.take(50, bound=bound) == []
    rest = policy.take(50)
    assert len(rest) == 13 and all(work >= bound for _, work in rest)


def test_a_tenant_with_nothing_due_yet_keeps_no_credit_and_does_not_block_the_ring() -> None:
    policy = DrrPolicy()
    fill(policy, "early", 100, first_due=0)
    fill(policy, "later", 100, first_due=1_000)
    first = policy.take(20, bound=item(1_000))
    assert shares(first) == {"early": 20}  # "later" sat out: its work is not due
    # Once both are due they share evenly: "later" brought no credit from its wait.
    second = policy.take(40, bound=item(2_000))
    assert shares(second) == {"early": 20, "later": 20}


def test_due_counts_below_the_bound_in_any_heap_shape() -> None:
    from herdwick.actors.fairness import count_below

    rng = random.Random(7)
    for _ in range(200):
        values = [rng.randrange(1_000) for _ in range(rng.randrange(0, 300))]
        heap = []
        for v in values:
            heapq.heappush(heap, v)
        bound = rng.randrange(1_100)
        want = sum(v < bound for v in values)
        assert count_below(heap, bound, 1 << 30) == want
        assert count_below(heap, bound, 5) == min(want, 5)


@pytest.mark.parametrize("policy_type", [DrrPolicy, FifoPolicy])
def test_due_agrees_with_a_count_of_every_item_through_adds_takes_and_drops(policy_type) -> None:
    # DrrPolicy counts a tenant whose every item is due without walking its heap, by an
    # upper bound of its items kept as they come and go.
    rng = random.Random(11)
    policy = policy_type()
    held: list[int] = []
    for _ in range(2_000):
        step = rng.random()
        if step < 0.5:
            work = item(rng.randrange(200), rng.randrange(1 << 20))
            policy.add(rng.choice("abcd"), work)
            held.append(work)
        elif step < 0.8:
            taken = policy.take(rng.randrange(1, 30), bound=item(rng.randrange(220)))
            for _, work in taken:
                held.remove(work)
        elif step < 0.85:
            parity = rng.randrange(2)
            dropped = policy.drop(lambda w, parity=parity: w & 1 == parity)
            held = [w for w in held if w not in set(dropped)]
        bound = item(rng.randrange(220))
        want = sum(w < bound for w in held)
        assert policy.due(bound) == want
        assert policy.due(bound, limit=7) == min(want, 7)
        assert policy.backlog == len(held)
