"""The SDK's evidence of its completions: kept a while, bounded, oldest out first."""

from __future__ import annotations

from herdwick import worker
from herdwick.worker import _Evidence, _Message


def message(n: int) -> _Message:
    return _Message(message_id=f"{n}-0", execution_id=f"x{n}", attempt=1,
                    fields={"job_id": "j", "tenant_id": "t", "scheduled_for": "s"})


def test_it_keeps_what_hw_recover_needs(monkeypatch) -> None:
    monkeypatch.setattr(worker.time, "time", lambda: 10.0)
    evidence = _Evidence()
    evidence.add(message(1), b'{"ok":1}', handler_s=0.25)
    assert evidence.recent() == [("x1", 1, "j", "t", "s", 9750, 10_000, b'{"ok":1}')]


def test_it_forgets_the_oldest_past_the_cap_and_the_stale_past_the_window(monkeypatch) -> None:
    monkeypatch.setattr(worker, "EVIDENCE_MAX", 3)
    now = [100.0]
    monkeypatch.setattr(worker.time, "monotonic", lambda: now[0])
    evidence = _Evidence()
    for n in range(5):
        evidence.add(message(n), b"{}", handler_s=0)
        now[0] += 1
    assert [item[0] for item in evidence.recent()] == ["x2", "x3", "x4"]
    now[0] += worker.EVIDENCE_S - 1.5  # x2 and x3 were added over EVIDENCE_S ago
    assert [item[0] for item in evidence.recent()] == ["x4"]
