"""CPU priority of bcp's background threads (``BCP_BACKGROUND_NICE``).

An async save's writers and commit, the local tier's replication and drains run in
threads of their own while training goes on. Where training itself runs on the host's
CPU and uses every core, their CPU time is taken from it; a higher nice value for
those threads (Linux: ``setpriority`` of the thread's id, which applies to that thread
alone) lets the scheduler give training the CPU first and the save the rest. The save
still runs whenever a core is free, so on a host whose cores wait for a device it
costs nothing. Staging copies that training waits for (``overlap=optimizer``) are not
lowered. docs/tiers.md ("Training stall") has the measurements.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

#: the environment variable: how much to add to the nice value of bcp's background threads
ENV = "BCP_BACKGROUND_NICE"
#: its default: measured to cut the training stall of a CPU-bound job several-fold while
#: its saves still finish between two saves (docs/tiers.md, "Training stall"); 0 turns it off
DEFAULT_NICE = 10


def background_nice() -> int:
    """The increment of ``BCP_BACKGROUND_NICE`` (0-19, default 10; an invalid value counts as the default)."""
    text = os.environ.get(ENV)
    if not text:
        return DEFAULT_NICE
    try:
        return max(0, min(19, int(text)))
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", ENV, text, DEFAULT_NICE)
        return DEFAULT_NICE


def lower_this_thread() -> None:
    """(in a background thread) Run this thread :func:`background_nice` steps behind the
    main thread (training). Idempotent: a thread started by an already lowered one (which
    inherits its nice value) is not lowered twice. A no-op where threads have no priority
    of their own (not Linux) or it cannot be set."""
    step = background_nice()
    if step <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    try:
        main = threading.main_thread().native_id
        base = os.getpriority(os.PRIO_PROCESS, main if main is not None else 0)
        target = min(19, base + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:  # a sandbox without the call: the thread keeps its priority
        log.debug("cannot lower the priority of thread %d: %s", tid, e)
