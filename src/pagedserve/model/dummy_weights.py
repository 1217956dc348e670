"""--load-format dummy: random weights of a config's shape, for benchmarking a model without downloading it.

As vLLM's dummy format: every floating-point parameter is drawn uniformly from a small range with a fixed
seed, so two loads of one config are the same model and activations stay small enough that every layer's
output, and the logits, are finite. Values are drawn in float32 and then cast, so a bfloat16 model holds
the rounded float32 draws. Norm weights are drawn too (not 1): the model is meant to cost what the real
one costs, not to say anything useful.
"""
from __future__ import annotations

import torch
from torch import nn

DUMMY_WEIGHT_BOUND = 1e-3  # values in [-bound, bound)
DUMMY_WEIGHT_SEED = 1234


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = DUMMY_WEIGHT_SEED) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for param in model.parameters():
        if not param.is_floating_point():
            continue
        draws = torch.empty(param.shape, dtype=torch.float32).uniform_(-DUMMY_WEIGHT_BOUND, DUMMY_WEIGHT_BOUND,
                                                                       generator=gen)
        param.copy_(draws)
    model.pack_weights()  # what load_weights does after writing the weights (model/llama.py)
