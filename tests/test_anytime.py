import math

import pytest
import torch

from mepo_stream.anytime import (
    AnytimeCurve,
    AnytimeEvaluation,
    EncodedTestSet,
    ProtocolConfig,
    evaluate_seen,
    per_class_accuracy,
)
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.probe import ProbeConfig
from mepo_stream.records import RecordMeta
from mepo_stream.sampler import si_blurry_stream
from offline.evaluate import evaluate
from server.config import ServeConfig
from server.learner.book import Sample
from server.learner.state import open_learner
from server.metrics import ServerMetrics
from tests.helpers import RUNNING, TINY, learner_of


def test_definitions_against_hand_computed_case():
    curve = AnytimeCurve()
    for samples, acc in [(1000, 0.30), (2000, 0.50), (3000, 0.40)]:
        curve.add_anytime(samples, acc)
    curve.add_end_of_task(0.8, {0: 0.9, 1: 0.7})
    curve.add_end_of_task(0.6, {0: 0.5, 1: 0.8, 2: 0.5})
    curve.add_end_of_task(0.5, {0: 0.6, 1: 0.4, 2: 0.5, 3: 0.0})
    assert math.isclose(curve.a_auc, 0.4)           # mean of the any-time accuracies only
    assert curve.a_last == 0.5                      # the last end-of-task accuracy
    assert math.isclose(curve.a_avg, (0.8 + 0.6 + 0.5) / 3)
    # F_last over classes with best earlier acc > 0: class 0: 0.9-0.6, class 1: 0.8-0.4, class 2: 0.5-0.5;
    # class 3 was never evaluated before, so it does not count
    assert math.isclose(curve.f_last, (0.3 + 0.4 + 0.0) / 3)


def test_empty_curve_is_nan_not_an_error():
    curve = AnytimeCurve()
    assert math.isnan(curve.a_auc) and math.isnan(curve.a_last) and curve.f_last == 0.0


def test_per_class_accuracy_is_keyed_by_class():
    pred, target = torch.tensor([0, 1, 1, 2, 2, 2]), torch.tensor([0, 1, 0, 2, 2, 1])
    assert per_class_accuracy(pred, target) == {0: 0.5, 1: 0.5, 2: 1.0}


def test_round_trip_through_dict():
    curve = AnytimeCurve()
    curve.add_anytime(10, 0.5)
    curve.add_end_of_task(0.5, {1: 0.5})
    d = curve.to_dict()
    fields = ("samples", "accuracy", "task_accuracy", "task_class_accuracy")
    assert d["A_auc"] == 0.5 and AnytimeCurve(**{k: d[k] for k in fields}) == curve


def _learner(method: str, cfg: LearnerConfig) -> OnlineLearner:
    return learner_of(method, cfg)


def _test_set(n: int = 40) -> ImageSet:
    g = torch.Generator().manual_seed(0)
    return ImageSet(torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g),
                    torch.arange(n) % 4, list("abcd"), list("abcd"))


def _fresh_accuracy(learner: OnlineLearner, test: ImageSet, batch_size: int) -> float:
    keep = torch.isin(test.targets, torch.tensor(learner.exposed)).nonzero().squeeze(1)
    pred = torch.cat([learner.predict(test.images[c])["running"] for c in keep.split(batch_size)])
    return (pred == test.targets[keep]).float().mean().item()


@pytest.mark.parametrize("method,cfg", [
    ("frozen", LearnerConfig(autoaugment=None)),
    ("misa", LearnerConfig(autoaugment=None, classifier="linear", online_iter=1)),
])
def test_evaluation_equals_a_fresh_forward_and_encodes_a_fixed_encoder_once(method, cfg):
    learner, test = _learner(method, cfg), _test_set()
    encodings, n_encoded = EncodedTestSet(test, batch_size=16), 0
    for labels in (torch.tensor([0, 1] * 4), torch.tensor([2, 3] * 4), torch.tensor([0, 3] * 4)):
        learner.observe(_test_set(8).images, labels)
        calls, encode = [], learner.encode
        learner.encode = lambda images, calls=calls, encode=encode: calls.append(len(images)) or encode(images)
        acc, _ = evaluate_seen(learner, encodings)["running"]
        del learner.encode
        n_encoded += sum(calls)
        assert math.isclose(acc, _fresh_accuracy(learner, test, 16), abs_tol=1e-6)
    if learner.encoder_trains:  # prompts moved: every evaluation encodes afresh
        assert method == "misa" and n_encoded > len(test)
    else:
        assert n_encoded == len(test)  # each test image encoded once over three evaluations


def test_evaluations_run_exactly_at_their_scheduled_positions_and_round_trip():
    learner, test = _learner("frozen", LearnerConfig(autoaugment=None)), _test_set()
    run = AnytimeEvaluation(test, eval_period=50, batch_size=16)
    sizes, positions = [], []
    for batch in run.batches(learner, list(range(160)), batch_size=32):  # batches cut at 50, 100, 150
        learner.observe(_test_set(len(batch)).images, torch.arange(len(batch)) % 4)
        sizes.append(len(batch))
        if run.after_batch(learner) is not None:
            positions.append(learner.samples_seen)
    assert sizes == [32, 18, 32, 18, 32, 18, 10] and positions == [50, 100, 150]
    assert run.curves["running"].samples == [50, 100, 150]
    run.end_of_task(learner)
    again = AnytimeEvaluation(test, eval_period=50, batch_size=16)
    again.load_state_dict(run.state_dict())
    assert again.next_eval == 200 and again.curves == run.curves and again.room(learner, 32) == 32


def test_no_schedule_without_a_period():
    learner = _learner("frozen", LearnerConfig(autoaugment=None))
    run = AnytimeEvaluation(_test_set(), eval_period=0)
    assert run.room(learner, 32) == 32
    learner.observe(_test_set(32).images, torch.arange(32) % 4)
    assert run.after_batch(learner) is None and run.curves["running"].samples == []


def test_service_and_evaluate_report_the_same_anytime_accuracy(tmp_path):
    """The server's A_AUC is `mepo evaluate`'s on the same stream: one schedule, one scoring, one curve."""
    # images decoded at the size the service decodes its records and its held-out images at: the model's
    data, period = DataConfig(dataset="cifar10", train_per_class=12, test_per_class=4,
                              load_size=ServeConfig.limits.at(TINY.img_size).size), 30
    result = evaluate(out=tmp_path / "ev", seed="1", method="frozen", data=data, backbone=TINY,
                      protocol=ProtocolConfig(eval_period=period), probe=ProbeConfig(epochs=1))
    offline = result["runs"][0]["curves"]["batch"]  # without Meta Cov both modes are one model; evaluate keeps one
    cfg = ServeConfig(data=data, backbone=TINY, protocol=ProtocolConfig(eval_period=period),
                      checkpoint_dir=tmp_path / "ckpt")
    state, train = open_learner(cfg, ServerMetrics()), load_split(data, "train")
    for task in si_blurry_stream(train.targets.tolist(), seed=1).tasks:  # evaluate's batches: never across tasks
        while task:  # the service's rule: at most batch_limit samples, so a batch ends at each scheduled evaluation
            batch, task = task[: state.batch_limit], task[state.batch_limit :]
            state.model_thread.run(state.learn, [Sample(train.images[i], RecordMeta(int(train.targets[i]), i, i, "s"))
                                                 for i in batch])
    served = state.reporter.status(RUNNING).anytime_accuracy.model_dump()
    assert served["samples"] == offline["samples"] == list(range(period, len(train) + 1, period))
    assert served["accuracy"] == pytest.approx(offline["accuracy"], abs=1e-6)
    assert served["a_auc"] == pytest.approx(offline["A_auc"], abs=1e-6)
