"""The phases a training step's time is split into (timing.StepLog), and what each means in a line."""

# In the order a step passes them:
PHASES = {
    "data": "waiting for data",            # the loader's next batch, its copy to the device and normalisation
    "compute": "in forward and backward",  # up to the launch of the last gradient bucket's all-reduce
    "sync": "waiting on the other ranks",  # that all-reduce's tail, the agreed checks, the epoch's loss sums
    "optimizer": "in the optimizer step",  # the update, the grad scaler, the BatchNorm buffers kept
    "other": "in the loop's bookkeeping",  # the LR, progress lines; a mid-epoch checkpoint counts as sync
}
