"""The dispatch-order policies alone: shares by weight, idle share, newcomers, due order."""

from __future__ import annotations

import collections
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
