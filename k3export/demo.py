"""`k3export demo`: the k3-tiny model end to end on this machine."""

from __future__ import annotations

import time

import torch

from k3export.config import K3Config
from k3export.model import K3ForCausalLM


@torch.no_grad()
def run_demo(seed: int, prompt_len: int, steps: int) -> int:
    config = K3Config.from_preset("k3-tiny")
    model = K3ForCausalLM(config).eval()
    model.init_weights(seed)
    n_mla = len(config.mla_layers)
    print(f"k3-tiny: {config.num_hidden_layers} layers ({config.num_hidden_layers - n_mla} KDA, "
          f"{n_mla} MLA), {sum(p.numel() for p in model.parameters()):,} parameters, seed {seed}")
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(seed))

    start = time.perf_counter()
    # A cache with room for the prompt and every decode step (rows of fixed capacity).
    logits, cache = model(prompt, model.empty_cache(1, capacity=prompt_len + steps))
    print(f"prefill: {prompt_len} tokens in {time.perf_counter() - start:.3f} s")
    tokens = [int(logits[0, -1].argmax())]
    step_logits = [logits[:, -1:]]
    for _ in range(steps - 1):
        start = time.perf_counter()
        logits, cache = model(torch.tensor([[tokens[-1]]]), cache)
        step_logits.append(logits)
        tokens.append(int(logits[0, -1].argmax()))
        print(f"decode: token {tokens[-1]:>3} in {(time.perf_counter() - start) * 1e3:.1f} ms")

    # The cached decode must agree with one forward over the whole sequence.
    full, _ = model(torch.cat([prompt, torch.tensor([tokens[:-1]])], dim=1))
    decoded = torch.cat(step_logits, dim=1)
    reference = full[:, prompt_len - 1:]
    error = float((decoded - reference).norm() / reference.norm())
    ok = error < 1e-4
    print(f"greedy tokens: {tokens}")
    print(f"prefill + {steps - 1} cached decode steps vs one forward over {prompt_len + steps - 1} tokens: "
          f"relative error {error:.2e} ({'ok' if ok else 'MISMATCH'})")
    return 0 if ok else 1
