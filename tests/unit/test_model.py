"""model.WideResNet: the paper's parameter counts, depth 6n+4 only, and its structure and initialisation."""
import pytest
import torch

from model import WideResNet


def n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("depth,k,paper_millions", [(16, 4, 2.7), (16, 8, 11.0), (28, 10, 36.5)])
def test_parameter_counts_match_the_paper(depth, k, paper_millions):
    # The paper's table (CIFAR-10 heads) rounds to 0.1M; the 100-class head adds 90 * 64k weights and biases.
    ten = n_params(WideResNet(depth, k, num_classes=10))
    assert round(ten / 1e6, 1) == paper_millions
    hundred = n_params(WideResNet(depth, k, num_classes=100))
    assert hundred - ten == 90 * (64 * k + 1)
    assert abs(hundred - paper_millions * 1e6) / (paper_millions * 1e6) < 0.03
    if depth != 16 or k != 4:  # 2.7M is 2.75M rounded down: only the larger ones can hold 1%
        assert abs(hundred - paper_millions * 1e6) / (paper_millions * 1e6) < 0.01


@pytest.mark.parametrize("depth", [0, 8, 12, 15, 17, 29])
def test_depth_must_be_6n_plus_4(depth):
    with pytest.raises(ValueError, match="6n\\+4"):
        WideResNet(depth, 1)


def test_projections_only_where_the_shape_changes_and_the_paper_s_init():
    m = WideResNet(16, 2, num_classes=100, dropout=0.3)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    blocks = list(m.blocks)
    assert len(blocks) == 6  # n = 2 blocks in each of 3 groups
    # 1x1 projections exactly where the shape changes: the first block of each group.
    assert [b.shortcut is not None for b in blocks] == [True, False, True, False, True, False]
    assert all(b.shortcut.kernel_size == (1, 1) for b in blocks if b.shortcut is not None)
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            assert torch.all(mod.weight == 1) and torch.all(mod.bias == 0)
    # Kaiming normal, fan_out: std = sqrt(2 / (out_channels * 3 * 3)).
    w = blocks[2].conv1.weight
    assert abs(w.std().item() - (2 / (w.shape[0] * 9)) ** 0.5) < 0.1 * (2 / (w.shape[0] * 9)) ** 0.5
