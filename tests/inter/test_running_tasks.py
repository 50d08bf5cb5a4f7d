"""RunningTasks (inter/data/round/context.py): where a failed round's threads hang."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from isthmus.inter.data.round.context import RunningTasks, current_frames


@pytest.fixture
def collections():
    """Every automatic collection that starts while the test runs, with the threshold
    at 1 so that any allocation of a tracked object starts one."""
    started: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(note)
    gc.set_threshold(1)
    try:
        yield started
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(note)


def test_the_frames_are_read_with_no_collection_under_the_thread_lock(collections):
    """CPython 3.11 builds sys._current_frames()'s dict under the lock of the thread
    states; a collection started there ran a gRPC finalizer that waited on a thread
    needing that lock, and the suite hung for good. The collector is off for the call."""
    sys._current_frames()
    assert collections, "the threshold of 1 should start a collection here"
    collections.clear()
    frames = current_frames()
    assert collections == []
    assert threading.get_ident() in frames
    assert gc.isenabled()


def test_where_names_each_running_task_and_its_frames():
    tasks = RunningTasks()
    inside, release = threading.Event(), threading.Event()

    def blocked_in_a_task() -> None:
        with tasks.track("_receive"):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=blocked_in_a_task)
    thread.start()
    try:
        assert inside.wait(10)
        (line,) = tasks.where()
        assert line.startswith("_receive") and "blocked_in_a_task" in line
    finally:
        release.set()
        thread.join()
    assert tasks.where() == []
