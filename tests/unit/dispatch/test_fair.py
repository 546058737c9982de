"""The gateway's fair scheduler: class order, anti-starvation, VTC fairness between tenants."""

from __future__ import annotations

import pytest

from sluice.gateway.dispatch.fair import ClassPolicy, FairScheduler, Pending
from sluice.protocol import Priority

pytestmark = pytest.mark.unit


def item(rid: str, tenant: str, priority: Priority = Priority.STANDARD, at: float = 0.0,
         prompt: int = 10, weight: float = 1.0) -> Pending[str]:
    return Pending(request_id=rid, tenant=tenant, priority=priority, enqueued_at=at, payload=rid,
                   prompt_tokens=prompt, weight=weight)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def serve(sched: FairScheduler[str], steps: int, output_tokens: int = 20) -> dict[str, int]:
    """Dispatch one item per step and serve it fully; returns tokens served per tenant."""
    served: dict[str, int] = {}
    for _ in range(steps):
        got = sched.pop(now=0.0)
        if got is None:
            break
        sched.charge(got.tenant, got.priority, output_tokens)
        served[got.tenant] = served.get(got.tenant, 0) + got.prompt_tokens + output_tokens
    return served


def test_strict_class_order_without_aging() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    sched.push(item("b1", "t", Priority.BATCH))
    sched.push(item("s1", "t", Priority.STANDARD))
    sched.push(item("i1", "t", Priority.INTERACTIVE))
    assert [sched.pop(0.0).request_id for _ in range(3)] == ["i1", "s1", "b1"]
    assert sched.pop(0.0) is None


def test_priority_disabled_is_one_fifo_lane() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(priority_enabled=False, aging_s=0))
    sched.push(item("b1", "t", Priority.BATCH, at=1.0))
    sched.push(item("i1", "t", Priority.INTERACTIVE, at=2.0))
    assert [sched.pop(0.0).request_id for _ in range(2)] == ["b1", "i1"]


def test_aging_serves_an_old_lower_class_item_first() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=10))
    sched.push(item("b-old", "t", Priority.BATCH, at=0.0))
    sched.push(item("i-new", "u", Priority.INTERACTIVE, at=50.0))
    assert sched.pop(now=5.0).request_id == "i-new"  # not aged yet
    sched.push(item("i-new2", "u", Priority.INTERACTIVE, at=50.0))
    assert sched.pop(now=60.0).request_id == "b-old"  # waited 60 s >= 10 s


def test_min_share_gives_a_backlogged_low_class_its_share() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0, min_share={Priority.BATCH: 0.1}))
    for n in range(200):
        sched.push(item(f"i{n}", "a", Priority.INTERACTIVE))
    for n in range(50):
        sched.push(item(f"b{n}", "b", Priority.BATCH))
    picked = [sched.pop(0.0).priority for _ in range(100)]
    share = picked.count(Priority.BATCH) / len(picked)
    assert 0.08 <= share <= 0.15
    # Interactive still dominates.
    assert picked.count(Priority.INTERACTIVE) > 80


def test_equal_weights_flooder_gets_equal_token_share() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    for n in range(1000):
        sched.push(item(f"a{n}", "flood", at=float(n)))
    for n in range(100):
        sched.push(item(f"b{n}", "light", at=float(n) * 10))
    served = serve(sched, 150)
    assert jain([served["flood"], served["light"]]) >= 0.95


def test_weights_two_to_one_give_two_to_one_tokens() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    for n in range(300):
        sched.push(item(f"h{n}", "heavy", weight=2.0))
        sched.push(item(f"l{n}", "light", weight=1.0))
    served = serve(sched, 300)
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.05)


def test_idle_tenant_does_not_bank_credit() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    for n in range(50):
        sched.push(item(f"a{n}", "busy"))
    serve(sched, 40)  # busy's counter grows while "late" is idle
    for n in range(20):
        sched.push(item(f"l{n}", "late"))
    # Lifted to busy's counter, so the two now alternate instead of late taking 20 in a row.
    order = [sched.pop(0.0).tenant for _ in range(6)]
    sched_tenants = set(order)
    assert sched_tenants == {"busy", "late"}
    assert order.count("late") <= 4


def test_requeue_keeps_the_items_turn_and_remove_drops_it() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    sched.push(item("x1", "t"))
    sched.push(item("x2", "t"))
    first = sched.pop(0.0)
    sched.requeue(first)
    assert sched.pop(0.0).request_id == "x1"
    assert sched.remove("x2") is not None
    assert len(sched) == 0
    assert sched.remove("x2") is None


def test_pop_if_leaves_the_item_when_refused() -> None:
    sched: FairScheduler[str] = FairScheduler()
    sched.push(item("x", "t"))
    assert sched.pop_if(0.0, lambda _: False) is None
    assert sched.pop_if(0.0, lambda _: True).request_id == "x"


def test_snapshot_counts_per_class_and_tenant() -> None:
    sched: FairScheduler[str] = FairScheduler()
    sched.push(item("a", "t1", Priority.BATCH, at=1.0))
    sched.push(item("b", "t2", Priority.BATCH, at=3.0))
    sched.push(item("c", "t1", Priority.INTERACTIVE, at=2.0))
    snap = sched.snapshot(now=11.0)
    assert snap["classes"]["batch"] == {"depth": 2, "tenants": {"t1": 1, "t2": 1}, "oldest_wait_s": 10.0,
                                        "tenant_oldest_wait_s": {"t1": 10.0, "t2": 8.0}}
    assert snap["classes"]["interactive"]["depth"] == 1
    assert snap["classes"]["standard"]["depth"] == 0


def test_bad_policy_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="aging_s"):
        ClassPolicy(aging_s=-1)
    with pytest.raises(ValueError, match="minimum share"):
        ClassPolicy(min_share={Priority.BATCH: 1.5})
    with pytest.raises(ValueError, match="weight"):
        FairScheduler().push(item("x", "t", weight=0))


def test_an_item_nobody_takes_does_not_block_the_items_behind_it() -> None:
    """No head-of-line blocking: a request for a model no worker serves waits, others go."""
    sched: FairScheduler[str] = FairScheduler()
    sched.push(Pending("a1", "t1", Priority.INTERACTIVE, 0.0, "ghost"))
    sched.push(Pending("a2", "t1", Priority.INTERACTIVE, 1.0, "ghost"))
    sched.push(Pending("b1", "t1", Priority.INTERACTIVE, 2.0, "demo"))
    sched.push(Pending("c1", "t2", Priority.BATCH, 3.0, "demo"))
    served = lambda item: item.payload == "demo"  # noqa: E731
    assert sched.pop_if(0.0, served).request_id == "b1"  # behind two of its own tenant's
    assert sched.pop_if(0.0, served).request_id == "c1"  # a lower class, behind the stuck one
    assert sched.pop_if(0.0, served) is None
    assert len(sched) == 2


def test_shared_counters_hand_over_charges_and_joins_and_take_the_clusters_values_back() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0), shared_counters=True)
    sched.push(item("a1", "a", prompt=10))
    sched.push(item("b1", "b", prompt=10, weight=2.0))
    assert sched.pop(0.0).request_id == "a1"  # charged 10
    sync = sched.take_sync()[Priority.STANDARD]
    assert sync.charges == {"a": 10.0} and sync.backlogged == ["b"] and sync.joined == ["a", "b"]
    assert sched.take_sync()[Priority.STANDARD].charges == {}  # handed over once
    sched.charge("b", Priority.STANDARD, 8)  # charged while the sync was on its way: 8 / 2
    sched.set_counters(Priority.STANDARD, {"b": 100.0})  # the cluster's value, without that charge
    assert sched.counter(Priority.STANDARD, "b") == 104.0
    sched.restore_sync(sched.take_sync())  # a sync that failed: told again next time
    assert sched.take_sync()[Priority.STANDARD].charges == {"b": 4.0}


def test_local_counters_record_nothing_for_a_sync() -> None:
    sched: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    sched.push(item("a1", "a"))
    sched.pop(0.0)
    assert sched.take_sync()[Priority.STANDARD].charges == {}
