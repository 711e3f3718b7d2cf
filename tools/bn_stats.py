"""BatchNorm running statistics recomputed over a whole split on every rank, for weights that never trained with
their own statistics: an average of weights (SWA), or a fine-tune's. Not used by the recipe itself: its ADAPT
note at the end of training says where it goes."""
import torch
import torch.distributed as dist


@torch.no_grad()
def recompute_bn_stats(model, loader, *, normalize) -> None:
    """Set every BatchNorm layer's running mean and variance to its input's over all of `loader`'s samples on
    all ranks, each sample weighted alike (sums of x and x^2 all-reduced, not per-rank or per-batch means), so
    every rank ends with the same statistics. For weights that never trained with their own statistics: an
    average of weights (SWA), or a fine-tune's. Forwards in train mode, as training does, on the bare model
    (not DDP)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not layers:
        return
    device = normalize.scale.device
    # Per channel of every layer, side by side in one tensor (one all-reduce): n, x, x^2
    total = torch.zeros(3, sum(m.num_features for m in layers), dtype=torch.float64, device=device)
    sums = dict(zip(layers, total.split([m.num_features for m in layers], dim=1)))  # views into it

    def add_input(module, inputs):
        x = inputs[0].detach().double().transpose(0, 1).flatten(1)  # channels x (samples and positions)
        sums[module] += torch.stack([torch.full_like(x[:, 0], x.shape[1]), x.sum(1), (x * x).sum(1)])

    hooks = [m.register_forward_pre_hook(add_input) for m in layers]
    was_training = model.training
    model.train()
    try:
        for images, _ in loader:
            if len(images):  # a rank may have no samples in a step
                model(normalize(images.to(device, non_blocking=True)))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
    for m, (n, x, xx) in sums.items():
        mean = x / n.clamp_min(1)
        var = (xx / n.clamp_min(1) - mean * mean).clamp_min(0) * n / (n - 1).clamp_min(1)  # unbiased
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
