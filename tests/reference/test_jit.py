"""The compiled paths' shared loader: a kernel is loaded once per process, and a load that
fails (numba absent, broken, unable to compile) leaves None, so the numpy path runs."""

import sys
import threading

from kvcanary.backends.reference.jit import LoadOnce


def test_loaded_once_across_threads():
    calls = []

    def load():
        calls.append(1)
        return "kernels"

    once = LoadOnce(load)
    threads = [threading.Thread(target=once) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert once() == "kernels" and calls == [1]


def test_a_failing_load_gives_none_and_is_not_retried():
    calls = []

    def load():
        calls.append(1)
        raise ImportError("No module named 'numba'")

    once = LoadOnce(load)
    assert once() is None and once() is None and calls == [1]


def test_a_big_endian_host_gets_none(monkeypatch):
    once = LoadOnce(lambda: "kernels")
    monkeypatch.setattr(sys, "byteorder", "big")
    assert once() is None
