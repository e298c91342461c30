"""A polite stop: Ctrl-C (SIGINT) or a scheduler's SIGTERM asks a run to stop at its next safe point.

Python's default turns SIGINT into ``KeyboardInterrupt`` wherever the program happens to be — half
way through a step, half way through writing a file — and SIGTERM kills the process outright. Inside
``polite_stop`` both only raise a flag; the loop looks at it between steps, saves exactly where it
is, and exits with the shell's code for that signal::

    with polite_stop() as stop:
        for step in steps:
            train(step)
            if stop.requested:
                save(); return stop.exit_code       # 130 for SIGINT, 143 for SIGTERM (128 + signal)

A second signal of the same kind is not polite any more: it gets the handler that was there before
the block (``KeyboardInterrupt`` for SIGINT, termination for SIGTERM), so a stuck run can still be
stopped. Leaving the block puts the previous handlers back.

Signal handlers can only be set from the main thread of the main interpreter: elsewhere the block
changes nothing and ``stop.installed`` is False (``requested`` then never becomes True).

A ``polite_stop`` inside another one (in the same thread) installs nothing and shares the outer
one's request. That is what ``@politely`` is for: ``python -m cnn train`` runs inside one, so a
signal that arrives after training has ended — while its history is still being written — waits
for the history instead of killing the process before it is saved.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Iterator

#: The signals a polite stop catches: Ctrl-C, and what schedulers and notebook servers send before SIGKILL
POLITE_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_active = threading.local()         # .stop: the polite stop in force in this thread, if any


class StopRequest:
    """What ``polite_stop`` yields: whether a stop was asked for, by which signal, and the exit code to use."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None     # "SIGINT" or "SIGTERM": the first one received
        self.exit_code: int | None = None       # 128 + its number: 130 or 143
        self.installed = False                  # whether the handlers are in place (main thread only)

    def note(self, signum: int) -> None:
        """Record the first signal received; later ones leave the record as it is."""
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name
            self.exit_code = 128 + signum


@contextlib.contextmanager
def polite_stop(signals=POLITE_SIGNALS) -> Iterator[StopRequest]:
    """Within the block, each of ``signals`` sets ``stop.requested`` the first time and is handled as
    before the block the second time; the previous handlers are restored when the block ends."""
    if getattr(_active, "stop", None) is not None:        # inside another one: share it
        yield _active.stop
        return
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.getsignal(signum) for signum in signals}

    def on_signal(signum, frame):
        stop.note(signum)
        signal.signal(signum, previous[signum])   # the next one of this kind is not polite

    try:
        for signum in signals:
            signal.signal(signum, on_signal)
        stop.installed, _active.stop = True, stop
        yield stop
    finally:
        _active.stop = None
        for signum, handler in previous.items():
            # None: a handler not set from Python; the default is the nearest we can restore
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def politely(command):
    """Decorator: ``command`` runs inside a ``polite_stop``, which every ``polite_stop`` within it shares."""
    @functools.wraps(command)
    def within_a_polite_stop(*args, **kwargs):
        with polite_stop():
            return command(*args, **kwargs)
    return within_a_polite_stop
