"""Launched by torchrun: record which training samples each rank's real loader yields, epoch by epoch.

Usage: record_batches.py DATA_DIR OUT_JSON PER_RANK_BATCH EPOCHS WORKERS [imagefolder]
The data come from support.index_images, whose pixels encode each sample's index; or, with
`imagefolder`, from an ImageFolder under DATA_DIR/train read as a Dataset (the route for data larger
than memory), whose items carry their index as their label.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support
import torch  # noqa: E402

import dataset_utils as du  # noqa: E402
import support  # noqa: E402
from machinery.errors import all_gather  # noqa: E402
from train_ddp import init_distributed  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402
from torchvision.transforms import v2  # noqa: E402


class IndexedFolder(ImageFolder):  # at the top level: the loader's workers unpickle it
    def __getitem__(self, index):
        return super().__getitem__(index)[0], index



def main():
    data_dir, out, per_rank_batch, epochs, workers = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    image_folder = sys.argv[6:] == ["imagefolder"]
    env = init_distributed("cpu", timeout_s=60)
    if image_folder:
        train = IndexedFolder(os.path.join(data_dir, "train"),
                              transform=v2.Compose([v2.Grayscale(), v2.PILToTensor()]))
    else:
        train = du.load_split("cifar100", data_dir, True)
    loader, _ = support.build_loaders(train, train, batch_size=per_rank_batch * env.world_size, rank=env.rank,
                                 world_size=env.world_size, accum_steps=1, eval_batch=per_rank_batch, seed=0,
                                 workers=workers, pin_memory=False)
    record = {}
    for epoch in range(1, epochs + 1):
        loader.batch_sampler.set_epoch(epoch)  # as train_ddp.py does
        seen, steps = [], 0
        for images, labels in loader:
            steps += 1
            if image_folder:
                ids = labels.long()
            else:
                ids = images[:, 0, 16, 16].long() + 256 * images[:, 1, 16, 16].long()
                assert (labels == ids % 100).all(), "labels travel with their images"
            seen += ids.tolist()
        record[epoch] = all_gather({"ids": seen, "steps": steps})
    if env.is_main:
        with open(out, "w") as f:
            json.dump(record, f)
    if env.world_size > 1:
        torch.distributed.destroy_process_group()  # else gloo's threads may abort the process at exit


if __name__ == "__main__":  # the loader workers' forkserver imports this file: only here does it run
    main()
