"""--init-from: a new run's weights from a checkpoint or a state_dict. Imported only when the flag is given."""
import re

import torch

from machinery.errors import UserError


def load_initial_weights(model: torch.nn.Module, path: str) -> str:
    """Load `path` (a checkpoint's weight EMA, else its model; or a state_dict) into `model`; return a line saying so.
    A classifier head (the last nn.Linear) that does not fit stays fresh; another misfit is refused, named."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # data, never code
    except FileNotFoundError:
        raise UserError(f"--init-from {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 (torch raises many kinds)
        raise UserError(f"--init-from {path} does not load as a checkpoint or a state_dict "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    what = "the state_dict"
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        # torch's AveragedModel: the model under "module.", and its count
        ema = {k: v for k, v in (state.get("model_ema") or {}).items() if k != "n_averaged"}
        state, what = (ema, "the weight EMA") if ema else (state["model"], "the model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--init-from {path} holds neither a checkpoint of this project nor a state_dict")
    state = {re.sub(r"^((module|_orig_mod)\.)+", "", k): v for k, v in state.items()}  # DDP's, compile's prefixes
    own = model.state_dict()
    heads = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    head = {f"{heads[-1]}.{k}" for k in model.get_submodule(heads[-1]).state_dict()} if heads else set()
    if extra := sorted(set(state) - set(own)):
        raise UserError(f"--init-from {path}: its tensor {extra[0]} has no place in this model: build the one it fits")
    fresh = {k for k in own if k not in state or state[k].shape != own[k].shape}
    for key in sorted(fresh - head, key=lambda k: (k not in state, k)):  # a misshapen layer says most: first
        got = f"is {tuple(state[key].shape)}, the model's {tuple(own[key].shape)}" if key in state else "is missing"
        raise UserError(f"--init-from {path}: layer {key} {got}: build the model it fits (only the head may differ)")
    with torch.no_grad():
        for key in own.keys() - fresh:
            own[key].copy_(state[key])
    line = f"Initialised from {what} in {path}"
    if fresh:
        weight = f"{heads[-1]}.weight"
        before = f"{state[weight].shape[0]} classes" if weight in state else "none"
        line += (f"; its classifier head {heads[-1]} ({before}) is re-initialised for this model's "
                 f"{own[weight].shape[0]} classes")
    return line + " (a new run: fresh optimizer and schedule)"
