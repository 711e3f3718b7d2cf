"""dataset_utils.measure_data: the shape, classes and statistics taken from the data (or as a split
states them), and one line for each kind of data the loaders cannot take."""
import pytest
import torch

import dataset_utils as du
from machinery.errors import UserError


def test_measure_data_takes_shape_classes_and_statistics_from_the_data():
    images = torch.tensor([[[[0, 255]]], [[[51, 102]]]], dtype=torch.uint8)  # 2 images, 1 x 1 x 2
    train = du.ImageData(images, torch.tensor([0, 3]))
    test = du.ImageData(images[:1], torch.tensor([4]))
    spec = du.measure_data(train, test)
    pixels = torch.tensor([0, 255, 51, 102], dtype=torch.float64) / 255
    # the largest label of either + 1
    assert (spec.channels, spec.height, spec.width, spec.num_classes) == (1, 1, 2, 5)
    assert spec.mean == pytest.approx((pixels.mean().item(),), abs=1e-12)
    assert spec.std == pytest.approx((pixels.std(unbiased=False).item(),), abs=1e-12)
    # What a split states is taken as stated.
    stated = du.ImageData(images, torch.tensor([0, 3]), num_classes=10, mean=(0.5,), std=(0.25,))
    assert du.measure_data(stated, test) == du.DataSpec(1, 1, 2, 10, (0.5,), (0.25,))
    # A constant channel keeps its scale (std 1) rather than dividing by zero.
    flat = du.ImageData(torch.full((2, 1, 2, 2), 7, dtype=torch.uint8), torch.tensor([0, 1]))
    assert du.measure_data(flat, flat).std == (1.0,)


class Files(list):
    """A Dataset that lists its classes, as torchvision's ImageFolder does, but states no statistics."""
    classes = ["a", "b"]


@pytest.mark.parametrize("train,test,says", [
    (du.ImageData(torch.zeros(2, 1, 4, 4), torch.tensor([0, 1])), None, "needs uint8 images (N, C, H, W)"),
    (du.ImageData(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])), None, "needs uint8 images"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1], dtype=torch.int32)), None,
     "int64 labels (N,)"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])),
     du.ImageData(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])),
     "gives 1-channel training images, 3-channel test images"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), num_classes=2),
     du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 2])),
     "test labels span [0, 2], outside [0, 2)"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([-1, 1])), None,
     "training labels span [-1, 1]"),
    ([(torch.zeros(1, 4, 4, dtype=torch.uint8), 0)], None,
     "states no number of classes: set its .num_classes"),
    (Files([(torch.zeros(1, 4, 4, dtype=torch.uint8), 0)]), None, "states no per-channel mean and std"),
    ([(torch.zeros(4, 4, 1).numpy(), 0)], None, "it must yield (uint8 tensor C x H x W, integer label)"),
    ([(torch.zeros(1, 4, 4, dtype=torch.uint8), torch.tensor(1.0))], None,
     "it must yield (uint8 tensor C x H x W, integer"),
    (42, None, "return dataset_utils.ImageData, or a Dataset"),
])
def test_measure_data_refuses_what_the_loaders_cannot_take_in_one_line(train, test, says):
    with pytest.raises(UserError) as e:
        du.measure_data(train, test if test is not None else train)
    assert says in str(e.value) and "\n" not in str(e.value)
