"""The machinery behind train_utils.py, a module per concern; the recipe (train_ddp.py) never imports it,
and it never imports the core (train_ddp.py, config.py, dataset_utils.py, model.py, transforms.py,
train_utils.py) nor the tools: it takes plain values (a rules table, a dict, a tensor) as arguments
(tests/unit/test_layers.py).

    launch.py       who this process is: torchrun's, srun's or no launcher's ranks, the device, the
                    process group
    errors.py       the one error protocol: UserError, raised on every rank at once and said once
    cli.py          the command line: flags, --recipe presets, checks, one-line failures
    files.py        the run's files: atomic writes, rank 0's writes agreed on by all, a failed write in
                    one line
    lock.py         one run per out-dir
    checkpoints.py  checkpoint files, their format, finding the one to continue, resume checks, room for the
                    next
    data_checks.py  data checks that need no data contract: the classes two splits name, an image folder's
                    classes, statistics from exact sums, the loader workers' socket (dataset_utils'
                    measure_data and load_checked_data use them)
    loader_workers.py  how the DataLoader workers start: a forkserver per rank that has imported torch
    bad_samples.py  samples that do not read: named, skipped (--skip-bad-samples) or stopped on, agreed by
                    all ranks
    image_folders.py  image files as users have them (dataset_utils.image_folder, which imports it)
    cifar_archive.py  CIFAR-100's archive: downloaded, md5-checked, extracted
    records.py      progress lines, config.json, metrics.jsonl, run.json, summary.json, eval.json, TensorBoard
    signals.py      stop requests (SIGUSR1, SIGTERM, Ctrl-C, the stop file), and the tools' one-line exit
    output.py       rank 0's log lines
    timing.py       where each rank's step time goes, and the rank that holds the others back
"""
