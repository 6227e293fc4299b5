"""The exactly-once oracle of the test worker (tests/helpers/elastic_worker.py): its counter
keeps only the epoch being trained as a parameter, and a summary of each finished one. On
every history it can hold, it must read what the whole counts matrix would say, and it must
also see the faults a summary could hide (an epoch finished twice, or never)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.elastic_worker import Counter, Tally


def train(counter: Counter, samples: list[int]) -> None:
    """One step over ``samples`` as the worker takes it (world of one): SGD with lr 1 on
    the summed count adds 1 to each."""
    opt = torch.optim.SGD(counter.parameters(), lr=1.0)
    opt.zero_grad()
    (-counter(torch.tensor(samples, dtype=torch.int64)).sum()).backward()
    opt.step()


@pytest.mark.parametrize("seed", range(40))
def test_the_counter_reads_as_the_whole_counts_matrix_would(seed: int) -> None:
    rng = random.Random(seed)
    epochs, n = rng.randint(1, 6), rng.randint(1, 30)
    counter, matrix = Counter(epochs, n), torch.zeros(epochs, n, dtype=torch.float64)
    trained = rng.randint(0, epochs)
    for e in range(min(trained + 1, epochs)):
        # each sample once, mostly; now and then missed or counted twice; the epoch after
        # the last trained one only part-trained (or not at all)
        times = {i: rng.choices([1, 0, 2], [90, 5, 5])[0] for i in range(n)}
        if e == trained:
            times = {i: rng.choice([0, 0, 1]) for i in range(n)}
        order = [i for i, k in times.items() for _ in range(k)]
        rng.shuffle(order)
        for b in range(0, len(order), 4):
            batch = order[b:b + 4]
            if len(set(batch)) < len(batch):  # a repeat in one batch: in two steps instead
                for i in batch:
                    train(counter, [i])
            else:
                train(counter, batch)
        for i, k in times.items():
            matrix[e, i] += k
        if e < trained:
            counter.finish_epoch(e)
    assert counter.tally(trained) == Tally.of_matrix(matrix, trained)


def exact_run(epochs: int, n: int, trained: int) -> Counter:
    counter = Counter(epochs, n)
    for e in range(trained):
        train(counter, list(range(n)))
        counter.finish_epoch(e)
    return counter


def test_an_exact_run_is_exact_and_a_step_costs_one_row() -> None:
    counter = exact_run(5, 12, 3)
    tally = counter.tally(3)
    assert not any(tally.wrong) and tally.total == 36 and tally.low == tally.high == 1.0
    assert counter.counts.shape == (12,)  # gradients reach one epoch's row, whatever `epochs`
    # everything the oracle reads is state: committed, restored and synced with the model
    assert set(counter.state_dict()) == {"counts", "finished", "row_epoch", "misfiled"}


def test_an_epoch_finished_twice_is_wrong() -> None:
    counter = exact_run(4, 6, 2)
    counter.finish_epoch(1)  # e.g. the summaries restored from an older commit than the row
    assert counter.tally(2).wrong[1] and int(counter.misfiled) == 1


def test_an_epoch_never_finished_is_wrong() -> None:
    counter = exact_run(4, 6, 2)
    assert counter.tally(3).wrong[2]  # the job says 3 epochs, the counter finished 2


def test_counts_left_in_the_row_at_the_end_are_wrong() -> None:
    counter = exact_run(4, 6, 2)
    train(counter, [3])
    assert counter.tally(2).wrong == [0, 0, 1, 0]


def test_a_summary_of_an_epoch_not_trained_is_wrong() -> None:
    counter = exact_run(4, 6, 3)
    assert counter.tally(2).wrong[2]  # finished, yet the job says it never trained
