"""The label join's bounds and bookkeeping (``mepo_stream.label_join``): every image ends joined, waiting or
expired, every label joined, waiting or refused with a reason, neither store passes its bound, and a join in flight
(joined, not learned) is checkpointed and rolled back as it was before the record that completed it."""

from __future__ import annotations

import random

import torch

from mepo_stream.checkpoint import load_checkpoint, save_checkpoint
from mepo_stream.label_join import JoinConfig, Joined, LabelJoin, Refused


def item(t: int) -> torch.Tensor:
    return torch.full((3,), float(t))


def test_labels_delayed_by_50_to_200_records_join_every_image_and_score_the_arrival_prediction():
    rng, join, joined = random.Random(0), LabelJoin(JoinConfig(max_images=300)), []
    due: list[tuple[int, str, int]] = []  # (record at which the label comes, id, label)
    for t in range(1000):
        label = t % 7
        assert join.add_image(f"i{t}", item(t), prediction=label if t % 2 else None, now=float(t)) is None
        due.append((t + rng.randint(50, 200), f"i{t}", label))
        for _, id, y in [d for d in due if d[0] == t]:
            joined.append(join.add_label(id, y, now=float(t)))
        due = [d for d in due if d[0] > t]
    for _, id, y in due:
        joined.append(join.add_label(id, y, now=2000.0))
    assert all(isinstance(j, Joined) for j in joined) and len(joined) == 1000
    assert join.counts()["in_flight"] == 1000 and join.delayed_accuracy is None  # nothing counts before learning
    join.confirm(joined)
    assert sorted(int(j.item[0]) for j in joined) == list(range(1000))
    assert join.delayed_accuracy == 1.0 and join.scored == 500  # half the images came with a prediction
    assert 50 <= join.delay_quantile(0.5) <= 200 and join.delay_quantile(0.99) <= 200 + 1000
    assert join.counts() == {"images": 1000, "joined": 1000, "in_flight": 0, "waiting_images": 0,
                             "waiting_labels": 0, "expired_images": 0, "refused_labels": 0, "deleted_images": 0}


def test_the_stores_stay_bounded_and_what_leaves_them_is_counted_with_a_reason():
    join = LabelJoin(JoinConfig(max_images=10, image_ttl_s=100, max_labels=5, label_ttl_s=50))
    for t in range(30):  # 30 images, no label: the store never holds more than 10
        join.add_image(f"i{t}", item(t), prediction=None, now=float(t))
        assert len(join.images) <= 10
    for t in range(8):  # 8 labels for images that never come: at most 5 wait
        assert join.add_label(f"x{t}", 1, now=float(t), source=("labels", 0, t)) is None
        assert len(join.labels) <= 5
    expired, refused = join.expire(now=40.0)
    assert expired == [f"i{t}" for t in range(20)]  # evicted by the bound, oldest first
    assert [r.id for r in refused] == ["x0", "x1", "x2"] and {r.reason for r in refused} == {"unknown_id"}
    assert [r.source for r in refused] == [("labels", 0, t) for t in range(3)]  # for their dead letters
    expired, refused = join.expire(now=200.0)  # past both TTLs
    assert expired == [f"i{t}" for t in range(20, 30)] and [r.id for r in refused] == [f"x{t}" for t in range(3, 8)]
    counts = join.counts()
    assert counts["images"] == counts["joined"] + counts["waiting_images"] + counts["expired_images"] == 30
    assert counts["refused_labels"] == 8


def test_duplicates_are_refused_and_an_expired_image_is_never_learned():
    join = LabelJoin(JoinConfig(image_ttl_s=10))
    join.add_image("a", item(0), prediction=1, now=0.0)
    assert isinstance(join.add_image("a", item(0), prediction=1, now=1.0), Refused)
    joined = join.add_label("a", 2, now=2.0)
    assert join.add_label("a", 2, now=2.5).reason == "duplicate_label"  # while the first is in flight
    join.confirm([joined])
    assert joined.prediction == 1 and join.delayed_accuracy == 0.0
    assert join.add_label("a", 2, now=3.0).reason == "duplicate_label"
    assert join.add_image("a", item(0), prediction=1, now=3.0).reason == "duplicate_id"  # after it was learned
    join.add_label("b", 0, now=3.0)
    assert join.add_label("b", 0, now=4.0).reason == "duplicate_label"  # while the first still waits
    join.add_image("c", item(2), prediction=None, now=3.0)
    assert join.expire(now=20.0)[0] == ["c"]
    assert join.add_label("c", 0, now=21.0) is None  # its image is gone: the label waits, then is refused
    assert [r.reason for r in join.expire(now=1000.0)[1]] == ["unknown_id", "unknown_id"]


def test_a_join_in_flight_is_checkpointed_and_rolled_back_as_before_the_record_that_completed_it(tmp_path):
    """A crash or a reconnect before the join is learned reads its completing record again: the state must hold the
    first half waiting, so that record joins again, once (else the label would be refused as a duplicate and lost,
    or the image learned twice)."""
    join = LabelJoin()
    join.add_image("img-first", item(1), prediction=4, now=1.0)
    join.add_label("label-first", 5, now=2.0, source=("labels", 0, 7))
    by_label = join.add_label("img-first", 4, now=3.0)  # completed by the label record
    by_image = join.add_image("label-first", item(2), prediction=None, now=4.0)  # completed by the image record
    assert by_label.completed_by == "label" and by_image.completed_by == "image"

    save_checkpoint(tmp_path / "join.pt", {"join": join.state_dict()})
    restored = LabelJoin()
    restored.load_state_dict(load_checkpoint(tmp_path / "join.pt")["join"])
    join.rollback()
    for state in (restored, join):  # both ways back give the same: the first halves waiting, nothing joined
        assert list(state.images) == ["img-first"] and list(state.labels) == ["label-first"]
        assert state.counts()["joined"] == 0 and state.counts()["in_flight"] == 0
        again = state.add_label("img-first", 4, now=3.0)
        assert again.delay_s == 2.0 and again.prediction == 4 and torch.equal(again.item, item(1))
        again = state.add_image("label-first", item(2), prediction=None, now=4.0)
        assert again.label == 5 and again.source == ("labels", 0, 7)
        state.confirm([state.in_flight["img-first"], state.in_flight["label-first"]])
        assert state.counts() == {"images": 2, "joined": 2, "in_flight": 0, "waiting_images": 0,
                                  "waiting_labels": 0, "expired_images": 0, "refused_labels": 0, "deleted_images": 0}


def test_a_confirmed_join_survives_a_checkpoint_with_its_counts_and_id():
    join = LabelJoin()
    join.add_image("a", item(1), prediction=2, now=0.0)
    join.confirm([join.add_label("a", 2, now=10.0)])
    join.add_image("b", item(2), prediction=0, now=11.0)
    restored = LabelJoin()
    restored.load_state_dict(join.state_dict())
    assert restored.counts() == join.counts() and restored.delayed_accuracy == 1.0
    assert restored.delay_quantile(0.5) == 10.0 and torch.equal(restored.images["b"].item, item(2))
    assert restored.add_label("a", 2, now=12.0).reason == "duplicate_label"
