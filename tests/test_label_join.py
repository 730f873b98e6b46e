"""The label join's bounds and bookkeeping (``mepo_stream.label_join``): every image ends joined, waiting or
expired, every label joined, waiting or refused with a reason, and neither store passes its bound."""

from __future__ import annotations

import random

from mepo_stream.label_join import JoinConfig, Joined, LabelJoin, Refused


def test_labels_delayed_by_50_to_200_records_join_every_image_and_score_the_arrival_prediction():
    rng, join, joined = random.Random(0), LabelJoin(JoinConfig(max_images=300)), []
    due: list[tuple[int, str, int]] = []  # (record at which the label comes, id, label)
    for t in range(1000):
        label = t % 7
        assert join.add_image(f"i{t}", f"feature-{t}", prediction=label if t % 2 else None, now=float(t)) is None
        due.append((t + rng.randint(50, 200), f"i{t}", label))
        for at, id, y in [d for d in due if d[0] == t]:
            joined.append(join.add_label(id, y, now=float(t)))
        due = [d for d in due if d[0] > t]
    for _, id, y in due:
        joined.append(join.add_label(id, y, now=2000.0))
    assert all(isinstance(j, Joined) for j in joined) and len(joined) == 1000
    assert sorted(j.item for j in joined) == sorted(f"feature-{t}" for t in range(1000))
    assert join.delayed_accuracy == 1.0 and join.scored == 500  # half the images came with a prediction
    assert 50 <= join.delay_quantile(0.5) <= 200 and join.delay_quantile(0.99) <= 200 + 1000
    assert join.counts() == {"joined": 1000, "waiting_images": 0, "waiting_labels": 0, "expired_images": 0,
                             "refused_labels": 0, "images": 1000}


def test_the_stores_stay_bounded_and_what_leaves_them_is_counted_with_a_reason():
    join = LabelJoin(JoinConfig(max_images=10, image_ttl_s=100, max_labels=5, label_ttl_s=50))
    for t in range(30):  # 30 images, no label: the store never holds more than 10
        join.add_image(f"i{t}", t, prediction=None, now=float(t))
        assert len(join.images) <= 10
    for t in range(8):  # 8 labels for images that never come: at most 5 wait
        assert join.add_label(f"x{t}", 1, now=float(t)) is None
        assert len(join.labels) <= 5
    expired, refused = join.expire(now=40.0)
    assert expired == [f"i{t}" for t in range(20)]  # evicted by the bound, oldest first
    assert [r.id for r in refused] == ["x0", "x1", "x2"] and {r.reason for r in refused} == {"unknown_id"}
    expired, refused = join.expire(now=200.0)  # past both TTLs
    assert expired == [f"i{t}" for t in range(20, 30)] and [r.id for r in refused] == [f"x{t}" for t in range(3, 8)]
    counts = join.counts()
    assert counts["images"] == counts["joined"] + counts["waiting_images"] + counts["expired_images"] == 30
    assert counts["refused_labels"] == 8


def test_duplicates_are_refused_and_an_expired_image_is_never_learned():
    join = LabelJoin(JoinConfig(image_ttl_s=10))
    join.add_image("a", "fa", prediction=1, now=0.0)
    assert isinstance(join.add_image("a", "fa", prediction=1, now=1.0), Refused)
    assert join.add_label("a", 2, now=2.0).prediction == 1 and join.delayed_accuracy == 0.0
    assert join.add_label("a", 2, now=3.0).reason == "duplicate_label"
    join.add_label("b", 0, now=3.0)
    assert join.add_label("b", 0, now=4.0).reason == "duplicate_label"  # while the first still waits
    join.add_image("c", "fc", prediction=None, now=3.0)
    assert join.expire(now=20.0)[0] == ["c"]
    assert join.add_label("c", 0, now=21.0) is None  # its image is gone: the label waits, then is refused
    assert [r.reason for r in join.expire(now=1000.0)[1]] == ["unknown_id", "unknown_id"]
