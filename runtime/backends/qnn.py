"""Qualcomm's QNN execution provider (the onnxruntime-qnn plugin) for ONNX Runtime: sessions on the HTP backend with
CPU fallback disabled, one context binary of both graphs (EPContext models naming it, the weights stored once)
compiled at export and loaded at start, and the versions that compiled them. On x86_64 the plugin's HTP backend is an
emulator: the same graphs finalize and run there as on the NPU, but a weight-shared context of several graphs
crashes it on load (QNN 2.51: a null call in contextCreateFromBinary; ONNX Runtime's own tests load such contexts on
a device only), so there the graphs are compiled at start instead. onnxruntime and onnxruntime_qnn are imported only
here, only when used.
"""
from __future__ import annotations

import platform
import time
import warnings
from pathlib import Path

from cabinllm.runtime.errors import CheckpointError, ConfigError, Fix, Hint, MissingDependency
from cabinllm.runtime.formats.onnx_folder import OnnxFolder

QNN_EP = "QNNExecutionProvider"
INSTALL = "pip install onnxruntime-qnn (wheels for Linux x86_64 / aarch64 and Windows)"
# HTP architecture -> the precisions (cabinllm.builders.onnx_profiles.PRECISIONS) it runs: v68 has no floating point
# (ONNX Runtime's QNN tests skip fp16 on v68 and below), v73 computes float graphs in fp16
HTP_PRECISIONS = {68: ("a16w8",), 73: ("a16w8", "fp16")}
CONTEXT_SUFFIX = "_ctx.onnx"  # prompt.onnx -> prompt_ctx.onnx; the first graph's binary (prompt_ctx_qnn.bin) holds both
SHARED = ("both graphs in one QNN context (ep.share_ep_contexts at compile and load): QNN's HTP weight sharing "
          "stores the weights they both hold once")
_COMPATIBILITY_KEY = "ep_compatibility_info." + QNN_EP  # "v2:6:QNN:...:ARCH:..." in an EPContext model's metadata


def check_htp_arch(arch: int, precision: str) -> None:
    """ConfigError naming the choices when an HTP architecture is unknown or cannot run a precision."""
    if arch not in HTP_PRECISIONS:
        raise ConfigError(f"htp_arch {arch} is not one of {', '.join(map(str, HTP_PRECISIONS))}")
    if precision not in HTP_PRECISIONS[arch]:
        raise ConfigError(f"HTP v{arch} runs {' or '.join(HTP_PRECISIONS[arch])} graphs, not {precision} (it has no "
                          "floating point)", (Hint(Fix.EXPORT_PRECISION, HTP_PRECISIONS[arch][0]),))


def _modules():
    """onnxruntime and onnxruntime_qnn, the plugin registered; MissingDependency naming the install."""
    try:
        import onnxruntime as ort
        import onnxruntime_qnn
    except ModuleNotFoundError as err:
        raise MissingDependency(f"the QNN execution provider needs {err.name}, which is not installed; "
                                f"{INSTALL}") from err
    if not any(device.ep_name == QNN_EP for device in ort.get_ep_devices()):
        ort.set_default_logger_severity(3)  # errors only: the plugin warns about features of other platforms
        ort.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
    return ort, onnxruntime_qnn


def qnn_versions() -> dict[str, str]:
    """The versions of onnxruntime, onnxruntime-qnn and the QNN SDK it ships."""
    ort, qnn = _modules()
    return {"onnxruntime": ort.__version__, "onnxruntime_qnn": qnn.__version__,
            "qnn_sdk": qnn.build_and_package_info.qnn_version}


def _options(ort, htp_arch: int, threads: int | None, fallback: bool = False, **config: str):
    """Session options for the HTP backend of one architecture (CPU fallback disabled unless asked)."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if fallback else "1")
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    devices = [device for device in ort.get_ep_devices() if device.ep_name == QNN_EP]
    options.add_provider_for_devices(devices, {"backend_type": "htp", "htp_arch": str(htp_arch)})
    return options


def _cpu_nodes(ort, path: Path, htp_arch: int) -> list[str]:
    """The nodes of a graph ONNX Runtime would give the CPU beside the HTP."""
    options = _options(ort, htp_arch, None, fallback=True, **{"session.record_ep_graph_assignment_info": "1"})
    session = ort.InferenceSession(str(path), options)
    return [f"{node.name} ({node.op_type})" for sub in session.get_provider_graph_assignment_info()
            if sub.ep_name != QNN_EP for node in sub.get_nodes()]


def htp_session(path: Path, htp_arch: int, threads: int | None = None, **config: str):
    """An ONNX Runtime session of one graph on the HTP, nothing on the CPU; ConfigError naming the nodes that would
    need the CPU, CheckpointError when QNN cannot finalize the graph."""
    ort, _ = _modules()
    try:
        return ort.InferenceSession(str(path), _options(ort, htp_arch, threads, **config))
    except Exception as err:  # onnxruntime raises its own exception types
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "fallback" in message.lower():
            nodes = _cpu_nodes(ort, path, htp_arch)
            raise ConfigError(f"{path}: the HTP (QNN) does not take {len(nodes)} node(s), which would run on the CPU, "
                              f"and CPU fallback is disabled: {', '.join(nodes[:8])}"
                              + (" ..." if len(nodes) > 8 else ""), (Hint(Fix.EXPORT_PROFILE, "npu"),)) from err
        raise CheckpointError(f"{path}: QNN cannot compile it for HTP v{htp_arch} ({message})",
                              (Hint(Fix.EXPORT_PROFILE, "npu"),)) from err


def compile_context_binaries(folder: OnnxFolder, manifest: dict, htp_arch: int) -> dict:
    """Compile both graphs of a folder for an HTP architecture into one QNN context, the weights they both hold
    stored once: one session per graph with ``ep.share_ep_contexts``, the last with ``ep.stop_share_ep_contexts``,
    which writes the one context binary (embed mode off) that the EPContext model of each graph names; what the
    manifest records of them."""
    record = {"htp_arch": htp_arch, **qnn_versions(), "shared": SHARED, "context_graphs": {}, "compile_s": {}}
    last = list(manifest["graphs"])[-1]
    for key, name in manifest["graphs"].items():
        context = Path(name).stem + CONTEXT_SUFFIX
        start = time.perf_counter()
        htp_session(folder.path / name, htp_arch, **{"ep.context_enable": "1", "ep.context_embed_mode": "0",
                                                     "ep.context_file_path": str(folder.path / context),
                                                     "ep.share_ep_contexts": "1",
                                                     "ep.stop_share_ep_contexts": "1" if key == last else "0"})
        record["compile_s"][key] = round(time.perf_counter() - start, 2)
        record["context_graphs"][key] = context
    binaries = {name for context in record["context_graphs"].values() for name in _binaries(folder.path / context)}
    if len(binaries) != 1:
        raise CheckpointError(f"{folder.path}: the context models name the binaries {sorted(binaries)}, not one "
                              "shared binary", (Hint(Fix.EXPORT_HTP_ARCH, str(htp_arch)),))
    record["context_binary"] = binary = binaries.pop()
    record["binary_bytes"] = (folder.path / binary).stat().st_size
    record["weights_bytes"] = (folder.path / manifest["weights"]).stat().st_size  # one copy, as the graphs read it
    return record


def htp_emulated() -> bool:
    """Whether the plugin's HTP backend is the x86_64 emulator (not an NPU)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def compiled_arch(path: Path) -> int | None:
    """The HTP architecture an EPContext model was compiled for, from its metadata (None where it has none)."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    fields = props.get(_COMPATIBILITY_KEY, "").split(":")
    return int(fields[4]) if len(fields) > 4 and fields[4].isdigit() else None


def context_session(folder: OnnxFolder, manifest: dict, key: str, htp_arch: int | None, threads: int | None):
    """The session of a folder's graph on the HTP: from the compiled context binary where the export wrote one (no
    compile at start; the shared binary of both graphs loaded once, with ``ep.share_ep_contexts``; an older export's
    binary per graph alone), else the graph compiled now; on the x86_64 emulator, which cannot load a shared binary,
    the graph compiled now for the binary's architecture. Errors name a binary for another architecture or a missing
    context model or binary, of either graph."""
    compiled = manifest.get("qnn")
    if compiled is None:
        return htp_session(folder.path / manifest["graphs"][key], htp_arch or max(HTP_PRECISIONS), threads)
    arch = htp_arch or int(compiled["htp_arch"])
    for name in compiled["context_graphs"].values():  # both graphs' files before any session shares a context
        _check_context(folder, folder.path / name, int(compiled["htp_arch"]), arch)
    path = folder.path / compiled["context_graphs"][key]
    if "context_binary" not in compiled:  # exported before the shared context: a binary per graph
        return htp_session(path, arch, threads)
    if htp_emulated():
        session = htp_session(folder.path / manifest["graphs"][key], arch, threads)
        warnings.warn(f"{folder.path}: the HTP emulator (x86_64) cannot load the graphs' shared context binary "
                      f"{compiled['context_binary']} (a device loads it); compiled the graphs for HTP v{arch} at "
                      "start instead", RuntimeWarning, stacklevel=2)
        return session
    return htp_session(path, arch, threads, **{"ep.share_ep_contexts": "1"})


def _check_context(folder: OnnxFolder, path: Path, exported: int, arch: int) -> None:
    """CheckpointError when a context model or its binary is missing, ConfigError when it was compiled for another
    architecture than ``arch`` (the manifest's ``exported`` or the model's own compatibility info)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: the compiled context model is missing",
                              (Hint(Fix.EXPORT_HTP_ARCH, str(exported)),))
    built_for = compiled_arch(path)
    if arch != exported or (built_for is not None and built_for != arch):
        raise ConfigError(f"{folder.path}: compiled for HTP v{built_for or exported}, and this device is v{arch}",
                          (Hint(Fix.EXPORT_HTP_ARCH, str(arch)),))
    missing = [name for name in _binaries(path) if not (folder.path / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder.path / missing[0]}: the context binary is missing",
                              (Hint(Fix.EXPORT_HTP_ARCH, str(arch)),))


def _binaries(path: Path) -> list[str]:
    """The context binary files an EPContext model (embed mode off) names."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [attr.s.decode() for node in model.graph.node if node.op_type == "EPContext"
            for attr in node.attribute if attr.name == "ep_cache_context"]
