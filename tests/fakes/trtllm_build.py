"""A fake ``trtllm-build``: records its argv as JSON, checks the checkpoint, writes a dummy engine whose
``config.json`` has the ``build_config`` limits the flags set, as trtllm-build writes them.

Environment: ``FAKE_TRTLLM_ARGV`` (file to record argv in), ``FAKE_TRTLLM_FAIL`` (fail like a real
build error). Like TensorRT-LLM, it refuses INT8 KV with ``--use_paged_context_fmha enable``.
"""
import json
import os
import sys
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    Path(os.environ["FAKE_TRTLLM_ARGV"]).write_text(json.dumps({"argv": argv, "cwd": os.getcwd()}))
    args = dict(zip(argv[::2], argv[1::2]))
    print("[TensorRT-LLM] fake trtllm-build starting")
    config = json.loads((Path(args["--checkpoint_dir"]) / "config.json").read_text())
    kv_algo = config["quantization"]["kv_cache_quant_algo"]
    if kv_algo == "INT8" and args.get("--use_paged_context_fmha") == "enable":
        print("[TensorRT-LLM][ERROR] Paged Context FMHA doesn't work with int8 kv cache currently.")
        return 1
    if os.environ.get("FAKE_TRTLLM_FAIL"):
        print("[TensorRT-LLM][ERROR] out of memory while building the engine (fake failure)")
        return 1
    out = Path(args["--output_dir"])
    out.mkdir(parents=True)
    (out / "rank0.engine").write_bytes(b"fake engine")
    limits = ("max_batch_size", "max_beam_width", "max_input_len", "max_seq_len", "max_num_tokens")
    build_config = {name: int(args.get(f"--{name}", 1)) for name in limits}
    # --max_multimodal_len is the alias of --max_prompt_embedding_table_size, the BuildConfig field it sets
    # (tensorrt_llm/commands/build.py L137-144 at 008b2b8d: argparse's dest is the first long option)
    build_config["max_prompt_embedding_table_size"] = int(args.get("--max_multimodal_len",
                                                               args.get("--max_prompt_embedding_table_size", 0)))
    (out / "config.json").write_text(json.dumps({"kv_cache_quant_algo": kv_algo, "argv": argv,
                                                 "build_config": build_config}))
    print("[TensorRT-LLM] Total time of building all engines: 00:00:00")
    return 0


if __name__ == "__main__":
    sys.exit(main())
