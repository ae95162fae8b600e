"""Build an engine folder: import the model, attach KV scales, plan, run trtllm-build where it can, write the manifest.

Everything is written into a temporary folder beside the output and renamed at the
end, so a failed build leaves nothing half-made. The same inputs again are a no-op
unless ``force``. The folder's layout is cabinllm.runtime.formats.engine_folder's.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cabinllm.builders.image_plan import CAMERA_FRAME
from cabinllm.builders.kv_attach import attach_kv_quant, quant_algo
from cabinllm.builders.manifest import changed_inputs, file_sha256, source_identity, tool_versions
from cabinllm.builders.planner import Plan, PlanRequest, working_plan
from cabinllm.builders.progress import Steps
from cabinllm.builders.scales_source import BuildScales, calibrated_scales, quick_scales, scales_from_file
from cabinllm.builders.targets import Backend, Target, get_target
from cabinllm.builders.trtllm import TrtllmInstall, build_args, find_trtllm, flag_set, local_sm, run_trtllm_build
from cabinllm.builders.vision_onnx import VISION_ONNX, export_vision_onnx, vision_engine_command
from cabinllm.builders.weight_build import (build_weight_format, check_equalize, check_head, head_checkpoint,
                                            needs_quantizing, quantize_step_text, quantized_checkpoint,
                                            refingerprint_scales, weights_record)
from cabinllm.runtime.errors import CheckpointError, ConfigError, ScalesError
from cabinllm.runtime.formats.atomic import atomic_write_text, clean_leftovers, staging_folder
from cabinllm.runtime.formats.checkpoint import ModelConfig, load_checkpoint, save_checkpoint
from cabinllm.runtime.formats.engine_folder import (CHECKPOINT_DIR, ENGINE_FORMAT, MANIFEST_FILE, SCALES_FILE,
                                                    TRT_ENGINE_DIR, TRTLLM_LOG_FILE, read_manifest)
from cabinllm.runtime.formats.scales_file import model_fingerprint
from cabinllm.runtime.sources.model_source import import_model, load_model_config, resolve_model
from cabinllm.runtime.model.audio import AUDIO_FOLDER
from cabinllm.runtime.model.vision import VISION_FOLDER, Vision
from cabinllm.runtime.sources.hf_vision import export_encoder, is_audio_folder, is_vision_folder

Log = Callable[[str], None]
GRAPHS_SUFFIX = "-graphs"  # an ONNX target's graph folder: the engine folder's name and this
DEFAULT_SYSTEM_PROMPT = (Path(__file__).parent / "data" / "system_prompt.txt").read_text(encoding="utf-8").strip()


@dataclass
class BuildRequest:
    """What cabin-build was asked for."""

    model: str
    output: Path
    kv_cache: str = "int8"
    dtype: str = "float16"
    force: bool = False
    target: str = "cpu"
    scales: Path | None = None
    equalize: bool = False
    reserve_gb: float | None = None
    calibrate: str | None = None  # dialogue data to calibrate on now: builtin, sharegpt or a file
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # the engine's default system prompt; "" for none
    weights: str = "fp16"  # weight format (cabinllm.runtime.formats.weight_formats): fp16 (as --dtype), int8, int4-awq
    max_beam_width: int = 1  # beams the TensorRT engine can search (trtllm-build --max_beam_width)
    head: str = "fp16"  # embedding and lm_head (cabinllm.runtime.formats.weight_formats.HEAD_FORMATS): fp16 or int8

    def command(self) -> str:
        """The cabin-build command line that makes this request."""
        args = ["cabin-build", "--model", self.model, "--target", self.target, "--kv-cache", self.kv_cache,
                "--dtype", self.dtype, "--output", str(self.output)]
        args += ["--weights", self.weights] if self.weights != "fp16" else []
        args += ["--max-beam-width", str(self.max_beam_width)] if self.max_beam_width != 1 else []
        args += ["--head", self.head] if self.head != "fp16" else []
        args += ["--scales", str(self.scales)] if self.scales else []
        args += ["--calibrate", self.calibrate] if self.calibrate else []
        args += ["--equalize"] if self.equalize else []
        args += ["--reserve-gb", str(self.reserve_gb)] if self.reserve_gb is not None else []
        args += ["--system-prompt", self.system_prompt] if self.system_prompt != DEFAULT_SYSTEM_PROMPT else []
        return shlex.join(args)


@dataclass
class DeviceStep:
    """What the target needs after the build: the TensorRT engine build (run here or left for the device), the
    ONNX graph export (cabin-export, pending), or nothing (reference engine)."""

    status: str  # "run here", "pending" or "not needed"
    reason: str
    flags: str | None  # trtllm-build flag set: "v0.12" or "1.x"


def build_engine(request: BuildRequest, log: Log = print) -> Path:
    """Write the engine folder for a request and return its path (untouched when already up to date)."""
    target = get_target(request.target)
    source = resolve_model(request.model)
    check_scales_options(request)
    if request.dtype not in ("float16", "float32"):
        raise CheckpointError(f"unknown --dtype {request.dtype!r}; choose float16 or float32")
    source_config = load_model_config(request.model)
    fmt = build_weight_format(request.weights, source_config)
    check_equalize(fmt, source_config, request.equalize)
    check_head(request.head, target)
    plan = checked_plan(request, target, fmt.name)
    trtllm = find_trtllm() if target.backend is Backend.TENSORRT else None
    inputs = build_inputs(request, target, source, trtllm)
    clean_leftovers(request.output)  # a killed build's staging folder; the old engine a killed replace moved aside
    if output_up_to_date(request.output, inputs, request.force):
        log(f"{request.output} is up to date (same inputs); pass --force to build it again")
        return request.output
    device = device_step(target, trtllm)
    quantize = needs_quantizing(fmt, source_config)
    head = request.head != "fp16"
    vision, audio = is_vision_folder(source), is_audio_folder(source)
    vision_graph = vision and target.backend is not Backend.REFERENCE  # the board runs the encoder from ONNX
    steps = Steps((5 if device.status == "run here" else 4) + quantize + head + vision + audio + vision_graph, log)
    started = time.perf_counter()
    with staging_folder(request.output) as tmp:
        checkpoint = tmp / CHECKPOINT_DIR
        with steps.step(f"importing {source.name} -> TensorRT-LLM checkpoint ({request.dtype})"):
            checkpoint.mkdir()
            import_model(source, checkpoint, dtype=request.dtype)
            config, weights = load_checkpoint(checkpoint)
            fingerprint = model_fingerprint(config, weights)
        if vision:
            with steps.step(f"writing the vision tower, projector and processor -> {VISION_FOLDER}/"):
                vision = export_encoder(source, tmp / VISION_FOLDER)
        if audio:
            with steps.step(f"writing the audio encoder, projector and processor -> {AUDIO_FOLDER}/"):
                audio = export_encoder(source, tmp / AUDIO_FOLDER)
        if vision_graph:
            with steps.step(f"exporting the vision encoder to ONNX for a {CAMERA_FRAME[0]}x{CAMERA_FRAME[1]} frame "
                            f"-> {VISION_FOLDER}/{VISION_ONNX}"):
                vision["onnx"] = export_vision_onnx(Vision(tmp / VISION_FOLDER), tmp / VISION_FOLDER)
            if target.backend is Backend.TENSORRT:  # TensorRT's own tool builds the encoder's engine on the board
                vision["onnx"]["device_command"] = vision_engine_command(VISION_FOLDER)
        with steps.step(scales_step_text(request)):
            kv = build_scales(request, config, weights, checkpoint, fingerprint, tmp / SCALES_FILE, log)
        weights, linears, tables = kv.weights, None, None
        if quantize:
            with steps.step(quantize_step_text(fmt, request.calibrate)):
                config, weights, linears = quantized_checkpoint(config, weights, fmt, checkpoint, request.calibrate,
                                                                source)
            if linears is not None:
                log(linears.summary("int4-g32 linear weights"))
        if head:
            with steps.step(f"storing the embedding and lm_head as {request.head} (the source's Q8_0 blocks as "
                            "stored, others rounded)"):
                config, weights, tables = head_checkpoint(config, weights, request.head, source)
            if tables is not None:
                log(tables.summary(f"{request.head} head"))
        with steps.step(f"writing the checkpoint with {fmt.quant_algo or config.dtype} weights and "
                        f"{quant_algo(request.kv_cache) or 'no'} KV cache quantization"):
            attach_kv_quant(config, weights, kv.scales, request.kv_cache)
            save_checkpoint(checkpoint, config, weights)
            if quantize or head:
                imported, fingerprint = fingerprint, model_fingerprint(config, weights)
                refingerprint_scales(tmp / SCALES_FILE, imported, fingerprint, config)
        trt_command = None
        failed_log = request.output.parent / f"{request.output.name}.{TRTLLM_LOG_FILE}"
        if device.status == "run here":
            with steps.step(f"trtllm-build ({trtllm.version}, {device.flags} flags) -> {TRT_ENGINE_DIR}/"):
                trt_command = run_trtllm_build(trtllm, build_args(plan.kv[request.kv_cache].shape, device.flags),
                                               tmp, failed_log)
        with steps.step("writing manifest.json"):
            scales_sha256 = file_sha256(tmp / SCALES_FILE)
            manifest = make_manifest(request, target, plan, source, fingerprint, kv, scales_sha256, device, trtllm,
                                     trt_command, inputs, time.perf_counter() - started)
            manifest["weights"] = weights_record(fmt, config, request.calibrate, quantize, linears, tables)
            if vision:
                manifest["vision"] = {**vision, "folder": VISION_FOLDER}
            if audio:
                manifest["audio"] = {**audio, "folder": AUDIO_FOLDER}
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
    failed_log.unlink(missing_ok=True)  # a failed earlier attempt's log is stale now
    log(f"engine written to {request.output} ({manifest['backend']} backend; device step: {device.status})")
    if target.backend is Backend.ONNX:
        log(f"next, the graphs for {target.name}: {shlex.join(manifest['device_step']['command'])}")
    return request.output


def check_scales_options(request: BuildRequest) -> None:
    """ScalesError when the scales options do not go together or the scales file is missing."""
    if request.scales is not None and not request.scales.is_file():
        raise ScalesError(f"{request.scales}: no such scales file; give a kv_scales.json from calibration")
    if request.scales is not None and request.calibrate is not None:
        raise ScalesError("give either --scales FILE or --calibrate DATA, not both")
    if request.equalize and request.scales is None and request.calibrate is None:
        raise ScalesError("--equalize needs calibrated per-channel ranges: add --calibrate builtin or "
                          "--scales kv_scales.json (version 2, from calibration)")


def build_scales(request: BuildRequest, config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path,
                 fingerprint: str, out: Path, log: Log = print) -> BuildScales:
    """The build's KV scales (written to ``out``) from --scales, --calibrate or the quick measurement."""
    if request.scales:
        return scales_from_file(request.scales, config, weights, fingerprint, request.equalize, out, log)
    if request.calibrate:
        return calibrated_scales(request.calibrate, config, weights, checkpoint, fingerprint, request.equalize, out)
    return quick_scales(config, weights, checkpoint, fingerprint, out)


def scales_step_text(request: BuildRequest) -> str:
    """What the KV scales step does, for the progress display."""
    if request.scales:
        text = f"reading KV scales from {request.scales} and checking them against the model's K/V range"
    elif request.calibrate:
        text = f"calibrating KV scales on {request.calibrate} dialogues"
    else:
        text = "measuring quick KV scales on sample dialogues"
    return text + (" and folding KV equalization into the weights" if request.equalize else "")


def checked_plan(request: BuildRequest, target: Target, weights: str = "fp16") -> Plan:
    """The memory plan for the requested KV dtype and weight format; PlanRefused (with the nearest working config)
    if it cannot work."""
    plan_request = PlanRequest(request.model, target, weights, request.reserve_gb, request.kv_cache,
                               request.max_beam_width, request.head)
    plan = working_plan(plan_request, load_model_config(request.model))
    if plan.cannot_build:
        raise ConfigError(f"--target {target.name}: {plan.cannot_build}")
    return plan


def build_inputs(request: BuildRequest, target: Target, source: Path, trtllm: TrtllmInstall | None) -> dict:
    """Everything the built folder depends on, as JSON data; equal records mean an identical build."""
    record = {
        "model": source_identity(source),
        "target": target.to_dict(),
        "kv_cache": request.kv_cache,
        "dtype": request.dtype,
        "reserve_gb": request.reserve_gb,
        "scales_sha256": file_sha256(request.scales) if request.scales else None,
        "equalize": request.equalize,
        "calibrate": request.calibrate,
        "system_prompt": request.system_prompt,
        "trtllm": [trtllm.executable, trtllm.version] if trtllm else None,
        "cabinllm": tool_versions(None)["cabinllm"],
    }
    if request.weights != "fp16":  # recorded only when asked, so engines built before the option stay up to date
        record["weights"] = request.weights
    if request.max_beam_width != 1:  # likewise
        record["max_beam_width"] = request.max_beam_width
    if request.head != "fp16":  # likewise
        record["head"] = request.head
    return json.loads(json.dumps(record))


def output_up_to_date(output: Path, inputs: dict, force: bool) -> bool:
    """True when ``output`` was built from the same inputs; FileExistsError when it holds something else."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return False
    manifest = read_manifest(output)
    if manifest is None:
        raise FileExistsError(f"{output} exists and is not an engine folder (no readable {MANIFEST_FILE}); "
                              "cabin-build does not replace it, even with --force: remove it or choose another "
                              "--output")
    if force:
        return False
    old = manifest.get("inputs") or {}
    if old == inputs:
        return True
    raise FileExistsError(f"{output} already holds an engine built from other inputs (differs in: "
                          f"{', '.join(changed_inputs(old, inputs))}); pass --force to replace it "
                          "or choose another --output")


def device_step(target: Target, trtllm: TrtllmInstall | None) -> DeviceStep:
    """Whether trtllm-build runs here: only for TensorRT targets, where it is installed and the GPU matches; ONNX
    targets take cabin-export's graphs next."""
    if target.backend is Backend.ONNX:
        return DeviceStep("pending", f"{target.name} runs static ONNX graphs: export them from this folder with "
                          f"cabin-export (on any machine), then run them on the board with cabin-chat --backend "
                          f"onnxruntime --ort-provider {target.npu.ort_provider}", None)
    if target.backend is not Backend.TENSORRT:
        return DeviceStep("not needed", f"{target.name} runs the reference engine", None)
    line_flags = flag_set(target.trtllm_line)
    if trtllm is None:
        return DeviceStep("pending", "trtllm-build is not installed here; run the command on the device", line_flags)
    sm = local_sm()
    if sm is not None and sm != target.sm:
        return DeviceStep("pending", f"this GPU is SM{sm} and {target.name} is SM{target.sm}: a TensorRT engine "
                          "only runs on the GPU it was built on; run the command on the device", line_flags)
    return DeviceStep("run here", f"trtllm-build {trtllm.version} at {trtllm.executable}", trtllm.flags)


def device_record(request: BuildRequest, target: Target, plan: Plan, device: DeviceStep,
                  trt_command: list[str] | None) -> dict:
    """The manifest's device step: trtllm-build in the engine folder, or for an ONNX target cabin-export of the
    planned graphs, and the cabin-chat command that runs the result."""
    kv_plan = plan.kv[request.kv_cache]
    what, cwd, then = "TensorRT engine build (trtllm-build)", "the engine folder", {}
    if kv_plan.graphs:
        graphs = f"{request.output}{GRAPHS_SUFFIX}"
        what, cwd = "ONNX graph export (cabin-export)", "the folder cabin-build ran in"
        command = ["cabin-export", *kv_plan.graphs.export_args(str(request.output), graphs)]
        then = {"then": shlex.split(kv_plan.graphs.chat_command(graphs))}
    else:
        args = build_args(kv_plan.shape, device.flags) if device.flags else None
        command = trt_command or (["trtllm-build", *args] if args else None)
        if command:  # run in the engine folder, as trtllm-build is
            then = {"then": ["cabin-chat", "--engine", ".", "--backend", "tensorrt-llm"]}
    return {"what": what, "status": device.status, "reason": device.reason,
            "run_on": f"{target.name}: {target.description}", "flags": device.flags, "cwd": cwd, "command": command,
            **then, "log": TRTLLM_LOG_FILE if trt_command else None,
            "engine_dir": TRT_ENGINE_DIR if trt_command else None}


def make_manifest(request: BuildRequest, target: Target, plan: Plan, source: Path, fingerprint: str,
                  kv: BuildScales, scales_sha256: str, device: DeviceStep, trtllm: TrtllmInstall | None,
                  trt_command: list[str] | None, inputs: dict, seconds: float) -> dict:
    """The manifest.json content."""
    warnings = list(plan.warnings)
    if trtllm and target.trtllm_line and trtllm.flags != flag_set(target.trtllm_line):
        warnings.append(f"TensorRT-LLM {trtllm.version} is installed here but {target.name} runs "
                        f"{target.trtllm_line}: an engine only runs with the version that built it")
    return {
        "format": ENGINE_FORMAT,
        "backend": "tensorrt" if trt_command else "reference",
        "target": target.name,
        "model": {"source": str(source), "architecture": plan.config.architecture, "fingerprint": fingerprint},
        "kv_cache": request.kv_cache,
        "kv_cache_quant_algo": quant_algo(request.kv_cache),
        "weights_dtype": request.dtype,
        "system_prompt": request.system_prompt or None,
        "kv_scales": {"file": SCALES_FILE, "method": kv.method, "source": kv.source,
                      "input_sha256": inputs["scales_sha256"], "sha256": scales_sha256},
        "equalization": {"enabled": kv.equalized},
        "plan": plan.to_json(),
        "build_command": request.command(),
        "device_step": device_record(request, target, plan, device, trt_command),
        "inputs": inputs,
        "build_seconds": round(seconds, 2),
        "versions": tool_versions(trtllm.version if trtllm else None),
        "warnings": warnings,
    }
