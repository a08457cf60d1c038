"""NumPy's huge-page advice is off while the share_reads coordinator plans (issue 37:
the kernel's compaction stalls were most of the plan's system time at 4,096 ranks) and
comes back exactly as it was, nested, concurrent or after a failure."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bcp import numpy_pages, shared_read
from bcp.io_scheduler import share_parts
from bcp.shared_read import Wanted, plan_shares
from test_shared_read_plan import reader_of

pytestmark = pytest.mark.skipif(numpy_pages._set_advice is None, reason="this NumPy has no run-time huge-page switch")


def advice() -> bool:
    """NumPy's current setting, read by setting it back (the switch returns the old value)."""
    assert numpy_pages._set_advice is not None
    now = numpy_pages._set_advice(True)
    numpy_pages._set_advice(now)
    return bool(now)


@pytest.fixture(autouse=True)
def advice_on():
    before = advice()
    numpy_pages._set_advice(True)
    yield
    numpy_pages._set_advice(before)


def test_the_plan_and_the_parts_run_without_the_advice(monkeypatch):
    """Failed before: the plan's arrays were allocated with NumPy's advice on."""
    seen: dict[str, bool] = {}
    real_owners, real_parts = shared_read.choose_owners, share_parts.narrow_stable_order

    def owners(*args, **kwargs):
        seen["plan"] = advice()
        return real_owners(*args, **kwargs)

    def order(*args, **kwargs):
        seen["parts"] = advice()
        return real_parts(*args, **kwargs)

    monkeypatch.setattr(shared_read, "choose_owners", owners)
    monkeypatch.setattr(share_parts, "narrow_stable_order", order)
    shape = (12, 4)
    reader = reader_of({"w": (shape, [((r * 3, 0), (3, 4)) for r in range(4)], "float32")})
    wanted = [[("w", ((0, 0), shape))]] * 3
    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted])
    assert advice(), "the advice is back after the plan"
    parts = plan.parts(3)
    assert advice(), "the advice is back after the parts"
    assert seen == {"plan": False, "parts": False}
    assert sum(len(p.tags) for p in parts) == 3 * 4  # every rank takes part in every shared row


def test_a_caller_that_turned_it_off_keeps_it_off():
    numpy_pages._set_advice(False)
    with numpy_pages.ordinary_pages():
        assert not advice()
    assert not advice()


def test_back_after_a_failure():
    def plan() -> None:
        with numpy_pages.ordinary_pages():
            assert not advice()
            raise RuntimeError("planned")

    with pytest.raises(RuntimeError, match="planned"):
        plan()
    assert advice()


def test_nested_and_concurrent_plans_restore_only_at_the_last_exit():
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with numpy_pages.ordinary_pages():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with numpy_pages.ordinary_pages():
        thread.start()
        assert entered.wait(10)
        with numpy_pages.ordinary_pages():
            assert not advice()
        assert not advice()
    assert not advice(), "the other thread is still planning"
    release.set()
    thread.join()
    assert advice()


def test_arrays_made_without_the_advice_hold_their_values():
    with numpy_pages.ordinary_pages():
        big = np.arange(1 << 20, dtype=np.int64)  # 8 MiB: above NumPy's 4 MiB threshold
    assert int(big.sum()) == (1 << 20) * ((1 << 20) - 1) // 2
