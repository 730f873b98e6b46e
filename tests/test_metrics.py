import math

import torch

from mepo_stream.metrics import AnytimeCurve, per_class_accuracy


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
