"""A sample the loader cannot take comes as a BadSample naming its split, index, file and cause, in its
slot of the rank's batch, which then lacks it: the micro-batches shrink where it was, and the step's other
samples train as before."""
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, Subset

import dataset_utils as du
import support
from machinery import bad_samples
from machinery.errors import UserError


class Files(Dataset):
    """Items like ImageFolder's: `samples` lists the files; item 2 is unreadable, item 3 another size."""
    samples = [(f"/data/cls/{i}.png", 0) for i in range(6)]

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 2:
            raise OSError("cannot identify image file")
        return torch.zeros(3, 8 if i != 3 else 9, 8, dtype=torch.uint8), 0


def test_an_unreadable_sample_is_named_with_its_file_and_where_it_failed():
    bad = bad_samples.read_sample(Files(), 2, "training", (3, 8, 8))
    assert isinstance(bad, bad_samples.BadSample) and bad.file == "/data/cls/2.png"
    assert bad.describe().startswith("training sample 2 (/data/cls/2.png): OSError: cannot identify image "
                                     "file (at ")
    assert "test_unreadable_samples.py:" in bad.reason


def test_an_image_of_another_size_is_named_with_a_resize_as_the_way_out_and_a_subset_names_the_file():
    bad = bad_samples.read_sample(Subset(Files(), [5, 3]), 1, "training", (3, 8, 8))
    assert (bad.file == "/data/cls/3.png"
            and bad.reason == "an image of 3 x 9 x 8 uint8, not 3 x 8 x 8 uint8 like the first")
    assert "v2.Resize((8, 8))" in bad.fix  # a Dataset with a transform: a resize in it
    assert bad_samples.read_sample(Files(), 0, "training", (3, 8, 8))[0].shape == (3, 8, 8)


def test_before_a_transform_any_size_reads_but_not_another_number_of_channels():
    assert bad_samples.read_sample(Files(), 3, "training", (3, None, None))[0].shape == (3, 9, 8)
    bad = bad_samples.read_sample(Files(), 3, "training", (1, None, None))
    assert bad.reason == "an image of 3 x 9 x 8 uint8, not 1 x H x W uint8 like the first"
    assert bad.fix == "give every image 1 channel(s) in load_data (dataset_utils.image_folder's mode=)"


def test_a_sample_of_the_validation_split_is_named_by_its_index_in_the_training_split_and_never_skipped():
    kept, held = du.hold_out(Files(), 1)
    assert held.indices == [2] and kept.indices == [0, 1, 3, 4, 5]  # the fixed permutation holds sample 2 out
    bad = bad_samples.read_sample(held, 0, "validation", (3, 8, 8))
    assert (bad.index, bad.file) == (2, "/data/cls/2.png")
    assert bad.describe().startswith("training sample 2 (/data/cls/2.png, held out for validation): OSError")
    with pytest.raises(UserError, match="the validation set is scored whole: --skip-bad-samples skips"):
        bad_samples.check_unreadable([bad], skipped=[], limit=1)
    # sample 3, another size, trained on: skipped
    other = bad_samples.read_sample(kept, 2, "training", (3, 8, 8))
    skipped = []
    bad_samples.check_unreadable([other], skipped=skipped, limit=1)
    assert skipped[0].startswith("training sample 3 (/data/cls/3.png): an image of 3 x 9 x 8")


def test_the_batch_lacks_the_unreadable_samples_and_their_micro_batches_shrink():
    shards = [du.ShardSampler(DistributedSampler(range(48), num_replicas=6, rank=1 + 2 * k)) for k in range(3)]  # 2x3
    sampler = du.StepSampler(shards, batch_size=24)  # micro-batches of 4
    assert sampler.step_split(0) == (24, [4, 4, 4])
    dataset = du.ImageDataset(Files(), split="training")
    images, labels, unreadable = du._collate(dataset.image_shape, [dataset[i] for i in (0, 2, 1, 3, 4, 5)])
    assert images.shape == (4, 3, 8, 8) and [(b.index, b.slot) for b in unreadable] == [(2, 1), (3, 3)]
    sampler.set_epoch(1)
    # slots 1 and 3: both in micro-batch 0
    assert sampler.step_split(0, skipped=unreadable) == (24, [2, 4, 4])
    gaps = [bad_samples.BadSample("training", 9, None, "x", slot=s) for s in (3, 4, 11)]
    assert sampler.step_split(0, skipped=gaps) == (24, [3, 3, 3])


def local_dataset():
    class Local(Dataset):  # defined inside a function: it cannot be pickled for the loader workers
        num_classes, mean, std = 2, (0.5,), (0.25,)

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(1, 4, 4, dtype=torch.uint8), i % 2
    return Local()


def test_a_dataset_the_loader_workers_cannot_take_is_refused_in_one_line_naming_the_ways_out():
    import pytest
    from machinery.errors import UserError
    data = local_dataset()
    train, _ = support.build_loaders(data, data, batch_size=4, rank=0, world_size=1, accum_steps=1,
                                     eval_batch=4, seed=0, workers=1, pin_memory=False)
    train.batch_sampler.set_epoch(1)
    with pytest.raises(UserError, match=r"load_data's Local cannot be sent to the DataLoader workers .*make its "
                                        r"class top-level, or use --workers 0"):
        list(train)


def test_a_dataset_listing_its_files_as_paths_or_imgs_names_the_unreadable_one(tmp_path):
    """`samples` or `imgs` as paths (pathlib or str) or (file, label) pairs, in a list or a tuple: the file is named."""
    class Listed(Dataset):
        def __init__(self, **listing):
            vars(self).update(listing)

        def __len__(self):
            return 2

        def __getitem__(self, idx):
            raise OSError("image file is truncated")
    b = tmp_path / "b.png"
    for listing in ({"samples": [tmp_path / "a.png", b]}, {"samples": (("a.png", 0), (str(b), 1))},
                    {"imgs": [str(tmp_path / "a.png"), str(b)]}):
        bad = bad_samples.read_sample(Listed(**listing), 1, "training")
        assert isinstance(bad, bad_samples.BadSample) and bad.file == str(b), (listing, bad)
        assert bad.describe().startswith(f"training sample 1 ({b}): OSError: image file is truncated")
