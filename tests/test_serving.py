"""Serving-shaped graphs on k3-tiny: right-padded batches of prompts of different lengths, rows at
different cache depths decoding together, reused rows, capacity refusal, and ONNX Runtime writing
the MLA cache in place. The reference is each prompt run alone through the eager model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from reference import rel_error

from k3export.check.driver import run_check
from k3export.check.runners.eager import EagerRunner
from k3export.errors import UserError
from k3export.onnx import runner as onnx_runner
from k3export.onnx.export import ExportGraph
from k3export.onnx.runner import BoundOnnxrtRunner, Signature

PROMPTS = (5, 17, 64)
STEPS = 8
# Batching and padding change nothing but summation order in a few kernels: float32 roundoff.
SAME_BACKEND = 1e-5
# ONNX Runtime against eager: chunked vs scanned KDA (the check's float32 bound).
ACROSS_BACKENDS = 1e-4


@pytest.fixture(scope="module")
def last_logits_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k3export.cli import main

    folder = tmp_path_factory.mktemp("serving") / "last"
    assert main(["export", "--preset", "k3-tiny", "--seed", "0", "--capacity", "256", "--last-logits",
                 "--out", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def references(tiny_model) -> list[tuple[list[int], torch.Tensor, list[int]]]:
    """The prompts of 5, 17 and 64 tokens, each run alone: (prompt, logits, decode tokens fed)."""
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPTS)]
    return [(p, *alone(tiny_model, p, STEPS)) for p in prompts]


def runner(kind: str, folder: Path, model) -> EagerRunner | BoundOnnxrtRunner:
    manifest = json.loads((folder / "export.json").read_text())
    signature = Signature(manifest)
    if kind == "eager":
        graph = ExportGraph(model, range(*manifest["layers"]), manifest["last_logits"])
        return EagerRunner(graph, "eager", signature)
    return BoundOnnxrtRunner(folder / "model.onnx", signature)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def alone(model, tokens: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """One prompt by itself through the eager model's own API (batch 1, no padding), then `steps`
    greedy decode steps: the logits at every position [len + steps, vocab] and the tokens fed."""
    logits, cache = model(torch.tensor([tokens]), model.empty_cache(1, capacity=256))
    rows, fed = [logits[0]], []
    for _ in range(steps):
        fed.append(int(rows[-1][-1].argmax()))
        logits, cache = model(torch.tensor([[fed[-1]]]), cache)
        rows.append(logits[0])
    return torch.cat(rows), fed


def call(run, tokens: list[list[int]], cache_lengths: list[int]) -> list[torch.Tensor]:
    """One right-padded call: row b takes tokens[b]. Returns each row's logits at its valid
    positions ([n_b, vocab]; [1, vocab] for a --last-logits graph)."""
    lengths = [len(t) for t in tokens]
    ids = np.zeros((len(tokens), max(lengths)), np.int64)
    for b, row in enumerate(tokens):
        ids[b, :len(row)] = row
    out = run.infer({"input_ids": ids, "cache_lengths": np.array(cache_lengths, np.int64),
                     "input_lengths": np.array(lengths, np.int64)})
    logits = torch.from_numpy(np.array(out["logits"]))
    return [logits[b, :n] if logits.dim() == 3 else logits[b][None] for b, n in enumerate(lengths)]


def serve_batch(run, prompts: list[list[int]], fed: list[list[int]]) -> list[torch.Tensor]:
    """The prompts as one right-padded batch, then one decode step per fed token, all rows together.
    Returns each row's logits at every valid position, in order."""
    run.reset(len(prompts))
    rows = call(run, prompts, [0] * len(prompts))
    cache_lengths = [len(p) for p in prompts]
    for k in range(len(fed[0])):
        for b, logits in enumerate(call(run, [[f[k]] for f in fed], cache_lengths)):
            rows[b] = torch.cat([rows[b], logits])
        cache_lengths = [n + 1 for n in cache_lengths]
    return rows


def expected(reference: torch.Tensor, prompt_len: int, last_only: bool) -> torch.Tensor:
    """The reference logits a graph gives: every position, or the prompt's last and each step's."""
    return reference[prompt_len - 1:] if last_only else reference


@pytest.mark.parametrize("kind", ["eager", "onnxrt"])
@pytest.mark.parametrize("last_logits", [False, True], ids=["all-logits", "last-logits"])
def test_padded_batch_equals_each_prompt_alone(tiny_model, tiny_export, last_logits_export, references,
                                               kind, last_logits):
    """Prompts of 5, 17 and 64 tokens right-padded to 64, then 8 greedy decode steps: every valid
    logit of every row equals that prompt run alone (float32, 1e-5 relative, the same backend),
    and ONNX Runtime also equals eager alone (1e-4)."""
    folder = last_logits_export if last_logits else tiny_export
    prompts, fed = [p for p, _, _ in references], [f for _, _, f in references]
    with runner(kind, folder, tiny_model) as run:
        batched = serve_batch(run, prompts, fed)
        singles = [serve_batch(run, [p], [f])[0] for p, f in zip(prompts, fed, strict=True)]
    for (p, reference, _), rows, single in zip(references, batched, singles, strict=True):
        want = expected(reference, len(p), last_logits)
        assert rows.shape == want.shape == (len(want), 256)
        assert rel_error(rows, single) <= SAME_BACKEND
        assert rel_error(rows, want) <= (SAME_BACKEND if kind == "eager" else ACROSS_BACKENDS)


@pytest.mark.parametrize("kind", ["eager", "onnxrt"])
def test_rows_at_different_depths_and_a_reused_row(tiny_model, tiny_export, kind):
    """Row 0 holds a 40-token prompt and decodes on; row 1 serves a 6-token prompt, is reset, and
    takes a new 12-token prompt in the same call in which row 0 decodes one token (input lengths
    1 and 12, cache lengths 43 and 0). Each row's logits equal its prompt served alone in a fresh
    session: the old row's KDA state and latent rows leave no trace."""
    first, short, fresh = prompt(40, 10), prompt(6, 11), prompt(12, 12)
    ref_first, fed_first = alone(tiny_model, first, 7)
    ref_short, fed_short = alone(tiny_model, short, 3)
    ref_fresh, fed_fresh = alone(tiny_model, fresh, 3)
    with runner(kind, tiny_export, tiny_model) as run:
        rows = serve_batch(run, [first, short], [fed_first[:3], fed_short])
        assert rel_error(rows[0], ref_first[:43]) <= ACROSS_BACKENDS
        assert rel_error(rows[1], ref_short) <= ACROSS_BACKENDS
        run.reset(2, rows=[1])
        deep, new = call(run, [[fed_first[3]], fresh], [43, 0])
        out0, out1 = [deep], [new]
        cache_lengths = [44, 12]
        for k in range(3):
            step0, step1 = call(run, [[fed_first[4 + k]], [fed_fresh[k]]], cache_lengths)
            out0.append(step0)
            out1.append(step1)
            cache_lengths = [n + 1 for n in cache_lengths]
    tol = SAME_BACKEND if kind == "eager" else ACROSS_BACKENDS
    assert rel_error(torch.cat(out0), ref_first[43:]) <= tol
    assert rel_error(torch.cat(out1), ref_fresh) <= tol


@pytest.mark.parametrize("kind", ["eager", "onnxrt"])
def test_an_idle_row_keeps_its_state(tiny_model, last_logits_export, kind):
    """A decode step in which row 1 has no new token (input_lengths 0) leaves row 1 as it was: its
    next steps equal its prompt decoded alone, while row 0 goes on decoding."""
    first, second = prompt(9, 20), prompt(6, 21)
    ref_first, fed_first = alone(tiny_model, first, 3)
    ref_second, fed_second = alone(tiny_model, second, 2)
    with runner(kind, last_logits_export, tiny_model) as run:
        run.reset(2)
        call(run, [first, second], [0, 0])
        step0, _ = call(run, [[fed_first[0]], []], [9, 6])
        rows = [call(run, [[fed_first[1 + k]], [fed_second[k]]], [10 + k, 6 + k]) for k in range(2)]
    tol = SAME_BACKEND if kind == "eager" else ACROSS_BACKENDS
    assert rel_error(torch.cat([step0, *(r[0] for r in rows)]), ref_first[9:]) <= tol
    assert rel_error(torch.cat([r[1] for r in rows]), ref_second[6:]) <= tol


def test_overflowing_request_is_refused_before_any_session(tiny_export, monkeypatch):
    """cache_lengths + seq past the capacity (4096 here) is refused by our own check with our
    message: by `check` before it builds anything, by the runner before ONNX Runtime runs, and by
    the eager model."""
    def no_session(*args, **kwargs):
        raise AssertionError("an ONNX Runtime session was created")

    monkeypatch.setattr(onnx_runner.ort, "InferenceSession", no_session)
    with pytest.raises(UserError, match=r"--batch 2 --prompt-len 4090 --steps 10: the longest row holds "
                                        r"4090 \+ 10 = 4100 tokens in its cache, and the export's cache "
                                        r"capacity is 4096"):
        run_check(tiny_export, steps=10, batch=2, prompt_len=4090, log=lambda _: None)
    monkeypatch.undo()

    run = runner("onnxrt", tiny_export, None)
    with run:
        run.reset(2)
        ran = []
        session_run = run.session.run_with_iobinding
        run.session.run_with_iobinding = lambda binding: ran.append(binding) or session_run(binding)
        feed = {"input_ids": np.zeros((2, 8), np.int64), "cache_lengths": np.array([0, 4090]),
                "input_lengths": np.array([8, 3])}
        with pytest.raises(UserError, match=r"row 1 holds 4090 cached tokens and this call writes 8 "
                                            r"\(padding included\), 4098 > the cache capacity 4096"):
            run.infer(feed)
        assert ran == []


def test_eager_model_refuses_overflow(tiny_model):
    cache = tiny_model.empty_cache(2, capacity=16)
    with pytest.raises(UserError, match="12 cached tokens .* 17 > the cache capacity 16"):
        tiny_model(torch.zeros(2, 5, dtype=torch.int64), type(cache)(cache.layers, torch.tensor([3, 12])))
    with pytest.raises(UserError, match=r"input_lengths\[1\] = 6: expected 0 <= input_lengths <= seq = 5"):
        tiny_model(torch.zeros(2, 5, dtype=torch.int64), cache, torch.tensor([5, 6]))


def test_onnxruntime_decode_writes_the_mla_cache_in_place(tiny_model, tiny_export, capfd):
    """With IO binding, TensorScatter's present output is past's own buffer: its data pointer is
    past's, the new row appears in the buffer the runner already held, and ONNX Runtime never warns
    that it copies past_cache to present_cache (which it does for a plain run of the same graph)."""
    with runner("onnxrt", tiny_export, tiny_model) as run:
        run.reset(2)
        call(run, [prompt(9, 1), prompt(4, 2)], [0, 0])
        held = run.caches["past.3.mla_latent"]
        before = held.copy()
        capfd.readouterr()
        call(run, [[7], [8]], [9, 4])
        assert "copying past_cache to present_cache" not in capfd.readouterr().err
        assert run.aliased == {f"present.{i}.mla_latent": True for i in (3, 7, 8)}
        assert run.caches["past.3.mla_latent"] is held
        # The step wrote exactly one row per sequence, at its length; nothing else moved.
        changed = np.argwhere((held != before).any(-1))
        assert sorted({(b, row) for b, _, row in changed.tolist()}) == [(0, 9), (1, 4)]
        feed = {"input_ids": np.array([[7], [8]]), "cache_lengths": np.array([9, 4]),
                "input_lengths": np.array([1, 1]), **{k: v.copy() for k, v in run.caches.items()}}
    session = ort.InferenceSession(str(tiny_export / "model.onnx"), providers=["CPUExecutionProvider"])
    session.run(None, feed)
    assert "copying past_cache to present_cache" in capfd.readouterr().err
