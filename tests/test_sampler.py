import pytest
import torch

from mepo_stream.sampler import si_blurry_stream


def targets(n_classes: int = 20, per_class: int = 25) -> list[int]:
    return [c for c in range(n_classes) for _ in range(per_class)]  # class-sorted, like an ImageFolder


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_every_sample_exactly_once(seed):
    y = targets()
    stream = si_blurry_stream(y, n_tasks=5, n=50, m=10, seed=seed)
    assert sorted(stream.order) == list(range(len(y)))
    assert stream.task_ends[-1] == len(y) and stream.order == [i for task in stream.tasks for i in task]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_disjoint_classes_never_leak(seed):
    y = targets()
    stream = si_blurry_stream(y, n_tasks=5, n=50, m=10, seed=seed)
    for t, task in enumerate(stream.tasks):
        classes_in_task = {y[i] for i in task}
        for other, disjoint in enumerate(stream.disjoint_classes):
            if other != t:
                assert not classes_in_task & set(disjoint)
        assert set(stream.disjoint_classes[t]) <= classes_in_task  # all their samples stay in their task
    n_disjoint = sum(len(d) for d in stream.disjoint_classes)
    assert n_disjoint == 10 and n_disjoint + sum(len(b) for b in stream.blurry_classes) == 20


def test_blurry_samples_move_across_tasks():
    y = targets(20, 50)
    stream = si_blurry_stream(y, n_tasks=5, n=50, m=10, seed=1)
    owner = {c: t for t, cs in enumerate(stream.blurry_classes) for c in cs}
    moved = sum(1 for t, task in enumerate(stream.tasks) for i in task if y[i] in owner and owner[y[i]] != t)
    assert 0 < moved <= 10 * 50 * 10 // 100  # at most M% of the blurry samples change task


def test_deterministic_and_seed_dependent():
    y = targets()
    assert si_blurry_stream(y, seed=3).order == si_blurry_stream(y, seed=3).order
    assert si_blurry_stream(y, seed=3).order != si_blurry_stream(y, seed=4).order


def test_draw_order_matches_reference_without_disjoint_or_blur():
    """n=0, m=0: the reference draws randperm(C), one set of blurry cut points, then one randperm per task."""
    y = targets(6, 3)
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(6, generator=g).tolist()
    cuts = [0, *torch.randint(0, 6, (1,), generator=g).sort().values.tolist(), 6]
    expected = []
    for t in range(2):
        idx = [i for i, c in enumerate(y) if c in order[cuts[t]:cuts[t + 1]]]
        expected.append([idx[j] for j in torch.randperm(len(idx), generator=g).tolist()])
    assert si_blurry_stream(y, n_tasks=2, n=0, m=0, seed=7).tasks == expected


def test_rejects_bad_percentages():
    with pytest.raises(ValueError, match="percentages"):
        si_blurry_stream([0, 1], n=150)
