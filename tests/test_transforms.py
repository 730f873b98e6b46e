import pytest
import torch
from torchvision.transforms import v2

from mepo_stream import transforms
from mepo_stream.transforms import ScaleNormalize

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("shape", [(3, 20, 20), (1, 3, 20, 20), (8, 3, 20, 20)])
def test_scale_normalize_gives_torchvisions_values(shape):
    """The one multiply-add is v2's ToDtype(scale) + Normalize, to float32 rounding, for an image and a batch."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = v2.Normalize(MEAN, STD)(v2.ToDtype(torch.float32, scale=True)(x))
    out = ScaleNormalize(MEAN, STD)(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)


def test_scale_normalize_refuses_what_is_not_uint8():
    with pytest.raises(TypeError, match="uint8"):
        ScaleNormalize(MEAN, STD)(torch.zeros(3, 4, 4))


def test_the_transforms_resize_and_normalise_without_touching_their_input():
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    before = x.clone()
    for tf in (transforms.test_transform(24, MEAN, STD), transforms.train_transform(24, MEAN, STD, "cifar10")):
        out = tf(x)
        assert out.shape == (4, 3, 24, 24) and out.dtype == torch.float32
        assert torch.equal(x, before)
    torch.testing.assert_close(transforms.test_transform(24, MEAN, STD)(x), v2.Compose([
        v2.Resize((24, 24), antialias=True), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])(x),
        rtol=0, atol=2e-6)
