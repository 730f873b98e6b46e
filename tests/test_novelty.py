"""Novelty scores ("not seen yet", issue 67): what they tell, and that they are made of the sums alone."""

import math
import threading

import pytest
import torch
from helpers import learner_of

import mepo_stream.learner as learner_module
from mepo_stream.anytime import AnytimeCurve
from mepo_stream.heads import StreamingLDA
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods.base import Encoded
from mepo_stream.novelty import (
    DEFAULT_SCORE,
    NOVELTY_SCORES,
    NoveltyThreshold,
    auroc,
    distance_score,
    novelty_scores,
    prepare,
    resolve,
)

DIM, CLASSES = 8, 4
STATISTICS_SCORES = [s for s in NOVELTY_SCORES if s not in ("energy", "max_softmax")]


def _clusters(n: int, classes: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points per class, each class a Gaussian around its own centre (centres fixed by class)."""
    centres = torch.randn(CLASSES + 2, DIM, generator=torch.Generator().manual_seed(123)) * 4  # [C + 2, D]
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes).repeat_interleave(n)  # [N]
    return centres[y] + torch.randn(len(y), DIM, generator=g), y


def _lda(x: torch.Tensor, y: torch.Tensor) -> StreamingLDA:
    lda = StreamingLDA(DIM, CLASSES, shrinkage=(0.1,))
    lda.update(x, y)
    return lda


def _scores(lda: StreamingLDA, x: torch.Tensor, score: str) -> torch.Tensor:
    return novelty_scores(lda, x, lda(x), score)  # type: ignore[arg-type]


@pytest.mark.parametrize("score", NOVELTY_SCORES)
def test_a_cluster_never_learned_scores_above_the_learned_ones(score):
    lda = _lda(*_clusters(60, [0, 1, 2]))
    learned, _ = _clusters(40, [0, 1, 2], seed=1)  # held-out images of the learned classes
    new, _ = _clusters(40, [4], seed=1)  # a class never learned
    scores = _scores(lda, torch.cat([learned, new]), score)
    positive = torch.cat([torch.zeros(len(learned)), torch.ones(len(new))]).bool()
    if score in STATISTICS_SCORES:
        assert auroc(scores, positive) > 0.95
    else:  # the logits alone tell less: far from every class, one class's softmax still saturates
        assert auroc(scores, positive) >= 0.5


@pytest.mark.parametrize("score", STATISTICS_SCORES)
def test_the_sums_of_two_halves_score_as_one_learner_with_all(score):
    x, y = _clusters(30, [0, 1, 2])
    whole, a, b = _lda(x, y), _lda(x[::2], y[::2]), _lda(x[1::2], y[1::2])
    group = StreamingLDA(DIM, CLASSES, shrinkage=(0.1,))
    group.assign(a.counts + b.counts, a.sums + b.sums, a.second + b.second, a.hits + b.hits)
    probe, _ = _clusters(10, [0, 3, 4], seed=2)
    torch.testing.assert_close(_scores(group, probe, score), _scores(whole, probe, score), rtol=1e-5, atol=1e-4)


def test_the_factorisations_are_cached_until_the_sums_change():
    x, y = _clusters(20, [0, 1])
    lda, probe = _lda(x, y), _clusters(5, [2], seed=3)[0]
    prepare(lda, DEFAULT_SCORE)
    before = _scores(lda, probe, DEFAULT_SCORE)
    lda.update(*_clusters(20, [2], seed=4))  # class 2 learned: its images are no longer new
    assert bool((_scores(lda, probe, DEFAULT_SCORE) < before).all())


def test_a_sample_taken_out_scores_as_if_never_learned():
    cfg = LearnerConfig(autoaugment=None)
    kept, taken = learner_of("frozen", cfg), learner_of("frozen", cfg)
    width = kept.method.classifier.sums.shape[1]
    features = torch.randn(24, width, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([3, 5] * 12)
    kept.observe_features(features[:16], labels[:16])
    taken.observe_features(features, labels)
    taken.forget_features(features[16:], labels[16:])
    probe = Encoded(torch.randn(6, width, generator=torch.Generator().manual_seed(1)), torch.zeros(()))
    torch.testing.assert_close(taken.novelty(probe), kept.novelty(probe), rtol=1e-4, atol=1e-3)


def test_before_any_class_every_image_is_new_and_a_linear_head_answers_with_its_logits():
    learner = learner_of("frozen", LearnerConfig(autoaugment=None))
    probe = Encoded(torch.randn(3, learner.method.classifier.sums.shape[1]), torch.zeros(()))
    assert bool(torch.isinf(learner.novelty(probe)).all())
    assert resolve(None, "relative_mahalanobis") == "energy" and resolve(None, "max_softmax") == "max_softmax"
    with pytest.raises(ValueError, match="unknown novelty score"):
        learner.novelty(probe, "softmax")


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_a_target_false_alarm_rate_outside_zero_one_is_refused(target):
    with pytest.raises(ValueError, match="false-alarm rate must be in"):
        NoveltyThreshold(false_alarm=target)


def test_the_threshold_reaches_its_target_and_follows_a_drifting_stream():
    """In-distribution scores drift upwards halfway: the threshold follows them (half-life), a cumulative one
    lags, and true novelties (far above) are flagged."""
    g = torch.Generator().manual_seed(0)
    following, cumulative = NoveltyThreshold(0.05, half_life=500), NoveltyThreshold(0.05, half_life=None)
    for start in range(0, 8000, 32):
        scores = torch.randn(32, generator=g) * 3 + 50 + (20 if start >= 4000 else 0)  # [32]
        known = torch.ones(32, dtype=torch.bool)
        known[0] = False
        scores[0] += 60  # a new class's image
        for t in (following, cumulative):
            t.observe(scores, known, start)
    fresh = torch.randn(20000, generator=g) * 3 + 70  # new images of learned classes, at the stream's end
    assert abs(float(following.flag(fresh).float().mean()) - 0.05) < 0.01
    assert abs(float(cumulative.flag(fresh).float().mean()) - 0.05) > 0.03
    assert following.detection() > 0.9


def test_a_groups_thresholds_add_up_to_one_learners():
    g = torch.Generator().manual_seed(1)
    scores, known = torch.randn(3000, generator=g) * 5 + 100, torch.rand(3000, generator=g) > 0.1
    positions = torch.arange(3000)
    one, a, b = (NoveltyThreshold(0.05, half_life=400) for _ in range(3))
    one.observe(scores, known, positions)
    odd = positions % 2 == 1  # each member its partitions' images, at their stream positions
    a.observe(scores[odd], known[odd], positions[odd])
    b.observe(scores[~odd], known[~odd], positions[~odd])
    merged = NoveltyThreshold.merged([a, b])
    assert merged.threshold == pytest.approx(one.threshold, rel=1e-9)
    torch.testing.assert_close(merged.known / merged.known.sum(), one.known / one.known.sum())
    again = NoveltyThreshold(0.05, half_life=400)
    again.load_state_dict(merged.state_dict())
    assert again.threshold == merged.threshold


def test_the_learner_scores_each_batch_before_learning_it_and_keeps_the_threshold_in_its_state():
    cfg = LearnerConfig(autoaugment=None)
    learner = learner_of("frozen", cfg)
    learner.novelty_threshold = NoveltyThreshold(0.1, min_known=1)
    g = torch.Generator().manual_seed(0)
    width = learner.method.classifier.sums.shape[1]
    centres = torch.randn(4, width, generator=g) * 3
    for step in range(6):
        y = torch.tensor([step % 2] * 16 if step < 5 else [2] * 16)
        learner.observe_features(centres[y] + torch.randn(16, width, generator=g), y)
    state = learner.state_dict()  # the batches waiting for the calibration are scored first
    # scored by the model frozen after class 0 (``CALIBRATE_EVERY``): its class-0 batches are the known ones
    assert float(learner.novelty_threshold.count) == 16 * 2
    assert float(learner.novelty_threshold.novel.sum()) > 0  # classes 1 and 2 were new to the frozen model
    other = learner_of("frozen", cfg)
    other.novelty_threshold = NoveltyThreshold(0.1, min_known=1)
    other.load_state_dict(state)
    assert other.novelty_threshold.threshold == learner.novelty_threshold.threshold


def test_the_calibration_scores_with_the_model_frozen_for_calibrate_every_samples(monkeypatch):
    """The batches a frozen score waits with are scored as the model stood when it was frozen, and a score is
    frozen anew every ``CALIBRATE_EVERY`` samples: the threshold gets what a threshold fed at those moments gets."""
    monkeypatch.setattr(learner_module, "CALIBRATE_EVERY", 32)
    learner = learner_of("frozen", LearnerConfig(autoaugment=None))
    g = torch.Generator().manual_seed(4)
    width = learner.method.classifier.sums.shape[1]
    probe, labels = Encoded(torch.randn(16, width, generator=g), torch.zeros(())), torch.zeros(16, dtype=torch.long)
    fed, expected = (NoveltyThreshold(0.05, half_life=None, min_known=1) for _ in range(2))
    learner.observe_features(torch.randn(16, width, generator=g), labels)
    first = learner.novelty(probe)  # the model of class 0
    learner.observe_novelty(probe, labels, 0, fed)  # frozen now
    learner.observe_features(torch.randn(16, width, generator=g) + 3, labels + 1)
    learner.observe_novelty(probe, labels, 16, fed)  # 16 scored: still frozen, though the model moved on
    later = learner.novelty(probe)
    assert not torch.allclose(later, first)
    learner.observe_novelty(probe, labels, 32, fed)  # 32 scored: the two waiting are fed, and frozen anew
    learner.flush_novelty()
    known = torch.ones(16, dtype=torch.bool)
    for scores, position in ((first, 0), (first, 16), (later, 32)):
        expected.observe(scores, known, position)
    torch.testing.assert_close(fed.known, expected.known)
    assert float(fed.count) == 48


@pytest.mark.parametrize("score", ["stream_mahalanobis", "max_softmax"])  # waits for a frozen score; a logit score
def test_the_thread_that_feeds_a_threshold_computes_it_so_readers_elsewhere_only_read(monkeypatch, score):
    """A status read on another thread, under the learner's lock, once computed the threshold and its detection rate
    after every change, holding the model thread up; the thread that feeds it computes them as it does."""
    learner = learner_of("frozen", LearnerConfig(autoaugment=None))
    learner.novelty_score = score
    learner.novelty_threshold = threshold = NoveltyThreshold(0.05, half_life=None, min_known=1)
    g = torch.Generator().manual_seed(5)
    width = learner.method.classifier.sums.shape[1]
    labels = torch.zeros(16, dtype=torch.long)
    learner.observe_features(torch.randn(16, width, generator=g), labels)
    learner.observe_features(torch.randn(16, width, generator=g), labels)
    learner.flush_novelty()
    computed = []
    monkeypatch.setattr(NoveltyThreshold, "detection", lambda self: computed.append("detection"))
    monkeypatch.setattr(NoveltyThreshold, "_quantile", lambda self: computed.append("threshold"))
    answer = []
    reader = threading.Thread(target=lambda: answer.append(threshold.threshold))
    reader.start()
    reader.join()
    assert computed == [] and math.isfinite(answer[0])


def test_auroc_counts_ties_half_and_is_undefined_without_both_kinds():
    scores, positive = torch.tensor([0.1, 0.4, 0.4, 0.9]), torch.tensor([False, False, True, True])
    pairs = [(p > n) + 0.5 * (p == n) for p in scores[positive] for n in scores[~positive]]
    assert auroc(scores, positive) == pytest.approx(float(sum(pairs)) / len(pairs))
    assert math.isnan(auroc(scores, torch.zeros(4, dtype=torch.bool)))


def test_the_curve_keeps_the_novelty_auroc_and_reads_curves_written_before_it():
    curve = AnytimeCurve()
    curve.add_anytime(10, 0.5, 0.8, measured=True)
    curve.add_anytime(20, 0.6, float("nan"), measured=True)  # every class learned: undefined
    assert curve.novelty_auroc == [0.8, None] and curve.novelty_auroc_mean == 0.8
    assert AnytimeCurve.from_dict(curve.to_dict()) == curve
    old = {k: v for k, v in curve.to_dict().items() if k != "novelty_auroc"}
    before = AnytimeCurve.from_dict(old)
    assert before.novelty_auroc == [] and math.isnan(before.novelty_auroc_mean)


def test_the_count_aware_distance_is_the_posterior_predictive_of_each_class():
    """A class learned from few images: its distance shrinks by ``1 + 1/n`` and pays ``D log(1 + 1/n)``."""
    x, y = _clusters(40, [0, 1])
    x, y = torch.cat([x, _clusters(3, [2])[0]]), torch.cat([y, torch.full((3,), 2)])  # class 2: three images
    lda, probe = _lda(x, y), _clusters(5, [0, 2, 4], seed=5)[0]
    plain, aware = distance_score(lda, probe, "none", False), distance_score(lda, probe, "none", True)
    means = lda.means()
    sigma_inv = torch.linalg.inv(_shrunk(lda))
    d = torch.stack([((probe.double() - means[k]) @ sigma_inv * (probe.double() - means[k])).sum(1)
                     for k in range(3)], 1)  # [B, 3]
    inflation = 1 + 1 / lda.counts[:3].double()
    torch.testing.assert_close(plain, d.amin(1))
    torch.testing.assert_close(aware, (d / inflation + DIM * torch.log(inflation)).amin(1))


def _shrunk(lda: StreamingLDA) -> torch.Tensor:
    lam = float(lda.shrinkage[lda.chosen])
    cov = lda.within_covariance()  # [D, D], shrunk towards its mean variance (floored as the LDA floors it)
    energy = lda.second.trace() / lda.counts.sum() / DIM
    scale = torch.maximum(cov.trace() / DIM, 1e-6 * energy)
    return (1 - lam) * cov + (lam + 1e-6) * scale * lda.target


def test_the_share_clock_weighs_the_newest_share_as_much_as_all_before_and_adds_up_in_a_group():
    g = torch.Generator().manual_seed(2)
    scores, known = torch.randn(4000, generator=g) * 5 + 100, torch.ones(4000, dtype=torch.bool)
    one = NoveltyThreshold(0.05, half_life=0.1, clock="share", bins=64)
    one.observe(torch.ones(3600), known[:3600], 0)  # the old 90% in one bin ...
    one.observe(torch.full((400,), 1000.0), known[:400], 3600)  # ... the newest 10% in another: about half
    assert float(one.known.max() / one.known.sum()) == pytest.approx(0.5, abs=0.01)
    whole, a, b = (NoveltyThreshold(0.05, half_life=0.1, clock="share") for _ in range(3))
    positions = torch.arange(4000)
    whole.observe(scores, known, positions)
    odd = positions % 2 == 1
    a.observe(scores[odd], known[odd], positions[odd])
    b.observe(scores[~odd], known[~odd], positions[~odd])
    merged = NoveltyThreshold.merged([a, b])
    assert merged.clock == "share" and merged.threshold == pytest.approx(whole.threshold, rel=1e-9)
    with pytest.raises(ValueError, match="clocks"):
        a.add_(NoveltyThreshold(0.05, half_life=0.1))


@pytest.mark.parametrize("half_life", [0.0, 0.5, 2.0])
def test_a_share_half_life_outside_zero_half_is_refused(half_life):
    with pytest.raises(ValueError, match="share of the samples seen"):
        NoveltyThreshold(0.05, half_life=half_life, clock="share")
