"""Inside the target: locating its decoder stack, final norm and LM head, and capturing the aux
hidden states (forward hooks) that the drafter is trained on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from eyas.errors import EyasError

# Where wrapper and multimodal models keep their language model's decoder layers. Tried in
# order; capture that silently misses the inner model is how one seed failure began.
LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.language_model.model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.model.layers",
    "model.text_model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
)

NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


@dataclass
class DecoderStack:
    """Where a model keeps its language model: the module to call, its layers, its norm."""

    base: torch.nn.Module  # returns the last hidden state when called with input_ids
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    path: str


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_stack(model: torch.nn.Module) -> DecoderStack:
    """Locate the decoder layers and final norm wherever the model keeps them."""
    for path in LAYER_PATHS:
        layers = _get(model, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            parent = _get(model, path.rsplit(".", 1)[0]) if "." in path else model
            norm = next((getattr(parent, n) for n in NORM_NAMES if hasattr(parent, n)), None)
            if norm is None:
                continue
            return DecoderStack(base=parent, layers=layers, norm=norm, path=path)
    raise EyasError(
        f"cannot find the decoder layers of {type(model).__name__}; tried "
        f"{', '.join(LAYER_PATHS)}; pass a model whose language model is under one of these"
    )


def output_head(model: torch.nn.Module) -> torch.Tensor | None:
    """The target's LM head weight (V, H) (tied or not), wherever the model keeps it; None if
    it has none that eyas can find."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = next((m for n, m in model.named_modules() if n.split(".")[-1] == "lm_head"), None)
    w = getattr(head, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


class AuxCapture:
    """Forward hooks that keep only the requested hidden states during a target forward.

    `layer_ids` are HF `output_hidden_states` indices: 0 = embeddings (the input of layer
    0), i = output of decoder layer i-1, and L = the final-norm output (transformers puts
    the normed state at the last index, so id L follows it). The final state is the output of the final norm
    (what the LM head consumes). Use as a context manager around any forward call.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        self.stack = find_decoder_stack(model)
        L = len(self.stack.layers)
        bad = [i for i in layer_ids if not 0 <= i <= L]
        if bad:
            raise EyasError(f"aux layer ids {bad} do not exist in a {L}-layer target (valid: 0..{L})")
        self.layer_ids = list(layer_ids)
        self.states: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> "AuxCapture":
        for i in self.layer_ids:
            if i == 0:
                h = self.stack.layers[0].register_forward_pre_hook(self._pre_hook(0), with_kwargs=True)
            elif i == len(self.stack.layers):
                continue  # filled from the final norm's output
            else:
                h = self.stack.layers[i - 1].register_forward_hook(self._hook(i))
            self._handles.append(h)
        self._handles.append(self.stack.norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, i: int):
        def fn(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]
        return fn

    def _hook(self, i: int):
        def fn(module, args, output):
            self.states[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    def _norm_hook(self, module, args, output) -> None:
        self.last = output
        if len(self.stack.layers) in self.layer_ids:
            self.states[len(self.stack.layers)] = output

    def aux(self) -> torch.Tensor:
        """Concatenated aux states `(B, T, len(ids) * H)` in the order of `layer_ids`."""
        missing = [i for i in self.layer_ids if i not in self.states]
        if missing:
            raise EyasError(f"aux hidden states for layers {missing} were not produced by the forward")
        return torch.cat([self.states[i] for i in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self.states.clear()
        self.last = None


@contextlib.contextmanager
def capture_aux(model: torch.nn.Module, layer_ids: list[int]) -> Iterator[AuxCapture]:
    """`with capture_aux(model, ids) as cap: model(...); cap.aux(), cap.last`."""
    cap = AuxCapture(model, layer_ids)
    with cap:
        yield cap
