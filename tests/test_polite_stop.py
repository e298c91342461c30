"""A polite stop: SIGINT and SIGTERM only raise a flag (cnn.interrupt); training saves exactly there and
``--resume`` reproduces the uninterrupted run bit for bit (cnn.train, python -m cnn train)."""

import os
import signal
import threading

import pytest

from cnn.interrupt import polite_stop


# -- cnn.interrupt ------------------------------------------------------------------------------

@pytest.mark.parametrize("signum, name, code", [(signal.SIGINT, "SIGINT", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_a_signal_only_sets_the_flag(signum, name, code):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with polite_stop() as stop:
        assert stop.installed and not stop.requested and stop.exit_code is None
        os.kill(os.getpid(), signum)            # delivered to this (main) thread before kill returns
        assert stop.requested and stop.signal_name == name and stop.exit_code == code
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_a_second_sigint_is_not_polite_and_the_first_signal_is_the_one_recorded():
    with polite_stop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)     # first SIGINT: still polite, but SIGTERM came first
        assert (stop.signal_name, stop.exit_code) == ("SIGTERM", 143)
        with pytest.raises(KeyboardInterrupt):  # second SIGINT: Python's own handler again
            os.kill(os.getpid(), signal.SIGINT)


def test_the_previous_handlers_come_back_even_after_an_exception():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(RuntimeError), polite_stop():
            raise RuntimeError("the block failed")
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_nothing_is_installed():
    results = []

    def run():
        with polite_stop() as stop:
            results.append((stop.installed, signal.getsignal(signal.SIGINT) is signal.default_int_handler))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [(False, True)]
