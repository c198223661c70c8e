"""Speculative decoding (runtime.speculation, runtime.drafts) and the rollback every runner shares
(onnx.runner.Rollback), on k3-tiny's 3-layer cut (2 KDA layers, 1 MLA layer) built in 2 stages. The
reference is the eager model's plain greedy decoding, each prompt alone; drafts are that continuation
(runtime.drafts.ContinuationDrafter, with a wrong token where a row should reject) or the n-gram and
suffix drafters'."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import PERTURBED, scaled_copy
from test_parallel_grid import short_config, short_recipe

from k3export.check.runners.eager import EagerRunner
from k3export.check.runners.network import NetworkRunner
from k3export.cli import main
from k3export.config import K3Config
from k3export.engine.network import parse_network
from k3export.errors import UserError
from k3export.model import K3ForCausalLM
from k3export.onnx import runner as onnx_runner
from k3export.onnx.export import ExportGraph
from k3export.onnx.runner import DRAFT_LENGTHS, BoundOnnxrtRunner, Signature
from k3export.runtime import Pipeline, stage_exports
from k3export.runtime import speculation as speculation_module
from k3export.runtime.drafts import ContinuationDrafter, NgramDrafter, SuffixDrafter, earlier_match
from k3export.runtime.schedule import MicroBatch
from k3export.runtime.speculation import Speculation, speculate, truth_logits
from k3export.shards.plan import rollback_bytes
from k3export.shards.recipe import load_recipe
from k3export.shards.stages import build_recipe

VOCAB = 256
TINY_RECIPE = Path(__file__).resolve().parents[1] / "engines/k3-tiny.toml"
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-layer cut in 2 stages (onnx backend, float32, capacity 256), seed 0."""
    folder = tmp_path_factory.mktemp("speculation")
    out = folder / "build"
    build_recipe(load_recipe(short_recipe(folder, "float32", 2, 1)), out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    """The eager model the build was exported from (the recipe's seed 0)."""
    model = K3ForCausalLM(short_config()).eval()
    model.init_weights(0)
    return model


def prompts_of(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@torch.no_grad()
def greedy(model: K3ForCausalLM, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding of one prompt alone through the eager model: its `steps` new tokens."""
    logits, cache = model(torch.tensor([prompt]), model.empty_cache(1, capacity=256))
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < steps:
        logits, cache = model(torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


# Where a row's draft is wrong, by the length of its text: nowhere (it accepts all of K), first (none).
def every_right(n: int) -> None:
    return None


def first_wrong(n: int) -> int:
    return 0


def varying(n: int) -> int:
    return n % 5  # 0 up to 4: some calls reject at once, some accept all of K = 4


class EagerStageRunner(EagerRunner):
    """The eager runner as a runtime stage's: no double buffers (a Stage's slots hold them), no sums."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.spares: dict = {}
        self.collective_time = 0.0


def stage_pipeline(build: Path, model: K3ForCausalLM, eager: bool) -> Pipeline:
    """The build's stages in ONNX Runtime, or each stage's layers of the eager model (the same
    Rollback, in EagerRunner: the chunked KDA of the eager op)."""
    pipeline = Pipeline(stage_exports(build))
    if eager:
        for stage in pipeline.stages:
            graph = ExportGraph(model, stage.layers, last_logits=False)
            stage.runner.deactivate()
            stage.runner = EagerStageRunner(graph, stage.runner.name, stage.signature)
            stage.runner.activate()
    return pipeline


def run_speculation(build: Path, model: K3ForCausalLM, prompts: list[list[int]], drafters, drafts: int,
                    micro_batches: int = 1, eager: bool = False, new_tokens: int = NEW_TOKENS):
    pipeline = stage_pipeline(build, model, eager)
    try:
        return speculate(pipeline, Speculation(prompts, new_tokens, drafters, drafts), micro_batches)
    finally:
        pipeline.close()


@pytest.fixture(scope="module")
def references(model: K3ForCausalLM) -> dict[tuple[int, ...], list[list[int]]]:
    """Plain greedy tokens of the prompts of each length set the tests use."""
    return {lengths: [greedy(model, p, NEW_TOKENS) for p in prompts_of(lengths)]
            for lengths in ((13, 5, 30), (13, 29))}


@pytest.mark.parametrize(("micro_batches", "eager"), [(1, False), (2, False), (1, True)],
                         ids=["onnxrt", "onnxrt-2-micro-batches", "eager"])
def test_rows_accepting_none_some_and_all_give_plain_greedy_tokens(build, model, references, micro_batches,
                                                                   eager):
    """Three rows in one batch: one accepts every draft (K = 4), one none, one 0 to 4 by call; each
    row's tokens are those of plain greedy decoding of its prompt alone, and the drafts were accepted
    exactly as drawn."""
    lengths = (13, 5, 30)
    prompts, expected = prompts_of(lengths), references[lengths]
    drafters = [ContinuationDrafter(p + e, VOCAB, wrong) for p, e, wrong in
                zip(prompts, expected, (every_right, first_wrong, varying), strict=True)]
    result = run_speculation(build, model, prompts, drafters, 4, micro_batches, eager)
    assert result.tokens == expected
    assert 0 < result.drafts["accepted"] < result.drafts["drafted"]


@pytest.mark.parametrize("eager", [False, True], ids=["onnxrt", "eager"])
def test_long_verifies_cross_kda_chunks_from_unaligned_lengths(build, model, references, eager):
    """K = 16: verifies of 17 tokens from cache lengths 13 and 29 (not multiples of the eager KDA's
    16-token chunks) span two or three chunks; rows reject at varying places and re-feed up to 17."""
    lengths = (13, 29)
    prompts, expected = prompts_of(lengths), references[lengths]
    drafters = [ContinuationDrafter(p + e, VOCAB, lambda n: None if n % 3 == 0 else n % 17)
                for p, e in zip(prompts, expected, strict=True)]
    result = run_speculation(build, model, prompts, drafters, 16, eager=eager)
    assert result.tokens == expected


def test_a_broken_rollback_gives_other_tokens(build, model, references, monkeypatch):
    """What the tests above would see of a broken rollback: no state taken back (as if the kept state
    were one an in-place output had overwritten), or one rejected draft kept (off by one token)."""
    lengths = (13, 5, 30)
    prompts, expected = prompts_of(lengths), references[lengths]

    def drafters():
        return [ContinuationDrafter(p + e, VOCAB, varying) for p, e in zip(prompts, expected, strict=True)]

    with monkeypatch.context() as patch:
        patch.setattr(onnx_runner.Rollback, "rewind",
                      lambda self, caches, lengths, name: np.zeros(len(lengths), bool))
        assert run_speculation(build, model, prompts, drafters(), 4).tokens != expected
    with monkeypatch.context() as patch:
        real = speculation_module.accepted
        patch.setattr(speculation_module, "accepted", lambda d, c: min(real(d, c) + 1, len(d)))
        assert run_speculation(build, model, prompts, drafters(), 4).tokens != expected


class NoDrafts:
    def propose(self, text, count):
        return []


def test_only_rows_fed_drafts_are_copied(build, model, references):
    """The runners' rollback copies a row's KDA states and conv tails only before a call that feeds
    it drafts and does not take it back (a row taken back keeps the copy it came from): plain
    generation (a prefill of 13 to 30 tokens, then decode) copies nothing; a speculative run copies,
    stage by stage, one row's KDA caches for each such call of each row, and never for a row that
    drafts nothing."""
    from k3export.runtime import Sampler, generate

    lengths = (13, 5, 30)
    prompts, expected = prompts_of(lengths), references[lengths]
    pipeline = stage_pipeline(build, model, eager=False)
    row_bytes = [sum(a.nbytes for n, a in s.signature.empty_caches(1).items() if not n.endswith("mla_latent"))
                 for s in pipeline.stages]
    try:
        generate(pipeline, prompts, 6, Sampler())
        assert [s.runner.rollback.copied_bytes for s in pipeline.stages] == [0, 0]
        calls = []  # per call, each row's cache length and drafts
        real = Speculation.request

        def request(self, batch):
            real(self, batch)
            calls.append(list(zip(batch.cache_lengths.tolist(), batch.draft_lengths.tolist(), strict=True)))

        drafters = [ContinuationDrafter(prompts[0] + expected[0], VOCAB, varying), NoDrafts(),
                    ContinuationDrafter(prompts[2] + expected[2], VOCAB, first_wrong)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Speculation, "request", request)
            result = speculate(pipeline, Speculation(prompts, NEW_TOKENS, drafters, 4))
        assert result.tokens == expected
        copies = sum(drafts > 0 and (t == 0 or length != calls[t - 1][r][0])
                     for t, call in enumerate(calls) for r, (length, drafts) in enumerate(call))
        assert all(drafts == 0 for call in calls for _, drafts in call[1:2]) and 0 < copies < len(calls) * 2
        assert [s.runner.rollback.copied_bytes for s in pipeline.stages] == [copies * n for n in row_bytes]
    finally:
        pipeline.close()


def stage0_runner(build: Path, model: K3ForCausalLM, kind: str, folder: Path):
    """Stage 0 of the build (2 KDA layers) in the runner of `kind`: ONNX Runtime, the eager model, the
    parsed TensorRT network on CPU, or the engine runner over the CPU stand-in of an engine (whose KDA
    state output is written in place of its input, as an engine's is)."""
    export = stage_exports(build)[0]
    manifest = json.loads((export / "export.json").read_text())
    signature = Signature(manifest)
    if kind == "eager":
        graph = ExportGraph(model, range(*manifest["layers"]), last_logits=False)
        return EagerRunner(graph, "eager", signature)
    if kind == "network":
        return NetworkRunner(parse_network(export / "model.onnx"), signature)
    if kind == "engine":
        from engine_standin import CpuMemoryEngineRunner
        from test_engine_runner import standin_record

        return CpuMemoryEngineRunner(standin_record(export, folder), export)
    return BoundOnnxrtRunner(export / "model.onnx", signature)


def feeds(rows: list[list[int]], cache_lengths: list[int],
          drafts: list[int] | None = None) -> dict[str, np.ndarray]:
    """A call's feeds; `drafts`: how many of each row's tokens are drafts (None: no row drafts)."""
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(max(lengths), 1)), np.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    feed = {"input_ids": ids, "cache_lengths": np.array(cache_lengths, np.int64),
            "input_lengths": np.array(lengths, np.int64)}
    return feed if drafts is None else {**feed, DRAFT_LENGTHS: np.array(drafts, np.int64)}


@pytest.mark.parametrize("kind", ["onnxrt", "eager", "network", "engine"])
def test_the_rollback_restores_the_state_before_the_verify(build, model, kind, monkeypatch, tmp_path):
    """A runner that verified 5 tokens of row 0 and is then given row 0's length of before, with 3 of
    them again, computes what a runner that never saw the 5 computes, to the bit; row 1, which kept
    its 5, goes on. A length it cannot go back to is refused, naming the row."""
    if kind in ("network", "engine"):
        pytest.importorskip("tensorrt_rtx")
        from engine_standin import install

        install(monkeypatch)
    verified, straight = (stage0_runner(build, model, kind, tmp_path) for _ in range(2))
    prompts = prompts_of((13, 5))
    for runner in (verified, straight):
        runner.activate()
        runner.reset(2)
        runner.infer(feeds(prompts, [0, 0]), check_inputs=False)
    verified.infer(feeds([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [13, 5], [4, 4]), check_inputs=False)
    straight.infer(feeds([[], [6, 7, 8, 9, 10]], [13, 5]), check_inputs=False)
    again = feeds([[1, 2, 11], [12]], [13, 10])
    ours, theirs = (dict(r.infer(again, check_inputs=False)) for r in (verified, straight))
    for name, value in theirs.items():
        if name.startswith("present.") and not name.endswith("mla_latent"):
            assert np.array_equal(ours[name], value), name
    logits = next(n for n in theirs if not n.startswith("present."))
    assert np.array_equal(ours[logits][0, :3], theirs[logits][0, :3])
    with pytest.raises(UserError, match="row 0 comes with cache_lengths 14"):
        verified.infer(feeds([[1], [1]], [14, 11]), check_inputs=False)
    for runner in (verified, straight):
        runner.deactivate()


def test_drafts_find_the_longest_earlier_suffix():
    """The suffix automaton's match is the naive search's longest (any length), and both drafters,
    fed a growing text, propose what followed an earlier occurrence of the text's end, within `count`,
    when that match holds at least their minimum length (1 and 2)."""
    rng = random.Random(0)
    for _ in range(60):
        text = [rng.randrange(3) for _ in range(rng.randrange(1, 50))]
        drafters = [(SuffixDrafter(s), NgramDrafter(3, s)) for s in (1, 2)]
        for n in range(1, len(text) + 1):
            prefix = text[:n]
            for shortest, (suffix, ngram) in enumerate(drafters, start=1):
                proposal = suffix.propose(prefix, 4)
                length, end = suffix.match()
                assert length == earlier_match(prefix, n)[0]
                if length:
                    assert prefix[end - length + 1:end + 1] == prefix[n - length:] and end < n - 1
                assert proposal == (prefix[end + 1:end + 5] if length >= shortest else [])
                longest, at = earlier_match(prefix, 3)
                assert ngram.propose(prefix, 4) == (prefix[at + 1:at + 5] if longest >= shortest else [])
    assert NgramDrafter().propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert SuffixDrafter().propose([5, 6], 3) == []


def test_run_speculate_gives_the_tokens_of_run(build, capsys):
    """`k3export run --speculate 4` (both drafters) prints the tokens `run` prints, on rows of
    different lengths and a repeating prompt that the drafters find matches in."""
    common = ["run", str(build), "--batch", "3", "--prompt-len", "24", "--max-new-tokens", "24", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    for drafts in ("ngram", "suffix"):
        assert main([*common, "--speculate", "4", "--drafts", drafts]) == 0
        spec = json.loads(capsys.readouterr().out)
        assert spec["tokens"] == plain["tokens"] and spec["drafts"]["drafted"] > 0
    repeating = ",".join(["3", "1", "4", "1", "5"] * 6)
    results = []
    for extra in ([], ["--speculate", "4", "--drafts", "suffix"]):
        argv = ["run", str(build), "--prompt-ids", repeating, "--max-new-tokens", "24", "--json", *extra]
        assert main(argv) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["tokens"] == results[1]["tokens"]
    assert main(["run", str(build), "--prompt-ids", repeating, "--max-new-tokens", "24", "--speculate",
                 "4"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    counts = results[1]["drafts"]
    assert last.startswith(f"drafts: {counts['accepted']} of {counts['drafted']} accepted (by position: ")
    assert f"{counts['refeeding_calls']} of {counts['decode_calls']} decode calls re-fed" in last


def test_drafts_up_to_the_cache_capacity(build, capsys):
    """The longest prompt, its new tokens and a call's padding (3K + 1 tokens, the row's last token the
    first) may fill the 256-token cache exactly; one more draft is refused before any stage loads,
    naming the limit."""
    common = ["run", str(build), "--batch", "2", "--prompt-len", "196", "--max-new-tokens", "48", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--speculate", "4", "--drafts", "suffix"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain["tokens"]
    assert main([*common, "--speculate", "5"]) == 2
    refusal = capsys.readouterr().err
    assert "--speculate 5: " in refusal and "at most --speculate 4" in refusal


def test_the_rollback_costs_the_kda_caches_at_the_published_widths():
    """`plan`'s rollback bytes for kimi-k3 in bfloat16: the 69 KDA layers' states (96 x 128 x 128
    float32) and three conv tails (3 x 12288 bfloat16) per sequence, ARCHITECTURE.md's numbers."""
    config = K3Config.from_preset("kimi-k3")
    per_layer = 96 * 128 * 128 * 4 + 3 * 3 * 12288 * 2
    assert rollback_bytes(config, range(93), "bfloat16") == 69 * per_layer == 449_372_160


def test_torchrun_speculates_across_stages_and_micro_batches(build):
    """`torchrun -m k3export.runtime --speculate 4`, one process a stage, the rows in 2 micro-batches in
    flight together: the lengths each call's rows were given by the last stage's acceptance ride with
    every message, and the tokens are those of plain decoding in one process (100 tokens a row and
    matches of one token drafted, so that some drafts are accepted and most are rejected)."""
    from test_shards import in_process, torchrun

    from k3export.runtime import Sampler, random_prompts

    options = ["--runner", "onnx", "--batch", "3", "--prompt-len", "40", "--max-new-tokens", "100"]
    speculative = torchrun(build, *options, "--speculate", "4", "--drafts", "suffix", "--draft-min-match",
                           "1", "--micro-batches", "2")
    plain = in_process(build, random_prompts(3, 40, VOCAB, seed=0), 100, Sampler())
    assert speculative["tokens"] == plain.tokens
    assert 0 < speculative["drafts"]["accepted"] < speculative["drafts"]["drafted"]
    assert speculative["decode_steps"] < plain.decode_steps


@pytest.fixture(scope="module")
def verify_engine(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 0's TensorRT-RTX engine (sm89) with a verify profile: 3 rows x 7 tokens (K = 2)."""
    pytest.importorskip("tensorrt_rtx")
    out = tmp_path_factory.mktemp("verify") / "stage0.engine"
    assert main(["build", "--onnx", str(stage_exports(build)[0]), "--out", str(out), "--max-batch", "3",
                 "--max-seq", "64", "--decode-batch", "3", "--verify-seq", "7"]) == 0
    return out


def test_a_verify_profile_is_built_recorded_and_taken(build, verify_engine, monkeypatch):
    """build --verify-seq 7 gives the engine a third profile, decode's batch x 7 tokens, in its build
    record with its device memory and the K it serves (run --speculate 2: 3K + 1 = 7); the engine
    runner (over the CPU stand-in) takes it for a verify call, prefill's for the prefill and decode's
    for a token."""
    from engine_standin import CpuMemoryEngineRunner, install

    record = json.loads(verify_engine.with_name(f"{verify_engine.name}.json").read_text())
    prefill, decode, verify = record["profiles"]
    assert [p["input_ids"][2] for p in (prefill, decode, verify)] == [[3, 64], [3, 1], [3, 7]]
    assert [m["profile"] for m in record["device_memory"]] == ["prefill", "decode", "verify"]
    assert record["device_memory"][2]["speculate_up_to"] == 2  # 3K + 1 = 7 tokens
    engine = install(monkeypatch)
    runner = CpuMemoryEngineRunner(verify_engine, stage_exports(build)[0])
    runner.activate()
    runner.reset(3)
    runner.infer(feeds(prompts_of((13, 5, 30)), [0, 0, 0]), check_inputs=False)
    runner.infer(feeds([[1, 2, 3, 4, 5]] * 3, [13, 5, 30], [4] * 3), check_inputs=False)
    runner.infer(feeds([[1, 2], [6], [7]], [13, 10, 35]), check_inputs=False)  # row 0 rewound
    runner.infer(feeds([[1]] * 3, [15, 11, 36]), check_inputs=False)
    (context,) = engine[0].contexts
    assert [profile for profile, _ in context.calls] == [0, 2, 2, 1] and not context.refusals
    runner.deactivate()


@pytest.mark.parametrize("verify_seq", [13, 12], ids=["verify-profile", "too-short"])
def test_run_speculate_on_engines(build, tmp_path, monkeypatch, capsys, verify_seq):
    """`run --speculate 4 --runner engine` over the CPU stand-in of each stage's engine gives the tokens
    of plain `run` on the ONNX graphs; on engines whose profiles take no call of 2 x 13 tokens (3K + 1:
    a prefill of at most 4, a verify profile of 12) it is refused before any engine loads."""
    pytest.importorskip("tensorrt_rtx")
    from engine_standin import engines_recorded, install

    from k3export.engine.build import Limits

    short = verify_seq < 13
    out = engines_recorded(build, tmp_path / "engines", Limits(3, 4 if short else 64, 3, verify_seq))
    common = ["run", str(out), "--batch", "3", "--prompt-len", "4", "--max-new-tokens", "12", "--json"]
    assert main([*common, "--runner", "onnx"]) == 0
    plain = json.loads(capsys.readouterr().out)
    engines = install(monkeypatch, gpus=1)
    code = main([*common, "--runner", "engine", "--speculate", "4"])
    captured = capsys.readouterr()
    if short:
        assert code == 2 and not engines
        # 3 rows in 2 micro-batches (as many as stages): the larger has 2.
        assert "--speculate 4: a call of 2 rows x 13 tokens (3K + 1: " in captured.err
        assert "--verify-seq 13" in captured.err
        return
    assert code == 0 and json.loads(captured.out)["tokens"] == plain["tokens"]
    calls = [profile for e in engines for c in e.contexts for profile, _ in c.calls]
    assert 2 in calls and not any(c.refusals for e in engines for c in e.contexts)


def test_check_speculate_passes_a_clean_chain_and_fails_a_perturbed_one(build, tmp_path):
    """check --build --speculate 4: verify calls and rolled-back calls of the chain's stages compared
    with the eager chain on the same feeds, the speculative tokens the chain's plain greedy ones; stage
    1's routed experts' up projection scaled by 1.05 fails it."""
    from test_parallel_grid import scale_weight

    from k3export.check.runners.chain import run_build_check

    options = {"steps": 20, "prompt_len": 20, "speculate": 4, "log": lambda _: None}
    report = run_build_check(build, **options)
    spec = report["speculation"]
    assert report["passed"] and spec["streams_identical"] and 0 < spec["accepted"] < spec["drafted"]
    rewound = sum(step["step"] != "prefill" for step in report["steps"])
    assert rewound == spec["calls"] - 1 and report["token_mismatches"] == 0
    perturbed = Path(shutil.copytree(build, tmp_path / "perturbed"))
    scale_weight(perturbed, 1, None, "layers.2.block_sparse_moe.routed_expert_up_proj.weight", 1.05)
    assert not run_build_check(perturbed, **options)["passed"]


@pytest.mark.parametrize("artifact", ["--onnx", "--network"])
def test_check_speculate_passes_a_clean_export_and_fails_a_perturbed_one(tiny_export, tmp_path, artifact,
                                                                         capsys):
    """check --onnx / --network --speculate 4 on k3-tiny's export: every verify call and rolled-back call
    within the bound and the speculative tokens the artifact's plain greedy ones; a layer-0 convolution
    weight scaled by 1.5 fails it."""
    def check(export: Path) -> tuple[int, dict]:
        code = main(["check", artifact, str(export), "--steps", "8", "--prompt-len", "12", "--speculate", "4",
                     "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, report = check(tiny_export)
    spec = report["speculation"]
    assert code == 0 and spec["streams_identical"] and 0 < spec["accepted"] < spec["drafted"]
    code, report = check(scaled_copy(tiny_export, tmp_path / "perturbed", PERTURBED, 1.5))
    assert code == 1 and not report["passed"]


def test_check_speculate_names_the_layer_and_call_of_a_broken_rollback(build, monkeypatch):
    """The chain's ONNX Runtime stages with a rollback that takes nothing back (the eager side's is
    whole): the first call after a rejection fails, naming the KDA caches of the layers it ran on."""
    from k3export.check.runners.chain import run_build_check

    class NoRollback(onnx_runner.Rollback):
        def rewind(self, caches, cache_lengths, name):
            return np.zeros(len(cache_lengths), bool)

    real_reset = BoundOnnxrtRunner.reset

    def reset(self, batch, rows=None):
        real_reset(self, batch, rows)
        self.rollback = NoRollback(self.rollback.before, self.rollback.after)

    monkeypatch.setattr(BoundOnnxrtRunner, "reset", reset)
    report = run_build_check(build, steps=20, prompt_len=20, speculate=4, log=lambda _: None)
    assert not report["passed"]
    failed = [s for s in report["steps"] if not all(o["passed"] for o in s["outputs"])]
    names = {o["name"] for o in failed[0]["outputs"] if not o["passed"]}
    assert failed[0]["step"].startswith("decode") and {"present.0.kda_state", "present.1.kda_state"} <= names


def test_plan_sizes_the_verify_profile(tmp_path):
    """A recipe's verify profile (decode's 2 rows x 5 tokens) holds 5 times the decode profile's
    activations in `plan`, which prints them beside the prefill's and decode's, and adds the rollback's
    copy of every sequence's KDA caches to a stage's total."""
    from k3export.shards.plan import format_plan, plan_recipe

    decode = "decode = { batch = 2 }"
    text = TINY_RECIPE.read_text().replace(decode, decode + "\nverify = { seq = 5 }")
    (tmp_path / "verify.toml").write_text(text)
    plan = plan_recipe(load_recipe(tmp_path / "verify.toml"))
    assert all(s.verify_activation_bytes == 5 * s.decode_activation_bytes > 0 for s in plan.stages)
    assert f"verify {plan.stages[0].verify_activation_bytes / 1e9:.2f} GB" in format_plan(plan)
    # The rollback's copy, every sequence's, counts in a stage's total with a verify profile only.
    plain = plan_recipe(load_recipe(TINY_RECIPE))
    for stage, without in zip(plan.stages, plain.stages, strict=True):
        copy = rollback_bytes(plan.config, stage.layers, plan.dtype) * plan.batch
        assert stage.rollback_bytes == copy > 0 and without.rollback_bytes == 0
        assert stage.total_bytes == stage.weight_bytes + stage.cache_bytes + stage.activation_bytes + copy


# -- sampling with drafts ---------------------------------------------------------------------------

SAMPLER = dict(temperature=0.7, top_k=16, top_p=0.9)  # every cut plain sampling makes, in use
DRAWS, ALPHA = 6000, 1e-4


def accepting_every_draft(drafts, logits, sampler, rng):
    """A broken rule: every draft accepted, then one token from p."""
    tokens, p = sampler.distribution(logits[len(drafts)])
    return len(drafts), int(tokens[rng.choice(len(p), p=p)])


def not_renormalising(drafts, logits, sampler, rng):
    """A broken rule: on a rejection, an inverse-CDF draw over p with the draft removed, not
    renormalised (a draw past its mass falls to the last kept token)."""
    for i, draft in enumerate(drafts):
        tokens, p = sampler.distribution(logits[i])
        if rng.random() < p[tokens == draft].sum():
            continue
        residual = np.cumsum(np.where(tokens == draft, 0.0, p))
        return i, int(tokens[min(int(np.searchsorted(residual, rng.random())), len(p) - 1)])
    tokens, p = sampler.distribution(logits[len(drafts)])
    return len(drafts), int(tokens[rng.choice(len(p), p=p)])


def chi_square_p_value(observed: list[int], tokens: np.ndarray, p: np.ndarray) -> float:
    """Pearson's test of `observed` tokens against the distribution (`tokens`, `p`); tokens expected
    fewer than 5 times pooled, and a token outside `tokens` fails at once (p-value 0)."""
    if not set(observed) <= set(tokens.tolist()):
        return 0.0
    counts = np.array([observed.count(t) for t in tokens.tolist()], np.float64)
    expected = p * len(observed)
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        counts, expected = counts[:-1], expected[:-1]
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize(("rule", "agrees"), [(speculation_module.sampled, True),
                                              (accepting_every_draft, False), (not_renormalising, False)],
                         ids=["standard", "accepting-every-draft", "not-renormalising"])
def test_speculative_sampling_draws_from_plain_samplings_distribution(model, rule, agrees):
    """k3-tiny's 3-layer cut on a fixed prompt, drafts x1, x2 (each position's most likely token: p 0.24
    and 0.19 after temperature 0.7, top-k 16, top-p 0.9, 12 and 13 tokens kept): over 6000 seeded draws
    the first token, and the second given that the first is x1 (about 1400 draws), have plain
    sampling's distribution at that position (Sampler.distribution, what plain sampling draws from) by
    Pearson's chi-square at alpha 1e-4 (the statistic's bound: about 36 at 11 or 12 degrees of
    freedom). Power: a rule accepting every draft gives x1 always; one that does not renormalise after
    removing the draft gives the last kept token (p 0.025) p(x1)(1 - p(x1)) = 0.18 more: expected
    statistics in the thousands, so either fails with probability ~1 (p-values 0 and 1e-200 here)."""
    from k3export.runtime import Sampler

    sampler = Sampler(**SAMPLER)
    prompt = prompts_of((12,))[0]
    with torch.no_grad():
        first = model(torch.tensor([prompt]), model.empty_cache(1, capacity=64))[0][0, -1].numpy()
        drafts = [int(sampler.distribution(first)[0][0])]
        second = model(torch.tensor([prompt + drafts]), model.empty_cache(1, capacity=64))[0][0, -1].numpy()
        drafts.append(int(sampler.distribution(second)[0][0]))
        logits = model(torch.tensor([prompt + drafts]), model.empty_cache(1, capacity=64))[0][0, -3:].numpy()
    firsts, seconds = [], []
    for seed in range(DRAWS):
        kept, token = rule(drafts, logits, sampler, np.random.default_rng(seed))
        firsts.append(drafts[0] if kept >= 1 else token)
        if kept >= 1:
            seconds.append(drafts[1] if kept >= 2 else token)
    p_values = [chi_square_p_value(firsts, *sampler.distribution(logits[0])),
                chi_square_p_value(seconds, *sampler.distribution(logits[1]))]
    assert len(seconds) > 1000  # x1 was accepted often enough to test what follows it
    assert (min(p_values) > ALPHA) == agrees, p_values


def test_sampled_runs_are_seeded_per_row(build, model, references):
    """run's sampler with drafts end to end (the pipeline's stages, 2 micro-batches or 1): a row's
    tokens depend on the seed and not on the other rows or the grouping, and drafts are accepted."""
    from k3export.runtime import Sampler

    lengths = (13, 5, 30)
    prompts, expected = prompts_of(lengths), references[lengths]

    def sampled_run(rows: list[int], micro_batches: int, seed: int):
        drafters = [ContinuationDrafter(prompts[r] + expected[r], VOCAB) for r in rows]
        pipeline = stage_pipeline(build, model, eager=False)
        try:
            return speculate(pipeline, Speculation([prompts[r] for r in rows], 12, drafters, 4,
                                                   sampler=Sampler(**SAMPLER, seed=seed)), micro_batches)
        finally:
            pipeline.close()

    whole = sampled_run([0, 1, 2], 2, seed=3)
    assert whole.tokens[:2] == sampled_run([0, 1], 1, seed=3).tokens
    assert whole.tokens != sampled_run([0, 1, 2], 2, seed=4).tokens
    assert all(len(row) == 12 for row in whole.tokens) and whole.drafts["accepted"] > 0


def test_counts_per_position_stop_at_a_stop_token():
    """Speculation's counts, driven by a model that gives each text's next token. Row 0's drafts all
    match but its third is a stop token: 3 accepted, not 4, and 3 tokens that call. Row 1's second
    draft of each call is wrong: each call accepts one and gives two tokens, its pending tokens grow
    by two (3, 5, ... 13), its drafts cut to 3K + 1 = 13 tokens a call (4, 4, 4, 4, 4, 2, then none:
    that call accepts its 13 re-fed tokens whole), then one draft left of its 16 tokens."""
    stop = 13
    texts = [[1, 2, 3, 4, 5, 10, 11, 12, stop, 14, 15, 16], [1, 2, 3, 4, 5, *range(20, 40)]]
    drafters = [ContinuationDrafter(texts[0], VOCAB), ContinuationDrafter(texts[1], VOCAB, lambda n: 1)]
    speculation = Speculation([t[:5] for t in texts], 16, drafters, 4, frozenset([stop]))
    batch = MicroBatch.of(0, range(2), speculation.prompts)
    fed = []
    while not batch.finished:
        speculation.request(batch)
        fed.append(batch.input_lengths[1])
        speculation.take(batch, truth_logits(batch, texts, VOCAB))
        batch.calls += 1
    counts = speculation.counts
    assert speculation.rows == [texts[0][5:9], texts[1][5:21]] and fed == [5, 5, 7, 9, 11, 13, 13, 13, 2]
    assert counts["drafted_per_position"] == [8, 7, 6, 6] and counts["accepted_per_position"] == [8, 1, 1, 0]
    assert counts["drafted"] == 27 and counts["accepted"] == 10
    assert counts["decode_calls"] == 8 and counts["refeeding_calls"] == 6
    assert counts["row_calls"] == 9 and counts["tokens_per_call"] == (3 + 15) / 9
