"""--init-from: a new run's weights from a checkpoint or a state_dict, a classifier head of another shape left
fresh (fine-tuning on other classes). Imported only when the flag is given."""
import re

import torch

from machinery.errors import UserError


def load_initial_weights(model: torch.nn.Module, path: str) -> str:
    """--init-from: load `path`'s weights into `model` (on every rank) and return the line that says what
    was loaded. `path`: this project's checkpoint (its weight EMA if it has one, else its model) or a
    state_dict (keys prefixed by DDP's "module." or torch.compile's "_orig_mod." are taken as bare). A
    classifier head (the model's last nn.Linear) of another shape, or absent, keeps its fresh initialisation,
    as fine-tuning on another number of classes needs; any other missing, extra or misshapen tensor is
    refused, naming it."""
    try:
        # data, never code: as every checkpoint here
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--init-from {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 (torch raises many kinds for a file that is not a checkpoint)
        raise UserError(f"--init-from {path} does not load as a checkpoint or a state_dict "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    what = "the state_dict"
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        if state.get("model_ema"):  # torch's AveragedModel: the model under "module.", and its count
            state, what = {k: v for k, v in state["model_ema"].items() if k != "n_averaged"}, "the weight EMA"
        else:
            state, what = state["model"], "the model"
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--init-from {path} holds neither a checkpoint of this project nor a state_dict "
                        f"(a dict of tensors)")
    # DDP's, compile's prefixes
    state = {re.sub(r"^((module|_orig_mod)\.)+", "", k): v for k, v in state.items()}
    own = model.state_dict()
    heads = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    head = ({f"{heads[-1]}.{k}" for k, _ in model.get_submodule(heads[-1]).named_parameters()}
            if heads else set())
    for key in sorted(set(state) - set(own)):
        raise UserError(f"--init-from {path}: its tensor {key} has no place in this model (the model's "
                        f"layers differ: build the model the weights were trained as)")
    fresh = {k for k in own if k not in state or state[k].shape != own[k].shape}
    for key in sorted(fresh - head, key=lambda k: (k not in state, k)):  # a misshapen layer says most: first
        got = (f"is {tuple(state[key].shape)}, the model's {tuple(own[key].shape)}" if key in state
               else "is missing")
        raise UserError(f"--init-from {path}: layer {key} {got}: the weights fit another model; build the "
                        f"model they were trained as (only a classifier head may differ)")
    with torch.no_grad():
        for key, tensor in own.items():
            if key not in fresh:
                tensor.copy_(state[key])
    line = f"Initialised from {what} in {path}"
    if fresh:
        weight = f"{heads[-1]}.weight"
        before = f"{state[weight].shape[0]} classes" if weight in state else "none"
        line += (f"; its classifier head {heads[-1]} ({before}) is re-initialised for this model's "
                 f"{own[weight].shape[0]} classes")
    return line + " (a new run: fresh optimizer and schedule)"


