"""The pass-rate curriculum: solved tasks are skipped, the Gaussian schedule aims at a
difficulty, the order is a function of the seed and the rates, and resume is exact."""

import pytest

from ptrain.envs.base import Task
from ptrain.envs.curriculum import Curriculum


class Cycle:
    """A task source over tasks 0..n-1 in order (the mixture's interface)."""

    def __init__(self, n):
        self.n, self.i = n, 0

    def next_task(self):
        t = Task(env="e", id=str(self.i % self.n), messages=())
        self.i += 1
        return None, t

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def ids(cur, k):
    return [cur.next_task()[1].id for _ in range(k)]


def test_solved_tasks_are_skipped_and_unseen_ones_taken():
    cur = Curriculum(Cycle(4), drop_solved=True)
    assert ids(cur, 4) == ["0", "1", "2", "3"]
    cur.record(Task(env="e", id="1", messages=()), 1.0)
    cur.record(Task(env="e", id="2", messages=()), 0.5)
    assert ids(cur, 3) == ["0", "2", "3"] and cur.stats["skipped_solved"] == 1


def test_the_gaussian_schedule_prefers_tasks_near_the_target():
    cur = Curriculum(Cycle(2), target=0.5, width=0.1, seed=3)
    cur.record(Task(env="e", id="0", messages=()), 0.5)  # weight 1
    cur.record(Task(env="e", id="1", messages=()), 1.0)  # weight exp(-12.5)
    got = ids(cur, 50)
    assert got.count("0") == 50 and cur.stats["skipped_schedule"] >= 49


def test_resume_continues_the_same_order():
    a = Curriculum(Cycle(5), target=0.4, width=0.3, seed=1)
    for i in range(5):
        a.record(Task(env="e", id=str(i), messages=()), i / 4)
    ids(a, 7)
    state = a.get_state()
    b = Curriculum(Cycle(5), target=0.4, width=0.3, seed=1)
    b.set_state(state)
    assert ids(a, 20) == ids(b, 20)


def test_bad_settings_are_refused_and_selection_never_stalls():
    with pytest.raises(ValueError, match="target"):
        Curriculum(Cycle(1), target=2.0)
    cur = Curriculum(Cycle(1), drop_solved=True, max_tries=3)
    cur.record(Task(env="e", id="0", messages=()), 1.0)
    assert cur.next_task()[1].id == "0"  # every task solved: taken after max_tries refusals


def test_a_moving_target_shifts_selection_from_easy_to_hard_tasks():
    cur = Curriculum(Cycle(2), target=0.9, target_end=0.1, schedule_draws=400, width=0.15, seed=5)
    cur.record(Task(env="e", id="0", messages=()), 0.9)  # easy
    cur.record(Task(env="e", id="1", messages=()), 0.1)  # hard
    assert cur.current_target() == pytest.approx(0.9)
    early = ids(cur, 40)
    while cur.draws < 400:
        cur.next_task()
    assert cur.current_target() == pytest.approx(0.1)
    late = ids(cur, 40)
    assert early.count("0") >= 35 and late.count("1") >= 35
    with pytest.raises(ValueError, match="schedule_draws"):
        Curriculum(Cycle(2), target=0.9, target_end=0.1)
    with pytest.raises(ValueError, match="target_end"):
        Curriculum(Cycle(2), target=0.9, target_end=1.5, schedule_draws=10)
