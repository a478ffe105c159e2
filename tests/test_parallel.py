"""Independent runs in forked workers: the same results, in input order, as running them one by one."""

from __future__ import annotations

import os

import pytest

from tests.conftest import tiny_scenario
from voicepipe.capacity import LevelJob, Load, conversation_s, level_pool
from voicepipe.config import load_config
from voicepipe.parallel import ForkPool, ItemFailed


def _square(x: int, report) -> tuple[int, int]:
    report(1)
    if x == 3:
        raise ValueError("three")
    return x * x, os.getpid()


def test_results_come_back_in_item_order_from_other_processes():
    items = [5, 1, 4, 2]
    got: list[int] = []
    with ForkPool(_square, items, workers=2, weights=items) as pool:
        out = pool.results(got.append)
    assert [v for v, _ in out] == [25, 1, 16, 4]
    assert all(pid != os.getpid() for _, pid in out)
    assert sum(got) == len(items)  # every item's progress arrived
    with ForkPool(_square, items, workers=1) as pool:
        assert [v for v, pid in pool.results() if pid == os.getpid()] == [25, 1, 16, 4]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_failing_item_is_named(workers):
    with pytest.raises(ItemFailed) as err, ForkPool(_square, [1, 3, 2, 3], workers=workers) as pool:
        pool.results()
    assert err.value.index == 1 and isinstance(err.value.error, ValueError)


def test_capacity_levels_in_two_processes_equal_the_serial_run():
    cfg = load_config(None, ["agent.backend=a100-40gb/llama-3.1-70b", "client.playout=first_audio"])
    sc = tiny_scenario(turns=2)
    d = conversation_s(cfg, [sc])
    jobs = [LevelJob("a100", cfg, (sc,), Load("sessions", n), d) for n in (1, 6, 3)]
    runs = []
    for workers in (1, 2):
        with level_pool(jobs, workers) as pool:
            runs.append([{**lv.to_json(), "wall_s": 0, "cpu_s": 0} for lv in pool.results()])
    assert runs[0] == runs[1]
    assert [r["load"] for r in runs[0]] == [1, 6, 3]


def test_predict_each_in_two_processes_equals_predict_one_by_one():
    from voicepipe.predict import predict, predict_each

    sc = tiny_scenario(turns=2)
    cfgs = [load_config(None, [f"agent.backend={b}"]) for b in ("groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b")]
    got = predict_each(cfgs, [sc], 2, workers=2)
    assert [[p.to_json() for p in ps] for ps in got] == [
        [p.to_json() for p in predict(c, [sc], 2)] for c in cfgs
    ]
