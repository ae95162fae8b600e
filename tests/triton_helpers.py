"""The Triton kernels for a test module: compiled on a GPU, else under Triton's interpreter on CPU tensors.

Triton decides at definition time whether a ``@triton.jit`` function (its own ``tl.max`` and ``tl.sum`` included)
is interpreted, reading ``TRITON_INTERPRET`` then; so the variable is set here before Triton is first imported, and a
module skips where Triton was imported earlier without it.

Triton 3.6's interpreter holds a kernel's scalars as numpy arrays of shape (1,) and turns one into a Python int (a
loop bound) with ``int(array)``, which numpy 2.4 refuses for arrays of one dimension; ``_index_scalars`` makes it
take the array's one element instead (the interpreter only: compiled kernels never see numpy).
"""
from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def triton_kernels() -> ModuleType:
    """``cabinllm.runtime.kernels.triton``'s kernels module; the calling module skips where Triton is missing or was
    imported without the interpreter on a machine without a GPU."""
    if not ON_GPU:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module", allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    if not ON_GPU:
        _index_scalars()
    from cabinllm.runtime.kernels.triton import load
    return load()


def _index_scalars() -> None:
    """Let the interpreter's one-element scalars serve as loop bounds under numpy 2.4 (see the module's note)."""
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "one_element_index", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.one_element_index = True
    interpreter._patch_lang_tensor = patched
