"""The builds of the native kernels the tests compare: this CPU's own (AVX-512 and VNNI where it has them), an
AVX2-only CPU's (8 lanes, no VNNI, as on AMD Zen 3) and the plain loops (-DGENERIC: other CPUs, ARM boards)."""
from __future__ import annotations

BUILDS: dict[str, dict[str, int]] = {"native": {}, "AVX2 only": {"NO_AVX512": 1, "NO_VNNI": 1}, "generic": {"GENERIC": 1}}
