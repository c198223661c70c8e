"""The plugin definitions' launches, as the adapters call them: into given output buffers, with
KDA's final state the initial state's own buffer (TensorRT aliases them)."""

from __future__ import annotations

import torch
from reference import kda_inputs, rel_error
from test_mla import inputs as mla_inputs
from test_mla import reference as mla_reference

import k3export.ops as ref
from k3plugins.definitions import KDA, LATENT_MLA


def test_kda_launch_updates_the_state_in_place() -> None:
    for T in (1, 9):  # the recurrent and the chunked launcher
        inputs = list(kda_inputs(2, T, 2, 32, 32, torch.float32, seed=T))
        o_ref, state_ref = ref.recurrent_kda(*(t.double() for t in inputs))
        state = inputs[5]
        o = torch.full_like(inputs[2], float("nan"))
        KDA.launch(inputs, [o, state], {})
        assert rel_error(o, o_ref) < 1e-5 and rel_error(state, state_ref) < 1e-5


def test_latent_mla_launch() -> None:
    q, kv, cache_lengths = mla_inputs(2, 3, 2, 40, 48, (0, 37), torch.float32)
    o = torch.full((2, 3, 2, 32), float("nan"))
    LATENT_MLA.launch([q, kv, cache_lengths], [o], {"v_dim": 32, "scale": 0.2})
    assert rel_error(o, mla_reference(q, kv, cache_lengths, 32, 0.2)) < 1e-5
