"""shiftguard._parallel: parts run once each, on torch's OpenMP team where there is one, with
exceptions re-raised, from several Python threads at once, and in a forked child; the compiled
kernels' index ranges cover every item once."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from shiftguard import _parallel as P

OPENMP_HERE = (
    os.path.exists("/proc/self/maps")
    and "parallel backend: OpenMP" in torch.__config__.parallel_info()
    and os.environ.get("SHIFTGUARD_THREADS", "").strip().lower() != "pool"
)


@pytest.fixture(params=["default", "pool"])
def backend(request, monkeypatch):
    """Each test runs on the default back end and on the thread-pool fallback."""
    monkeypatch.setattr(P, "_STATE", {})
    if request.param == "pool":
        monkeypatch.setenv("SHIFTGUARD_THREADS", "pool")
    yield request.param
    P._STATE.clear()


@pytest.mark.parametrize("n_parts", [0, 1, 2, 3, 17])
def test_every_part_runs_exactly_once(backend, n_parts):
    calls = np.zeros(max(n_parts, 1), dtype=np.int64)
    lock = threading.Lock()

    def part(i):
        with lock:
            calls[i] += 1

    P.parallel_parts(part, n_parts)
    assert (calls[:n_parts] == 1).all()
    assert n_parts > 0 or calls.sum() == 0


@pytest.mark.parametrize("n_parts, threads", [(8, 2), (17, 3), (5, 1), (3, 8)])
def test_fewer_threads_than_parts_run_every_part_once_on_at_most_that_many_threads(backend, n_parts, threads):
    calls = np.zeros(n_parts, dtype=np.int64)
    idents = set()
    lock = threading.Lock()

    def part(i):
        with lock:
            calls[i] += 1
            idents.add(threading.get_ident())
        time.sleep(0.002)  # releases the GIL: the other threads take parts meanwhile

    P.parallel_parts(part, n_parts, threads)
    assert (calls == 1).all()
    assert 1 <= len(idents) <= min(threads, n_parts)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_exception_with_fewer_threads_than_parts_is_raised_after_the_others_ran(backend, threads):
    done = []

    def part(i):
        if i in (2, 5):
            raise ValueError(f"part {i} failed")
        done.append(i)

    with pytest.raises(ValueError, match="part 2 failed"):
        P.parallel_parts(part, 7, threads)
    assert sorted(done) == [0, 1, 3, 4, 6]


def test_backend_is_named(backend):
    got = P.backend()
    if backend == "pool":
        assert got == "pool"
    else:
        assert got == ("openmp" if OPENMP_HERE else "pool")


@pytest.mark.skipif(not OPENMP_HERE, reason="torch here does not run on a GNU-ABI OpenMP runtime under /proc/self/maps")
def test_parts_run_on_torch_openmp_team_including_the_caller(monkeypatch):
    monkeypatch.setattr(P, "_STATE", {})
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).sum()  # torch's team exists
        idents = [None, None]
        both = threading.Barrier(2, timeout=30)

        def part(i):
            idents[i] = threading.get_ident()
            both.wait()  # a part waits for the other: the caller cannot take both (parts are
            # handed out as threads free up), so a second team thread must run one

        P.parallel_parts(part, 2)
    finally:
        torch.set_num_threads(old)
    assert P.backend() == "openmp"
    # the calling thread (thread 0 of the team) ran one of the parts, a second team thread the
    # other; which part each took depends on which thread came first to the shared counter
    assert threading.get_ident() in idents
    assert None not in idents and idents[0] != idents[1]


@pytest.mark.parametrize("bad_part", [0, 1, 4])
def test_an_exception_in_any_part_is_raised_to_the_caller(backend, bad_part):
    done = []

    def part(i):
        if i == bad_part:
            raise ValueError(f"part {i} failed")
        done.append(i)

    with pytest.raises(ValueError, match=f"part {bad_part} failed"):
        P.parallel_parts(part, 5)
    assert sorted(done) == [i for i in range(5) if i != bad_part]


def test_calls_from_several_python_threads_at_once_do_not_mix(backend):
    results = {}
    errors = []

    def caller(k):
        try:
            for _ in range(20):
                out = np.zeros(6)

                def part(i, out=out):
                    time.sleep(0.0005)
                    out[i] = k * 100 + i

                P.parallel_parts(part, 6)
                np.testing.assert_array_equal(out, k * 100 + np.arange(6))
            results[k] = True
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]


def test_a_forked_child_falls_back_to_the_pool_and_does_not_hang(run_forked):
    torch.ones(1 << 20).sum()
    out = np.zeros(2)
    P.parallel_parts(lambda i: out.__setitem__(i, 1.0), 2)  # the parent has used its back end

    def child():
        res = np.zeros(3)
        P.parallel_parts(lambda i: res.__setitem__(i, i + 1.0), 3)
        return P.backend() == "pool" and res.tolist() == [1.0, 2.0, 3.0]

    assert run_forked(child, "parallel_parts") == 0


@pytest.mark.parametrize("tiered", [False, True])
@pytest.mark.parametrize("items, threads", [(512, 2), (128, 2), (9, 2), (7, 2), (100, 3), (3, 4)])
def test_ranges_cover_every_item_once(items, threads, tiered, monkeypatch):
    # parallel_ranges' split into contiguous ranges (even, or tiered: two a thread, the first half
    # of them 3/4 of the items): every item in exactly one range, in order
    monkeypatch.setattr(P, "torch_threads", lambda: threads)
    ranges = []
    monkeypatch.setattr(P, "parallel_parts", lambda fn, n, t: [fn(i) for i in range(n)])
    P.parallel_ranges(lambda i0, i1: ranges.append((i0, i1)), items, 1 << 20, tiered=tiered)
    assert ranges[0][0] == 0 and ranges[-1][1] == items
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(i0 < i1 for i0, i1 in ranges)
    if tiered and items >= 4 * threads:
        sizes = [i1 - i0 for i0, i1 in ranges]
        assert len(sizes) == 2 * threads and sum(sizes[:threads]) == 3 * items // 4


def test_small_work_runs_inline_as_one_range_with_the_arguments(monkeypatch):
    monkeypatch.setattr(P, "torch_threads", lambda: 4)
    monkeypatch.setattr(P, "parallel_parts", lambda *a: pytest.fail("small work was split over threads"))
    calls = []
    P.parallel_ranges(lambda i0, i1, a, b: calls.append((i0, i1, a, b)), 10, (1 << 16) - 1, "a", "b")
    assert calls == [(0, 10, "a", "b")]
