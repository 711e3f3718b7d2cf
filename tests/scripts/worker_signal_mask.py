"""Prints, as JSON, the stop signals a DataLoader worker is born holding back (before its worker_init_fn runs)
and those it ignores once started; run in a fresh interpreter, where the loader's first worker also starts
multiprocessing's resource tracker (and the forkserver the project's loaders take their workers from). It
exits with the loader's iterator still alive, as a run whose loader sits in a reference cycle does
(tests/unit/test_stop_request.py)."""
import json

from torch.utils.data import DataLoader, Dataset

import dataset_utils as du
from machinery.loader_workers import deaf_to_stop_signals, stop_signals_held
from machinery.signals import STOP_SIGNALS


def status_mask(field: str) -> list:
    with open("/proc/self/status") as f:
        mask = int(next(line.split()[1] for line in f if line.startswith(field + ":")), 16)
    return [int(s) for s in STOP_SIGNALS if mask >> (s - 1) & 1]


class Report(Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return json.dumps({"born_holding": Report.born, "ignores": status_mask("SigIgn")})


def first(batch):
    return batch[0]


def born_holding(worker_id: int) -> None:  # runs before the project's worker_init_fn
    Report.born = status_mask("SigBlk")
    deaf_to_stop_signals(worker_id)


if __name__ == "__main__":
    context = du._loader_options(1, pin_memory=False)["multiprocessing_context"]  # the project's loaders'
    loader = DataLoader(Report(), num_workers=1, worker_init_fn=born_holding, multiprocessing_context=context,
                        collate_fn=first)
    with stop_signals_held():
        batches = iter(loader)
    print(next(batches), flush=True)
