import numpy as np
import pytest
import torch

from mepo_stream.alignment import FeatureAlignment, align, batch_moments, cholesky, recolouring
from mepo_stream.class_means import ClassMeans, class_mean_covariance


def random_spd(dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    return a @ a.T / dim + 0.1 * torch.eye(dim, dtype=torch.float64)


def test_formula_is_the_reference_one():
    """out = (1-a) h + a * normalize((h - mean_B) @ inv(chol(C + eps)) @ chol(S + eps)), in float64 by hand."""
    h = torch.randn(32, 8, dtype=torch.float64) * 5 + 3
    sigma, eps, alpha = random_spd(8), 1e-4, 0.6
    hc = h - h.mean(0)
    c = hc.T @ hc / 31
    l_cur = torch.linalg.cholesky(c + eps * torch.eye(8, dtype=torch.float64))
    l_pre = torch.linalg.cholesky(sigma + eps * torch.eye(8, dtype=torch.float64))
    f = hc @ torch.linalg.inv(l_cur) @ l_pre
    expected = (1 - alpha) * h + alpha * f / f.norm(dim=1, keepdim=True)
    module = FeatureAlignment(sigma, alpha=alpha, eps=eps)
    assert torch.allclose(module(h.float(), "batch").double(), expected, atol=1e-4)


def test_runs_in_fp32_and_keeps_running_stats_in_fp64():
    module = FeatureAlignment(random_spd(4), alpha=0.5)
    out = module(torch.randn(6, 4, dtype=torch.float64), "batch")
    assert out.dtype == torch.float32
    assert module.l_pre.dtype == torch.float32 and module.running_second.dtype == torch.float64


def test_alpha_zero_is_identity_and_alpha_one_is_unit_norm():
    h = torch.randn(16, 4) * 10
    assert torch.equal(FeatureAlignment(random_spd(4), alpha=0.0)(h, "batch"), h)
    out = FeatureAlignment(random_spd(4), alpha=1.0)(h, "batch")
    assert torch.allclose(out.norm(dim=1), torch.ones(16), atol=1e-5)
    with pytest.raises(ValueError, match="alpha"):
        FeatureAlignment(random_spd(4), alpha=1.5)


def test_batch_of_one_is_guarded():
    """The reference divides by B-1 = 0 and propagates NaN; we skip alignment for B <= 1."""
    module = FeatureAlignment(random_spd(4), alpha=0.7).eval()
    h = torch.randn(1, 4)
    assert torch.equal(module(h, "batch"), h)
    assert torch.equal(module(h, "running"), h)  # no running statistics yet either


def test_rank_deficient_batch_is_finite():
    """B=8 << D=64: the batch covariance is singular; eps makes the Cholesky succeed."""
    out = FeatureAlignment(random_spd(64), alpha=0.7)(torch.randn(8, 64) * 20, "batch")
    assert torch.isfinite(out).all()


def test_gradients_flow_through_the_alignment():
    h = torch.randn(16, 8, requires_grad=True)
    FeatureAlignment(random_spd(8), alpha=0.7)(h, "batch").pow(2).sum().backward()
    assert torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0


def test_running_mode_is_not_transductive():
    module = FeatureAlignment(random_spd(8), alpha=0.7)
    for _ in range(20):
        module(torch.randn(32, 8) * 3 + 1, "batch")  # training batches feed the running statistics
    module.eval()
    x, others_a, others_b = torch.randn(1, 8), torch.randn(15, 8), torch.randn(15, 8) * 4
    run_a = module(torch.cat([x, others_a]), "running")[0]
    run_b = module(torch.cat([x, others_b]), "running")[0]
    assert torch.allclose(run_a, run_b)
    assert not torch.allclose(module(torch.cat([x, others_a]), "batch")[0],
                              module(torch.cat([x, others_b]), "batch")[0])


def test_running_statistics_converge_to_the_feature_covariance():
    module = FeatureAlignment(random_spd(4), alpha=0.5, momentum=0.05)
    true_cov = random_spd(4, seed=3)
    dist = torch.distributions.MultivariateNormal(torch.full((4,), 2.0, dtype=torch.float64), true_cov)
    for _ in range(400):
        module.update_running(dist.sample((64,)).float())
    cov = module.running_second - torch.outer(module.running_mean, module.running_mean)
    assert torch.allclose(cov, true_cov, atol=0.15)
    assert torch.allclose(module.running_mean, torch.full((4,), 2.0, dtype=torch.float64), atol=0.1)


def test_sigma_pre_is_numpy_cov_of_class_means():
    feats, labels = torch.randn(300, 6, dtype=torch.float64), torch.arange(300) % 10
    means = np.stack([feats[labels == c].numpy().mean(0) for c in range(10)])
    sigma = class_mean_covariance(feats, labels)
    assert sigma.dtype == torch.float64
    assert np.allclose(sigma.numpy(), np.cov(means, rowvar=False, ddof=1))
    assert torch.allclose(sigma, sigma.T) and torch.linalg.eigvalsh(sigma).min() > -1e-12


def test_class_means_streams_in_chunks():
    feats, labels = torch.randn(100, 3), torch.arange(100) % 5
    acc = ClassMeans(5, 3)
    for chunk in range(0, 100, 7):
        acc.update(feats[chunk:chunk + 7], labels[chunk:chunk + 7])
    assert torch.allclose(acc.covariance(), class_mean_covariance(feats, labels))
    with pytest.raises(ValueError, match="two classes"):
        ClassMeans(3, 3).covariance()


def test_cholesky_jitter_rescues_a_slightly_indefinite_matrix():
    cov = torch.diag(torch.tensor([1.0, 1e-3, -5e-4], dtype=torch.float64))
    factor = cholesky(cov, 1e-4)
    assert torch.isfinite(factor).all() and factor.dtype == torch.float32


def test_align_uses_given_statistics():
    h = torch.randn(5, 3)
    mean, cov = batch_moments(torch.randn(50, 3))
    out = align(h, mean, recolouring(cholesky(cov, 1e-4), cholesky(torch.eye(3, dtype=torch.float64), 1e-4)), alpha=1.0)
    assert torch.allclose(out.norm(dim=1), torch.ones(5), atol=1e-5)
