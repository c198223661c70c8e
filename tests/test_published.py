"""The published Kimi-K3 checkpoint layout: names, quirks, MXFP4 experts, streaming, CLI."""

import json
import math
import re
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from reference import rel_error
from safetensors import safe_open
from safetensors.torch import save_file

import k3export.weights.checkpoint as checkpoint
from k3export.check.driver import run_check
from k3export.cli import main
from k3export.config import K3Config
from k3export.model import K3ForCausalLM
from k3export.model.parallel import split_model
from k3export.ops import mxfp4
from k3export.weights.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    build_model,
    checkpoint_slots,
    load_checkpoint,
    published_name,
    read_layout,
    weight_map,
)
from k3export.weights.published import FLOAT32_SUFFIXES, write_published

PREFIX = "language_model.model.layers"


@pytest.fixture(scope="module")
def source(tiny_config: K3Config) -> K3ForCausalLM:
    """k3-tiny in float32 holding bfloat16 values where the published checkpoint stores bfloat16
    (so that it writes and reads back exactly; float32 runs far faster than bfloat16 on CPU).
    Router choices are made decisive (correction biases 1 apart, wider than the sigmoid scores'
    range) so that rounding the experts cannot flip them: the logits respond smoothly."""
    model = K3ForCausalLM(tiny_config).eval()
    model.init_weights(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(FLOAT32_SUFFIXES):
                param.copy_(param.bfloat16())
        for layer in model.model.layers[1:]:
            layer.block_sparse_moe.gate.e_score_correction_bias.copy_(torch.arange(8.0, 0.0, -1.0))
    return model


@pytest.fixture(scope="module")
def mxfp4_dir(source, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("published_mxfp4")
    write_published(source, directory, experts="mxfp4")
    return directory


@pytest.fixture(scope="module")
def bf16_dir(source, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("published_bf16")
    write_published(source, directory, experts="bf16")
    return directory


def fresh(config: K3Config, packed: bool = False) -> K3ForCausalLM:
    model = K3ForCausalLM(config).eval()
    if packed:
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.block_sparse_moe.experts.keep_packed()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def logits(model: K3ForCausalLM) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids)[0].float()


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of a checkpoint with change(name, tensor) -> {name: tensor} applied to every tensor."""
    weights: dict[str, str] = {}
    for path in sorted(set(weight_map(src).values())):
        out = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out.update(change(name, f.get_tensor(name)))
        dst.mkdir(exist_ok=True)
        save_file(out, str(dst / path.name))
        weights.update(dict.fromkeys(out, path.name))
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


# -- names ---------------------------------------------------------------------------------------

def test_published_name():
    assert published_name("language_model.model.layers.3.self_attn.A_log") == "model.layers.3.self_attn.A_log"
    assert published_name("language_model.layers.3.self_attn.A_log") == "model.layers.3.self_attn.A_log"
    assert published_name("language_model.lm_head.weight") == "lm_head.weight"
    assert published_name("language_model.model.norm.weight") == "model.norm.weight"
    assert published_name("vision_tower.patch_embed.proj.weight") is None
    assert published_name("mm_projector.proj.0.weight") is None


def test_mapping_covers_every_tensor_of_the_published_checkpoint(mxfp4_dir, source):
    config = source.config
    layout = read_layout(mxfp4_dir)
    assert layout.published and layout.skipped == {"vision_tower": 2, "mm_projector": 1}
    names = [n for path in sorted(set(weight_map(mxfp4_dir).values()))
             for n in safe_open(path, framework="pt").keys()]  # noqa: SIM118
    assert len(names) == len(layout.tensors) + 3  # the index lists every tensor of the files
    slots = checkpoint_slots(fresh(config))
    # Every language-model tensor has a slot (an MXFP4 pair fills its expert's .weight), and back.
    covered = {n.removesuffix("_packed").removesuffix("_scale") for n in layout.tensors}
    assert covered == set(slots)
    assert layout.mxfp4_experts == 3 * config.num_experts * (config.num_hidden_layers - 1)
    report = load_checkpoint(fresh(config), mxfp4_dir)
    assert report.tensors_loaded == len(slots)
    assert "skipped 3 other tensors (mm_projector: 1, vision_tower: 2)" in report.summary()

    # The written layout, names and dtypes as published.
    lac, E, I, L = config.linear_attn_config, config.num_experts, config.moe_intermediate_size, \
        config.routed_expert_hidden_size
    C = lac.num_heads * lac.head_dim
    expected = {
        f"{PREFIX}.1.self_attn.q_conv1d.weight": (torch.float32, [C, 1, lac.short_conv_kernel_size]),
        f"{PREFIX}.1.self_attn.A_log": (torch.float32, [lac.head_dim]),
        f"{PREFIX}.1.self_attn.dt_bias": (torch.float32, [C]),
        f"{PREFIX}.1.self_attn.o_norm.weight": (torch.float32, [lac.head_dim]),
        f"{PREFIX}.1.block_sparse_moe.gate.e_score_correction_bias": (torch.float32, [E]),
        f"{PREFIX}.1.block_sparse_moe.gate.weight": (torch.bfloat16, [E, config.hidden_size]),
        f"{PREFIX}.1.block_sparse_moe.experts.7.w1.weight_packed": (torch.uint8, [I, L // 2]),
        f"{PREFIX}.1.block_sparse_moe.experts.7.w1.weight_scale": (torch.uint8, [I, L // 32]),
        f"{PREFIX}.1.block_sparse_moe.experts.7.w2.weight_packed": (torch.uint8, [L, I // 2]),
        f"{PREFIX}.1.block_sparse_moe.experts.7.w2.weight_scale": (torch.uint8, [L, I // 32]),
        f"{PREFIX}.3.self_attn.kv_b_proj.weight": (torch.bfloat16, [2 * (16 + 16), 32]),
        "language_model.lm_head.weight": (torch.bfloat16, [config.vocab_size, config.hidden_size]),
        "language_model.model.output_attn_res_proj.weight": (torch.bfloat16, [1, config.hidden_size]),
    }
    files = weight_map(mxfp4_dir)
    for name, (dtype, shape) in expected.items():
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        assert (tensor.dtype, list(tensor.shape)) == (dtype, shape), name
    assert not any(n.endswith(".experts.7.w1.weight") for n in files)
    config_json = json.loads((mxfp4_dir / "config.json").read_text())
    assert config_json["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert K3Config.from_json(mxfp4_dir).num_experts == E


def test_unknown_language_model_tensor_fails_loudly(bf16_dir, tmp_path, source):
    def add_bogus(name, tensor):
        bogus = name.endswith("layers.1.self_attn.A_log")
        extra = {f"{PREFIX}.1.self_attn.bogus.weight": torch.zeros(3)} if bogus else {}
        return {name: tensor, **extra, "vision_tower.extra.weight": torch.zeros(2)}

    broken = rewrite(bf16_dir, tmp_path / "broken", add_bogus)
    with pytest.raises(CheckpointError, match=rf"unexpected \(1\): {PREFIX}\.1\.self_attn\.bogus\.weight"):
        load_checkpoint(fresh(source.config), broken)


# -- quirks --------------------------------------------------------------------------------------

def _without_model_infix(name, tensor):
    return {name.replace("language_model.model.layers.", "language_model.layers."): tensor}


def _conv_as_c_w(name, tensor):
    return {name: tensor[:, 0] if name.endswith("_conv1d.weight") else tensor}


def _bias_in_bf16(name, tensor):
    return {name: tensor.bfloat16() if name.endswith("e_score_correction_bias") else tensor}


def _a_log_as_1_1_h_1(name, tensor):
    return {name: tensor[None, None, :, None] if name.endswith("A_log") else tensor}


@pytest.mark.parametrize("change", [_without_model_infix, _conv_as_c_w, _bias_in_bf16, _a_log_as_1_1_h_1])
def test_quirks_load_to_the_same_model(bf16_dir, tmp_path, source, change):
    """Forms the public loaders accept (sglang kimi_k3 / vLLM kimi_linear, see the module notes in
    checkpoint.py) load to the same weights (the correction bias's values are bf16-exact here)."""
    model = fresh(source.config)
    load_checkpoint(model, rewrite(bf16_dir, tmp_path / "quirk", change))
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_log_padding_must_be_zeros(bf16_dir, tmp_path, source):
    def pad_garbage(name, tensor):
        return {name: torch.cat([tensor[:-1], torch.ones(1)]) if name.endswith("layers.2.self_attn.A_log")
                else tensor}

    broken = rewrite(bf16_dir, tmp_path / "broken", pad_garbage)
    with pytest.raises(CheckpointError, match=r"model-00003-of-000012\.safetensors: "
                       rf"{PREFIX}\.2\.self_attn\.A_log has non-zero entries past the 2 heads.*zero padding"):
        load_checkpoint(fresh(source.config), broken)


# -- MXFP4 ---------------------------------------------------------------------------------------

def reference_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The format's definition element by element, in Python floats (exact: 3 significant bits).

    E2M1: bit 3 sign, bits 1-2 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (m/2).
    Element 2i is byte i's low nibble. E8M0: byte s is 2^(s - 127), per 32 consecutive elements."""
    def e2m1(code: int) -> float:
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
        return -magnitude if code & 8 else magnitude

    rows = []
    for bytes_, scales in zip(packed.tolist(), scale.tolist(), strict=True):
        row: list[float] = []
        for byte in bytes_:
            for code in (byte & 0x0F, byte >> 4):
                row.append(e2m1(code) * math.ldexp(1.0, scales[len(row) // 32] - 127))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decode_is_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (24, 64), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 253, (24, 4), generator=gen, dtype=torch.uint8)
    # Extreme scales: the subnormal 2^-127 and its neighbours, 2^0, and the largest that keep
    # every code finite (252), or only the codes below 4 (253) and 2 (254) finite.
    scale[0] = torch.tensor([0, 1, 2, 252], dtype=torch.uint8)
    scale[1] = torch.tensor([127, 126, 128, 252], dtype=torch.uint8)
    scale[2] = torch.tensor([253, 254, 253, 254], dtype=torch.uint8)
    small = torch.randint(0, 4, (64,), generator=gen, dtype=torch.uint8)  # magnitudes up to 1.5
    packed[2] = small | (small.flip(0) << 4) | torch.tensor([0x88], dtype=torch.uint8)  # with signs
    expected = reference_decode(packed, scale).to(dtype)
    assert torch.isfinite(expected).all()
    mxfp4.check(packed, scale, "t")
    assert torch.equal(bits(mxfp4.dequantize(packed, scale, dtype)), bits(expected))
    # Leading dims (stacked experts) decode the same, row by row.
    stacked = mxfp4.dequantize(packed.view(2, 12, 64), scale.view(2, 12, 4), dtype)
    assert torch.equal(bits(stacked.flatten(0, 1)), bits(expected))


def test_mxfp4_refuses_nan_scales_and_overflow(mxfp4_dir, tmp_path, source):
    packed = torch.full((2, 16), 0x77, dtype=torch.uint8)  # 6.0 everywhere
    with pytest.raises(mxfp4.MXFP4Error, match=r"w: 1 scale bytes are 255, NaN in OCP E8M0 \(first at \[1"):
        mxfp4.check(packed, torch.tensor([[127], [255]], dtype=torch.uint8), "w")
    with pytest.raises(mxfp4.MXFP4Error, match="w: scale bytes of 253 make values beyond the float32 range"):
        mxfp4.check(packed, torch.tensor([[127], [253]], dtype=torch.uint8), "w")

    name = f"{PREFIX}.4.block_sparse_moe.experts.5.w2.weight_scale"

    def nan_scale(n, tensor):
        return {n: torch.full_like(tensor, 255) if n == name else tensor}

    broken = rewrite(mxfp4_dir, tmp_path / "nan", nan_scale)
    for packed_experts in (False, True):
        with pytest.raises(CheckpointError, match=rf"00005-of-000012\.safetensors: {name}: .* 255, NaN"):
            load_checkpoint(fresh(source.config, packed_experts), broken)


def test_mxfp4_quantize_rounding_rule():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    w[0, :32] = 0
    packed, scale = mxfp4.quantize(w)
    decoded = mxfp4.dequantize(packed, scale, torch.float32)
    groups, amax = w.unflatten(-1, (-1, 32)), w.unflatten(-1, (-1, 32)).abs().amax(-1)
    step = torch.exp2(scale.float() - 127)
    # The smallest power of two that fits the group's max into 6, and nothing saturates.
    assert (amax <= 6 * step).all() and ((amax > 3 * step) | (amax == 0)).all()
    # Nearest E2M1 value: the error is at most half the local spacing (0.25, 0.5, 1 times the step).
    scaled = groups.abs() / step[..., None]
    half = torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, 1.0)) * step[..., None]
    assert ((decoded.unflatten(-1, (-1, 32)) - groups).abs() <= half).all()
    # Representable values survive a second round unchanged; ties go to the even code.
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(decoded), torch.float32), decoded)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    assert mxfp4.dequantize(*mxfp4.quantize(ties), torch.float32)[0, :7].tolist() == [0, 1, 1, 2, 2, 4, 4]


# -- round trips ---------------------------------------------------------------------------------

def test_round_trip_bf16_experts_is_exact(bf16_dir, source):
    model = fresh(source.config)
    load_checkpoint(model, bf16_dir)
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(logits(model), logits(source))


def test_round_trip_mxfp4_experts(mxfp4_dir, source):
    """The loader adds nothing to the MXFP4 rounding: the logits equal, bit for bit, those of the
    source with its experts rounded by quantize/dequantize, whether the experts are decoded on load
    or kept packed. The rounding itself: at most half an E2M1 spacing per weight (see
    test_mxfp4_quantize_rounding_rule), about 12% relative per expert matrix here, which moves
    k3-tiny's logits by 60% (relative), no more than Gaussian noise of the same relative size per
    matrix does (63%): this toy model amplifies expert errors about 5x."""
    config = source.config
    rounded, noisy = fresh(config), fresh(config)
    rounded.load_state_dict(source.state_dict())
    noisy.load_state_dict(source.state_dict())
    gen = torch.Generator().manual_seed(3)
    weight_errors = []
    with torch.no_grad():
        for layer_r, layer_n in zip(rounded.model.layers[1:], noisy.model.layers[1:], strict=True):
            for name in ("w1", "w2", "w3"):
                w = getattr(layer_r.block_sparse_moe.experts, name)
                q = mxfp4.dequantize(*mxfp4.quantize(w), w.dtype)
                error = rel_error(q, w)
                weight_errors.append(error)
                w.copy_(q)
                w_n = getattr(layer_n.block_sparse_moe.experts, name)
                noise = torch.randn(w_n.shape, generator=gen)
                w_n.add_(noise * error * w_n.norm() / w_n.numel() ** 0.5)
    assert max(weight_errors) < 0.125

    dequantised, packed = fresh(config), fresh(config, packed=True)
    load_checkpoint(dequantised, mxfp4_dir)
    load_checkpoint(packed, mxfp4_dir)
    assert torch.equal(logits(dequantised), logits(rounded))
    assert torch.equal(logits(packed), logits(rounded))
    reference = logits(source)
    mxfp4_error, noise_error = rel_error(logits(rounded), reference), rel_error(logits(noisy), reference)
    assert 0.3 < mxfp4_error < 0.7 and mxfp4_error < 1.1 * noise_error, (mxfp4_error, noise_error)


# -- streaming -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, shards", [(range(2, 4), [3, 4]), (range(0, 1), [1, 10]),
                                            (range(7, 9), [8, 9, 10])])
def test_layer_range_opens_only_its_shards(mxfp4_dir, source, monkeypatch, layers, shards):
    opened = []

    def recording_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", recording_open)
    model = fresh(source.config)
    load_checkpoint(model, mxfp4_dir, layers)
    # Each shard is opened twice: its header first (the whole load is checked before any weight is
    # read), then its data.
    assert sorted(set(opened)) == [f"model-{i:05d}-of-000012.safetensors" for i in shards]
    expected = fresh(source.config)
    load_checkpoint(expected, mxfp4_dir)
    for layer in layers:
        for a, b in zip(model.model.layers[layer].parameters(), expected.model.layers[layer].parameters(),
                        strict=True):
            assert torch.equal(a, b)
    untouched = [0] if layers.start else [5]
    assert not any(p.any() for i in untouched for p in model.model.layers[i].parameters())


@pytest.mark.parametrize(("folder", "packed"), [("bf16_dir", False), ("mxfp4_dir", False),
                                              ("mxfp4_dir", True)])
def test_a_rank_reads_only_its_slice(folder, packed, request, source, monkeypatch):
    """Rank 1 of 2 built from a checkpoint (split on the meta device, then each tensor's kept part
    read) holds exactly what split_model keeps of the fully loaded model; rank 0's experts are not
    read at all."""
    directory = request.getfixturevalue(folder)
    weights = {"checkpoint": str(directory), **({"packed_experts": True} if packed else {})}
    expected = split_model(build_model(source.config, torch.float32, weights), 1, 2).state_dict()
    read = []

    def recording_read(f, name, slot, path):
        read.append(name)
        return real_read(f, name, slot, path)

    real_read = checkpoint._read
    monkeypatch.setattr(checkpoint, "_read", recording_read)
    rank = build_model(source.config, torch.float32, weights, rank=1, ranks=2).state_dict()
    assert list(rank) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(rank[name], tensor), name
    experts = {int(m[1]) for n in read if (m := re.search(r"\.experts\.(\d+)\.", n))}
    assert experts == set(range(4, 8))


# -- command line --------------------------------------------------------------------------------

def test_cli_info_and_export_on_a_published_checkpoint(mxfp4_dir, tmp_path, capsys):
    assert main(["info", "--checkpoint", str(mxfp4_dir)]) == 0
    out = capsys.readouterr().out
    assert "published (language_model.*) layout" in out
    assert "192 routed-expert matrices in MXFP4; skipped 3 other tensors " \
           "(mm_projector: 1, vision_tower: 2)" in out
    assert "its MXFP4 routed experts load dequantised to bfloat16" in out and "kept packed" in out
    assert main(["info", "--checkpoint", str(mxfp4_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoint"]["skipped"] == {"vision_tower": 2, "mm_projector": 1}

    out_dir = tmp_path / "onnx"
    assert main(["export", "--checkpoint", str(mxfp4_dir), "--layers", "7:9", "--dtype", "float32",
                 "--packed-experts", "--out", str(out_dir)]) == 0
    assert "tensors from 3 of those 10 files" in capsys.readouterr().out  # layers 7, 8 and the globals
    manifest = json.loads((out_dir / "export.json").read_text())
    assert manifest["weights"]["packed_experts"] is True and manifest["layers"] == [7, 9]
    # The file carries the experts as published (their bytes, declared as int32 words: k3export/ops/mxfp4.py),
    # dequantised by the graph itself.
    graph = onnx.load(out_dir / "model.onnx", load_external_data=False)
    experts = {t.name.rsplit(".", 1)[-1]: t for t in graph.graph.initializer if ".experts." in t.name}
    for name in ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale"):
        assert experts.pop(name).data_type == onnx.TensorProto.INT32
    assert all(math.prod(t.dims) <= 256 for t in experts.values())  # only the decode tables remain
    onnx.checker.check_model(out_dir / "model.onnx", full_check=True)
    assert run_check(out_dir, steps=2, log=lambda _: None)["passed"]
    assert main(["export", "--preset", "k3-tiny", "--packed-experts", "--out", str(out_dir)]) == 2


def test_cli_info_names_missing_and_incomplete_shards(mxfp4_dir, tmp_path, capsys):
    """`info --checkpoint` answers "is my download complete?": every file the index names, present
    (its bytes and layers) or not, and a warning that the sizes are the model's, not the disk's."""
    assert main(["info", "--checkpoint", str(mxfp4_dir)]) == 0
    complete = capsys.readouterr()
    assert "files: 12 of 12 present and complete" in complete.out and "warning" not in complete.err
    partial = tmp_path / "partial"
    shutil.copytree(mxfp4_dir, partial)
    (partial / "model-00004-of-000012.safetensors").unlink()  # write_published: one shard a layer
    truncated = partial / "model-00006-of-000012.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    assert main(["info", "--checkpoint", str(partial)]) == 0
    shown = capsys.readouterr()
    assert "2 of 12 files its index names are missing or incomplete" in shown.err
    assert "the sizes shown are the whole model's" in shown.err
    assert "files: 10 of 12 present and complete" in shown.out
    assert "holding layers 0-2, 4, 6-8, embedding, head, other tensors" in shown.out
    assert "model-00004-of-000012.safetensors: missing; it holds layers 3" in shown.out
    assert "model-00006-of-000012.safetensors: not a complete safetensors file (1KB); it holds layers 5" \
        in shown.out
    assert main(["info", "--checkpoint", str(partial), "--json"]) == 0
    files = {f["file"]: f for f in json.loads(capsys.readouterr().out)["checkpoint"]["files"]}
    assert files["model-00004-of-000012.safetensors"]["bytes"] is None
    assert files["model-00006-of-000012.safetensors"]["problem"] == "not a complete safetensors file"
    on_disk = {p.name: p.stat().st_size for p in partial.glob("*.safetensors")}
    assert {name: f["bytes"] for name, f in files.items() if f["bytes"] is not None} == on_disk
