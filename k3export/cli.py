"""The `k3export` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

from k3export.config import PRESETS, K3Config
from k3export.errors import UserError
from k3export.model.accounting import COMPONENTS, moe_cost_note, parameter_report
from k3export.options import (
    ANY_OUTPUT,
    BUILD_DIR,
    ENGINE_OR_BUILD,
    EXPORT_DIR,
    capacity,
    existing_dir,
    existing_file,
    integer,
    non_negative_int,
    output_path,
    positive_int,
    require_memory,
    seed,
)
from k3export.weights.checkpoint import CheckpointLayout, ShardFile, holdings, read_layout


def _add_model_source(parser: argparse.ArgumentParser, checkpoint: bool = False) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=list(PRESETS), help="a built-in configuration")
    source.add_argument("--config", metavar="PATH", type=existing_file,
                        help="an HF config.json (text_config is read)")
    if checkpoint:
        source.add_argument("--checkpoint", metavar="DIR", type=existing_dir,
                            help="safetensors weights with their config.json "
                            "(ours, or the published layout with the language model under language_model.)")


def _config(args: argparse.Namespace) -> K3Config:
    if getattr(args, "checkpoint", None):
        return K3Config.from_json(Path(args.checkpoint) / "config.json")
    return K3Config.from_json(args.config) if args.config else K3Config.from_preset(args.preset)


def _human(n: float, unit: str = "") -> str:
    """2.7795T parameters, 104.19B active; bytes as TB/GB/MB/KB."""
    billion = "G" if unit else "B"
    for scale, suffix in ((1e12, "T"), (1e9, billion), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.5g}{suffix}{unit}"
    return f"{n:.5g}{unit}"


def _checkpoint_files(layout: CheckpointLayout, shards: list[ShardFile]) -> list[str]:
    """What of the checkpoint is on disk, as lines: the files present and complete (bytes, layers
    held), each missing or incomplete one; warns when any is (export refuses the layers it holds)."""
    good = [f for f in shards if f.bytes is not None and not f.problem]
    bad = [f for f in shards if f not in good]
    layers = sorted({n for f in good for n in f.layers})
    other = sorted({o for f in good for o in f.other})
    lines = [f"files: {len(good)} of {len(shards)} present and complete, "
             f"{_human(sum(f.bytes for f in good), 'B')}, holding {holdings(layers, other)}"]
    for f in bad:
        state = "missing" if f.bytes is None else f"{f.problem} ({_human(f.bytes, 'B')})"
        lines.append(f"  {f.path.name}: {state}; it holds {f.holds()}")
    if bad:
        logging.getLogger("k3export").warning(
            f"checkpoint {layout.directory}: {len(bad)} of {len(shards)} files its index names are missing "
            "or incomplete; the sizes shown are the whole model's (from config.json), not what is on disk. "
            "A host holding only its stage's shards can export those layers (export --layers A:B); "
            "the other layers are refused until their files are there")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    config = _config(args)
    report = parameter_report(config)
    cache = report.cache(args.context)
    layout = read_layout(args.checkpoint) if args.checkpoint else None
    shards = layout.shard_files() if layout else []
    files = _checkpoint_files(layout, shards) if layout else []
    if args.json:
        print(json.dumps({
            "parameters": {"total": report.total, "active_per_token": report.active,
                           "by_component": report.params},
            "weight_bytes": {"all_in_model_dtype": report.weight_bytes,
                             "routed_experts_mxfp4": report.weight_bytes_mxfp4_experts},
            "decode_cache_bytes": cache,
            **({"checkpoint": {"published": layout.published, "language_model_tensors": len(layout.tensors),
                               "mxfp4_expert_matrices": layout.mxfp4_experts,
                               "skipped": dict(layout.skipped),
                               "files": [{"file": f.path.name, "bytes": f.bytes, "problem": f.problem,
                                          "layers": f.layers, "other": f.other} for f in shards]}}
               if layout else {}),
        }, indent=2))
        return 0
    if layout:
        print(layout.summary())
        print("\n".join(files))
        if layout.mxfp4_experts:
            print(f"its MXFP4 routed experts load dequantised to {config.torch_dtype} "
                  f"({_human(report.weight_bytes, 'B')} of weights in all), or kept packed with "
                  f"`export --packed-experts` ({_human(report.weight_bytes_mxfp4_experts, 'B')})")
    n_mla = len(config.mla_layers)
    print(f"{config.num_hidden_layers} layers: {config.num_hidden_layers - n_mla} KDA, {n_mla} MLA "
          f"(1-based {config.linear_attn_config.full_attn_layers}); weights {config.torch_dtype}")
    print(f"parameters: {_human(report.total)} total, {_human(report.active)} active per token "
          "(counting the LM head, not the embedding lookup)")
    for comp in COMPONENTS:
        print(f"  {comp:<20} {_human(report.params[comp]):>10}  {report.params[comp] / report.total:7.2%}")
    print(f"weights: {_human(report.weight_bytes, 'B')} in {config.torch_dtype}; "
          f"{_human(report.weight_bytes_mxfp4_experts, 'B')} with routed experts in MXFP4 (4.25 bits)")
    ratio = cache["plain_mha_per_token"] / cache["mla_latent_per_token"]
    print(f"decode cache per token: {_human(cache['mla_latent_per_token'], 'B')} MLA latent rows "
          f"({n_mla} x {config.latent_dim}); plain multi-head attention with the same head dims "
          f"would hold {_human(cache['plain_mha_per_token'], 'B')} ({ratio:.1f}x)")
    print(f"decode cache per sequence: KDA state {_human(cache['kda_state_per_sequence'], 'B')} (float32) "
          f"+ conv tails {_human(cache['kda_conv_per_sequence'], 'B')}, fixed; "
          f"{_human(cache['per_sequence_at_context'], 'B')} in all at {args.context} tokens")
    print(moe_cost_note(config))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from k3export.artifacts import EXPORT, OutputDir
    from k3export.model.parallel import check_rank
    from k3export.onnx.export import export_model, parse_layers
    from k3export.progress import spinner
    from k3export.weights.checkpoint import build_model

    out = OutputDir(args.out, EXPORT, overwrite=args.overwrite)
    config = _config(args)
    dtype_name = args.dtype or config.torch_dtype
    layers = parse_layers(args.layers, config)
    check_rank(config, args.rank, args.ranks)
    if args.seed is not None and (args.no_weights or args.checkpoint):
        source = "--no-weights" if args.no_weights else "--checkpoint"
        raise UserError(f"--seed with {source}: the seed draws random weights, and {source} has "
                        f"{'none' if args.no_weights else 'its own'}; expected one of them")
    if args.no_weights:
        weights: dict = {"stripped": True}
    elif args.checkpoint:
        weights = {"checkpoint": str(Path(args.checkpoint).resolve())}
    else:
        weights = {"seed": args.seed or 0}
    if args.packed_experts:
        if not (args.checkpoint or args.no_weights):
            raise UserError("--packed-experts: expected --checkpoint DIR with MXFP4 routed experts, or "
                            "--no-weights (the graph with MXFP4 expert inputs, at real shapes)")
        weights["packed_experts"] = True
    if not args.no_weights:  # (without weights the trace's inputs are on the meta device too)
        from k3export.shards.plan import layer_cache_bytes

        # The trace feeds example caches of 2 sequences at the capacity, and holds their outputs.
        cache = sum(layer_cache_bytes(config, i, args.capacity, getattr(torch, dtype_name).itemsize)
                    for i in layers)
        require_memory(4 * cache, f"--capacity {args.capacity}",
                       "the trace's example caches, 2 sequences at that capacity, and their outputs")
    print(f"building the eager model: layers {layers.start}..{layers.stop - 1} of "
          f"{config.num_hidden_layers}, {dtype_name}, weights {weights}")
    model = build_model(config, getattr(torch, dtype_name), weights, layers, log=print, rank=args.rank,
                        ranks=args.ranks)
    print(f"exporting to {out.path} (torch.export, then ONNX translation; minutes for large models)")
    with out.staged() as stage, spinner("export: torch.export, then the ONNX translation"):
        manifest = export_model(model, stage, layers, weights, aot_plugins=args.aot_plugins,
                                capacity=args.capacity, last_logits=args.last_logits, taps=args.taps,
                                routing_outputs=args.routing_outputs)
    nodes = manifest["custom_nodes"]
    size = sum(record["bytes"] for record in out.manifest["files"].values())
    held = "no weights (they are graph inputs)" if args.no_weights else "with weights"
    counts = ", ".join(f"{count} {op}" for op, count in nodes.items())
    print(f"wrote {out.path / manifest['graph']}: {counts} nodes, opset {manifest['opset']}, "
          f"{_human(size, 'B')} {held}; inputs/outputs in export.json")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from k3export.check.driver import run_check

    extra = {"taps": True} if args.taps else {}
    if args.speculate:
        extra["speculate"] = args.speculate
    if args.stage is not None and not args.build:
        raise UserError("--stage: expected --build DIR (one stage of a sharded build, with all its ranks)")
    if args.runner and not args.build:
        raise UserError("--runner: expected --build DIR (a build's engines, or its ONNX graphs on CPU); "
                        "--engine FILE always runs the engine, --onnx DIR ONNX Runtime")
    if args.kernels:
        if not args.network:
            raise UserError("--kernels: expected --network DIR (the parsed network's plugin layers then "
                            "launch their Triton kernels under the interpreter)")
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("--kernels: triton was imported before TRITON_INTERPRET=1 could be set; "
                            "run with TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (parse_network)
        extra["kernels"] = True
    if args.network:
        from k3export.check.runners.network import run_network_check
        run = run_network_check
    elif args.engine:
        from k3export.check.runners.engine import run_engine_check
        run = run_engine_check
    elif args.build:
        from k3export.check.runners.chain import run_build_check
        run = run_build_check
        extra["runner"] = args.runner
        extra["stage"] = args.stage
    else:
        run = run_check
    if args.report:
        from k3export.check.report import report_dir, write_report
        out = report_dir(args.report)  # refused before the check runs, not after
        checked = Path(args.network or args.engine or args.build or args.onnx)
        if out.path.resolve().is_relative_to(checked.resolve()):
            raise UserError(f"--report {out.path}: inside {checked}, the artifact being checked; expected a "
                            "folder outside it. Nothing was changed")
    report = run(args.network or args.engine or args.build or args.onnx, steps=args.steps, seed=args.seed,
                 batch=args.batch, prompt_len=args.prompt_len, log=(lambda _: None) if args.json else print,
                 eager=args.eager, **extra)
    from k3export.check.machine import machine_line

    verdict = _check_verdict(report)
    if args.report:
        kind = next(a for a in ("network", "engine", "build", "onnx") if getattr(args, a))
        artifact = f"--{kind} {getattr(args, kind)}"
        write_report(report, out, verdict, artifact)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["passed"] else 1
    if args.taps:
        from k3export.check.taps import summary_lines
        print("\n".join(summary_lines(report["taps"])))
    if args.build:
        from k3export.check.runners.chain import stage_lines
        print("\n".join(stage_lines(report)))
    print(machine_line(report["machine"]))
    if "speculation" in report:
        spec = report["speculation"]
        print(f"speculation: {spec['calls']} calls, {spec['accepted']} of {spec['drafted']} drafts accepted; "
              f"its tokens are the artifact's plain greedy ones: {spec['streams_identical']}")
    print(verdict)
    if args.report:
        print(f"report: {out.path / 'report.md'}, plots layers.png and steps.png beside it")
    if "polygraphy_command" in report:
        print(f"replay the prefill comparison: {report['polygraphy_command']}")
    return 0 if report["passed"] else 1


def _check_verdict(report: dict) -> str:
    """PASSED or FAILED with every reason, then the bound and the token agreement."""
    from k3export.check.compare import HALF_REL_CAP

    reasons = [report["compared_nothing"]] if report.get("compared_nothing") else []
    if report.get("first_nonfinite"):
        first = report["first_nonfinite"]
        reasons.append(f"NaN/Inf first in {', '.join(first['outputs'])} at {first['step']}")
    if report["failed_outputs"]:
        reasons.append(", ".join(report["failed_outputs"]))
    if report.get("ranks_differ"):
        reasons.append("replicated outputs differ from rank 0's: " + ", ".join(report["ranks_differ"]))
    if report["token_mismatches"]:
        reasons.append(f"{report['token_mismatches']} greedy tokens differ past the tie margin")
    bound = report["tolerance"]["rel"]
    if report["dtype"] != "float32":
        bound = f"min({max(bound, HALF_REL_CAP)}, max({bound}, 2x the eager float32 spread))"
    held = ""
    if report.get("held_routing"):
        held = (f"; eager held to the graph's expert choices, {report['routing_flips']} token-layer choices "
                "of its own differed")
    tokens = (f"greedy streams identical: {report['greedy_streams_identical']}; token mismatches "
              f"{report['token_mismatches']}, ties {report.get('token_ties', '-')} of "
              f"{report.get('token_positions', '-')} positions")
    return (("PASSED" if report["passed"] else "FAILED: " + "; ".join(reasons))
            + f" ({report['dtype']}, relative error <= {bound}{_headroom_text(report)}; {tokens}{held})")


def _headroom_text(report: dict) -> str:
    """How close the run came to each threshold (1.0 is the threshold itself)."""
    room = report.get("headroom", {})
    parts = []
    if "relative_error" in room:
        worst = room["relative_error"]
        parts.append(f"worst {worst['output']} at {worst['ratio']:.2f} of its bound")
    if room.get("tie_gap", {}).get("ratio"):
        parts.append(f"widest disagreement at {room['tie_gap']['ratio']:.2f} of the tie margin")
    return f"; {', '.join(parts)}" if parts else ""


def cmd_build(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from k3export.artifacts import OutputFile, verify
    from k3export.engine.build import Limits, build_engine, profile_shapes
    from k3export.engine.flavours import FLAVOURS, load_tensorrt, require_machine, target_problem
    from k3export.onnx.export import MANIFEST_FILE

    if args.recipe and args.onnx:
        raise UserError(f"build {args.recipe} --onnx {args.onnx}: expected --onnx DIR (one export) or a "
                        "RECIPE (every pipeline stage), not both")
    # One engine's profile sizes; a recipe's [profiles] size its engines: not silently ignored.
    profile_sizes = [option for option, value in (("--max-batch", args.max_batch),
                                                  ("--max-seq", args.max_seq),
                                                  ("--decode-batch", args.decode_batch),
                                                  ("--verify-seq", args.verify_seq)) if value is not None]
    if args.recipe:
        if profile_sizes:
            raise UserError(f"build {args.recipe} {profile_sizes[0]}: expected --onnx DIR with it (a "
                            "recipe's engines take their shapes from its [profiles])")
        from k3export.shards.stages import cmd_build_recipe
        return cmd_build_recipe(args)
    if not args.onnx:
        raise UserError("build: expected --onnx DIR (one export) or a RECIPE (every pipeline stage)")
    # What selects a recipe's stages and how they are exported means nothing to one export's engine.
    recipe_only = [option for option, given in (("--no-weights", args.no_weights), ("--stage", args.stage),
                                                ("--rank", args.rank is not None)) if given]
    if recipe_only:
        raise UserError(f"build {recipe_only[0]}: expected a RECIPE (it chooses what a recipe's build "
                        "exports); --onnx DIR builds one engine from one export as it is")
    if args.taps:
        raise UserError("build --taps: expected a RECIPE (its stages are exported with taps); an engine "
                        "from --onnx DIR has the export's outputs: export it with `k3export export --taps`")
    if args.routing_outputs:
        raise UserError("build --routing-outputs: expected a RECIPE (its stages are exported with them); an "
                        "engine from --onnx DIR has the export's outputs: export it with `k3export export "
                        "--routing-outputs`")

    if args.backend == "onnx":
        raise UserError(f"build --onnx DIR --backend onnx: an export is already ONNX; expected --backend "
                        f"{' or '.join(FLAVOURS)}")
    flavour = FLAVOURS[args.backend or "tensorrt-rtx"]
    target = ("sm89" if flavour.targets else None) if args.target is None else args.target
    if target is None:
        raise UserError(f"build --backend {flavour.backend}: expected --target (the GPU in this machine, "
                        "such as sm90 for H100/H200 or sm100 for B200)")
    problem = target_problem(flavour, target)
    if problem:
        raise UserError(f"build --backend {flavour.backend} --target {target or repr(target)}: "
                        f"expected {problem}")
    require_machine(flavour, target, strip=args.strip)
    out = OutputFile(args.out, "build", overwrite=args.overwrite)
    max_batch = args.max_batch or Limits.prefill_batch
    limits = Limits(max_batch, args.max_seq or Limits.prefill_seq, args.decode_batch or max_batch,
                    args.verify_seq or 0)
    # Verified and the limits refused before the engine's record is begun (build_engine's are then cheap).
    profile_shapes(verify(args.onnx, MANIFEST_FILE), limits)
    verify_profile = f", verify batch 1..{limits.decode_batch} x seq 1..{limits.verify_seq}" \
        if limits.verify_seq else ""
    print(f"building a {flavour.title} engine for {target} from {args.onnx} with the k3 plugins "
          f"(profiles: prefill batch 1..{limits.prefill_batch} x seq 1..{limits.prefill_seq}, decode batch "
          f"1..{limits.decode_batch} x 1{verify_profile}; the export's cache capacity)")
    out.begin()
    result = build_engine(args.onnx, args.out, load_tensorrt(flavour.backend), target=target, limits=limits,
                          strip=args.strip)
    out.finish({"export": str(Path(args.onnx).resolve()), "backend": result.backend, "target": result.target,
                "stripped": result.stripped,
                "profiles": result.profiles, "device_memory": result.device_memory,
                "network": asdict(result.network)})
    plugins = result.network.plugin_layers
    print(f"wrote {result.engine}: {_human(result.bytes, 'B')} in {result.seconds:.1f} s; "
          f"{result.network.layers} layers, {len(plugins)} k3 plugin layers")
    print(f"its record (profiles, device memory per profile, network census, sha256): {out.record_path}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from k3export.artifacts import MANIFEST_NAMES, verify
    from k3export.runtime import BUILD_MANIFEST, verify_build

    folder = Path(args.dir)
    names = [n for n in MANIFEST_NAMES if (folder / n).exists()]
    if not names:
        raise UserError(f"{folder}: no k3export manifest ({', '.join(MANIFEST_NAMES)}); expected a folder "
                        "that `k3export export`, `build` or `check` wrote")
    for name in names:
        if name == BUILD_MANIFEST:  # stage by stage, rank by rank: a problem names the stage and rank
            manifest = verify_build(folder, full=True)
        else:
            manifest = verify(folder, name, full=True)
        size = sum(record["bytes"] for record in manifest["files"].values())
        print(f"{folder / name}: {len(manifest['files'])} files, {_human(size, 'B')}, every sha256 matches")
    return 0


# The demo's eager prefill holds attention scores of prompt_len^2 per head: it stays a demonstration.
DEMO_TOKENS = integer(1, 4096)


def cmd_demo(args: argparse.Namespace) -> int:
    """The eager model, then the pipeline on it: export (with taps), check in ONNX Runtime with a
    report, and when TensorRT-RTX is there check the parsed network and build."""
    import importlib.util

    from k3export.artifacts import EXPORT, REPORT, OutputDir, OutputFile, identify
    from k3export.demo import run_demo

    # Each command's output where a rerun expects it: the export folder holds only the export (and
    # check's own check/), the report, the engine and its record sit beside it. Each is refused
    # before the demo starts unless it is new or the demo's own.
    out = Path(args.out)
    export = out / "export"
    found = identify(out)
    if found:
        raise UserError(f"--out {out}: is {found.describe()}; expected a new folder, or one a previous demo "
                        "wrote (export/, report/ and the engine in it). Nothing was changed")
    OutputDir(export, EXPORT)
    OutputDir(out / "report", REPORT, overwrite=None, option="--report")
    OutputFile(out / "k3-tiny.sm89.engine", "build")
    code = run_demo(args.seed, args.prompt_len, args.steps)
    stages = [["export", "--preset", "k3-tiny", "--seed", str(args.seed), "--taps", "--out", str(export)],
              ["check", "--onnx", str(export), "--steps", str(args.steps), "--taps",
               "--report", str(out / "report")]]
    if importlib.util.find_spec("tensorrt_rtx"):
        # The network evaluator is slower than ONNX Runtime: fewer steps keep the demo short.
        stages += [["check", "--network", str(export), "--steps", str(min(args.steps, 4))],
                   ["build", "--onnx", str(export), "--out", str(out / "k3-tiny.sm89.engine"),
                    "--max-seq", "128"]]
    else:
        print("(TensorRT-RTX is not installed: `pip install -c constraints.txt -e '.[engine]'` "
              "adds the network check and the build)")
    for stage in stages:
        if code:
            break
        print(f"\n$ k3export {' '.join(stage)}", flush=True)
        code = main(stage)
    return code


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (they are shown only when stderr is a terminal anyway)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3export", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="print the traceback of input errors too")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorRT's own warnings and info (otherwise counted in one line)")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameters, active parameters, cache and weight bytes")
    _add_model_source(info, checkpoint=True)
    info.add_argument("--context", type=positive_int, default=131072,
                      help="tokens for the per-sequence cache")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=cmd_info)

    export = sub.add_parser("export", help="the model (or a layer range) as one ONNX graph")
    _add_model_source(export, checkpoint=True)
    export.add_argument("--seed", type=seed, help="seeded random weights (default 0; not with --checkpoint "
                        "or --no-weights)")
    export.add_argument("--out", required=True, metavar="DIR", type=output_path,
                        help="a new or empty folder, or one a previous export wrote (it is replaced)")
    export.add_argument("--overwrite", action="store_true",
                        help="write into a folder that holds other files too (they are kept)")
    export.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="default: the config's torch_dtype")
    export.add_argument("--layers", metavar="A:B", help="0-based layer range [A, B); default all")
    export.add_argument("--no-weights", action="store_true",
                        help="the graph alone at real shapes: weights stay on the meta device and "
                             "become named graph inputs; nothing to check numerically")
    export.add_argument("--packed-experts", action="store_true",
                        help="keep the checkpoint's MXFP4 routed experts packed in the eager model "
                        "(4.25 bits a weight in memory); the ONNX file holds them packed too (their bytes "
                        "as int32 words), dequantised by the graph. With --no-weights: MXFP4 expert inputs")
    export.add_argument("--aot-plugins", action="store_true",
                        help="mark every k3 node aot=1: full TensorRT with k3plugins.trt_aot then builds "
                             "the plugins' AOT forms (PTX in the engine, no Python at run time); "
                             "TensorRT-RTX and ONNX Runtime ignore it")
    export.add_argument("--capacity", type=capacity, default=4096,
                        help="tokens the MLA cache holds per sequence (a static dimension of the graph)")
    export.add_argument("--last-logits", action="store_true",
                        help="logits [batch, vocab] at each row's last valid token instead of every position")
    export.add_argument("--taps", action="store_true",
                        help="add each layer's mixer and FFN outputs and AttnRes partial after it as outputs "
                        "taps.{layer}.{mixer,ffn,partial}, for `check --taps` to localise a divergence")
    export.add_argument("--routing-outputs", action="store_true",
                        help="add check's outputs: each MoE layer's chosen experts routing.{layer} (check "
                        "holds the eager routers to them, so that a half-precision engine can be checked) "
                        "and, with --ranks, each all-reduce's input partial.{n} (the rank's partial sum, "
                        "for check --build to name a wrong rank); such a checking engine is not "
                        "byte-identical to the served one, which needs none")
    export.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                        help="split every layer over N GPUs (tensor-parallel heads, expert-parallel experts; "
                             "k3export/model/parallel.py) and export one rank's graph, with DistCollective "
                             "nodes")
    export.add_argument("--rank", type=non_negative_int, default=0, metavar="R",
                        help="the rank to export, 0 <= R < N")
    _add_quiet(export)
    export.set_defaults(run=cmd_export)

    from k3export.options import AUTO, EAGER_MODES
    from k3export.runtime.engines import RUNNERS

    check = sub.add_parser("check", help="an artifact (an export, its network, an engine, a build) against "
                           "the eager model")
    artifact = check.add_mutually_exclusive_group(required=True)
    artifact.add_argument("--onnx", metavar="DIR", type=EXPORT_DIR,
                          help="a `k3export export` folder, in ONNX Runtime")
    artifact.add_argument("--network", metavar="DIR", type=EXPORT_DIR, help="a `k3export export` folder, "
                          "parsed by "
                          "TensorRT-RTX (k3 plugins registered) and the network evaluated on CPU")
    artifact.add_argument("--engine", metavar="FILE", type=ENGINE_OR_BUILD,
                          help="an engine `k3export build` wrote (or a `build "
                          "RECIPE` folder: every stage's engine alone), through the engine runner; needs an "
                          "NVIDIA GPU and TensorRT, so it cannot run on CPU-only machines")
    artifact.add_argument("--build", metavar="DIR", type=BUILD_DIR,
                          help="a `k3export build RECIPE` folder: its stages (their engines, or their ONNX "
                          "graphs in ONNX Runtime: --runner) chained against the eager model run as the "
                          "same chain, compared at every stage boundary; names the first divergent stage "
                          "(and rank)")
    check.add_argument("--runner", choices=RUNNERS, help="with --build: the build's TensorRT engines (on "
                       "GPUs; the default when it has them) or its ONNX graphs in ONNX Runtime (CPU)")
    check.add_argument("--stage", metavar="I", type=non_negative_int,
                       help="with --build: stage I alone (all its ranks, one a GPU), against the eager model "
                       "of its layers, its input boundary computed by the eager model of the layers before")
    check.add_argument("--eager", choices=EAGER_MODES, default=AUTO,
                       help="how the eager side runs: streamed (one layer's weights at a time, over every "
                       "step), in-memory (one stage's), or auto (in-memory when its weights take at most "
                       "half of the memory available)")
    check.add_argument("--steps", type=non_negative_int, default=16,
                       help="greedy decode steps after the prefill")
    check.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    check.add_argument("--batch", type=positive_int, default=2)
    check.add_argument("--prompt-len", type=positive_int, default=70)
    check.add_argument("--speculate", type=positive_int, metavar="K",
                       help="after the prefill, the artifact's speculative decoding with up to K drafts a "
                       "call (drafts from its own greedy tokens, rejected at moving places): every verify "
                       "and rollback compared")
    check.add_argument("--json", action="store_true")
    check.add_argument("--kernels", action="store_true", help="with --network: plugin layers launch their "
                       "Triton kernels under the interpreter (slow) instead of the reference ops")
    check.add_argument("--report", metavar="DIR", type=output_path,
                       help="write report.json (every number), report.md (the verdict, worst outputs, first "
                       "divergent layer, token agreement) and plots of the error per layer and per step "
                       "into DIR")
    check.add_argument("--taps", action="store_true",
                       help="compare an `export --taps` export's per-layer taps too: per layer the relative "
                       "error and cosine of the mixer and FFN outputs and the AttnRes partial, and the first "
                       "layer and sublayer whose error leaves its envelope")
    _add_quiet(check)
    check.set_defaults(run=cmd_check)

    from k3export.engine.build import Limits

    build = sub.add_parser("build", help="a TensorRT(-RTX) engine from an export, k3 plugins in place")
    build.add_argument("--onnx", metavar="DIR", type=EXPORT_DIR, help="a `k3export export` folder")
    build.add_argument("--out", required=True, metavar="FILE", type=output_path,
                       help="the engine file to write, FILE.json beside it recording how it was built (with "
                       "RECIPE: the folder of the stages and their manifest.json)")
    build.add_argument("--target", metavar="SM", help="compute capability: TensorRT-RTX's sm75, sm80, "
                       "sm86, sm89 (default), sm120, sm121; full TensorRT: this machine's GPU (sm90, "
                       "sm100, ...); with RECIPE: instead of its [build] target")
    build.add_argument("--max-batch", type=positive_int, help="sequences per prefill call (and per decode "
                       f"call unless --decode-batch; default {Limits.prefill_batch}); with --onnx")
    build.add_argument("--max-seq", type=positive_int,
                       help=f"prefill tokens per call (default {Limits.prefill_seq}); with --onnx")
    build.add_argument("--decode-batch", type=positive_int, metavar="N",
                       help="sequences per decode call; with --onnx")
    build.add_argument("--verify-seq", type=positive_int, metavar="N",
                       help="a verify profile too: --decode-batch sequences x N tokens (run --speculate K's "
                       "calls: N = 3K + 1, a call after rejections re-feeding tokens and drafting up to K); "
                       "with --onnx")
    build.add_argument("--strip", action="store_true",
                       help="weight-stripped engines (STRIP_PLAN, REFIT_IDENTICAL): the engine file holds no "
                       "weights; loading refits it from its export's model.onnx. Needs a GPU where it builds")
    from k3export.shards.stages import add_build_arguments
    add_build_arguments(build)
    _add_quiet(build)
    build.set_defaults(run=cmd_build)

    from k3export.shards.plan import add_parser as add_plan_parser
    add_plan_parser(sub)
    from k3export.runtime import add_parser as add_run_parser
    add_run_parser(sub)

    verify = sub.add_parser("verify", help="hash every file of an output folder against its manifest")
    verify.add_argument("dir", metavar="DIR", type=ANY_OUTPUT)
    verify.set_defaults(run=cmd_verify)

    demo = sub.add_parser("demo", help="k3-tiny with seeded weights: eager prefill and decode, then export, "
                                       "check (ONNX Runtime with a report, the parsed network) and build")
    demo.add_argument("--seed", type=seed, default=0)
    demo.add_argument("--prompt-len", type=DEMO_TOKENS, default=80, help="1..4096 (an eager prefill)")
    demo.add_argument("--steps", type=DEMO_TOKENS, default=8, help="decode steps, 1..4096")
    demo.add_argument("--out", default="out/demo", metavar="DIR", type=output_path,
                      help="where the export (DIR/export) and the engine go")
    demo.set_defaults(run=cmd_demo)
    return parser


class _StderrHandler(logging.Handler):
    """Warnings as `k3export: warning: ...` on whatever sys.stderr is when they are emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.flush()  # after the lines printed before it, under `2>&1 | cat` too
        print(f"k3export: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done (a check passed), 1 a check failed, 2 bad input (one message naming the
    culprit; --debug adds the traceback), 3 an internal error (a bug: its traceback is printed)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its message (a refused option value: 2; --help: 0)
        return e.code if isinstance(e.code, int) else 2
    from k3export.progress import set_quiet
    set_quiet(getattr(args, "quiet", False))
    if not logging.getLogger("k3export").handlers:
        logging.getLogger("k3export").addHandler(_StderrHandler())
    logging.getLogger("k3export").setLevel(logging.DEBUG if args.verbose else logging.NOTSET)
    _tensorrt_held_back().clear()
    started = time.perf_counter()
    try:
        code = args.run(args)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"k3export: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3export: interrupted; nothing unfinished was left at a final name", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout stopped (`k3export plan ... | head`): as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 128 + signal.SIGPIPE
    except Exception:
        traceback.print_exc()
        print(f"k3export: internal error in `{args.command}` (a bug in k3export, not in your input): "
              "please report it with the traceback above", file=sys.stderr)
        return 3
    sys.stdout.flush()  # the command's lines before the notes below, under `2>&1 | cat` too
    held = _tensorrt_held_back()
    if held:
        print(f"(TensorRT: {held['warning']} warnings, {held['info']} info messages held back; "
              f"`k3export --verbose {args.command} ...` shows them)", file=sys.stderr)
    if not getattr(args, "json", False):
        print(f"({args.command} took {time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return code


def _tensorrt_held_back() -> Counter:
    """TensorRT's messages held back in this process (k3export.engine.trt_log), or none: that module
    is loaded only by the commands that use TensorRT."""
    module = sys.modules.get("k3export.engine.trt_log")
    return module.held_back if module else Counter()


if __name__ == "__main__":
    sys.exit(main())
