"""A fake ``tensorrt_llm`` that only reports a version, taken from ``$FAKE_TRTLLM_VERSION``."""
import os

__version__ = os.environ["FAKE_TRTLLM_VERSION"]
