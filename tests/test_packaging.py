"""Packaging: the folders runtime/, calibration/, builders/, server/, cli/, benchmarks/ ship only as ``cabinllm.*``.

Guards that pyproject's ``packages`` list matches the folders with an ``__init__.py``; that the built wheel holds
every package, its package data and working entry points, and nothing at the top level but ``cabinllm``; that the
wheel's files work on their own (kernel sources, target profiles, the built-in dialogue set found through
importlib.resources); and that none of our folders is importable under its bare name, where it would shadow
another project's top-level package (onnxruntime-genai's model builder imports its own ``builders``).
"""
from __future__ import annotations

import ast
import configparser
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
BARE_NAMES = ("runtime", "builders", "calibration", "server", "benchmarks", "cli")
FORBIDDEN_TOP_LEVEL = (*BARE_NAMES, "tests")
REQUIRED_DATA = ("cabinllm/builders/data/targets.toml", "cabinllm/builders/data/system_prompt.txt")
# what a copy of the tree for the build leaves out: environments, history, build outputs, caches, engines
COPY_IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "out", "engines", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".hypothesis")


def _source_packages() -> dict[str, Path]:
    """Every folder with an ``__init__.py`` under the mapped folders, by its ``cabinllm.*`` name."""
    found: dict[str, Path] = {}
    for name, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found[".".join((name, *rel.parts))] = init.parent
    return found


def _wheel_path(package: str) -> str:
    """The folder of a ``cabinllm.*`` package inside the wheel."""
    return package.replace(".", "/")


def _package_data() -> list[str]:
    """The wheel paths of every source file that pyproject's package-data patterns select."""
    packages = _source_packages()
    return sorted(f"{_wheel_path(package)}/{path.relative_to(packages[package]).as_posix()}"
                  for package, patterns in SETUPTOOLS["package-data"].items()
                  for pattern in patterns for path in packages[package].glob(pattern) if path.is_file())


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH, so that a subprocess sees the venv as installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run_python(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The venv's Python with ``args``, from ``cwd``, its output captured."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_packages_list_matches_the_folders() -> None:
    assert sorted(SETUPTOOLS["packages"]) == sorted(_source_packages())
    for name, folder in PACKAGE_DIR.items():
        assert name.startswith("cabinllm."), name
        assert (ROOT / folder / "__init__.py").is_file(), f"package-dir {name} -> {folder}: no such package"
    unmapped = {p.parent.name for p in ROOT.glob("*/__init__.py")} - set(PACKAGE_DIR.values())
    assert not unmapped, f"top-level packages not in package-dir: {sorted(unmapped)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once from a clean copy of the tree.

    pip builds a local folder in place, and setuptools' build/lib keeps files that have since been deleted, so a
    wheel built in the shared tree could hold stale modules; a copy also leaves the tree untouched.
    """
    work = tmp_path_factory.mktemp("wheel-build")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE)
    out = work / "dist"
    result = _run_python(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                          str(source)], cwd=work, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("cabinllm-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    """The file names inside the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_wheel_holds_every_package(wheel_names: set[str]) -> None:
    for package in _source_packages():
        assert f"{_wheel_path(package)}/__init__.py" in wheel_names, package


def test_wheel_holds_the_package_data(wheel_names: set[str]) -> None:
    data = _package_data()
    kernels = [name for name in data if name.startswith("cabinllm/runtime/kernels/")]
    assert any(name.endswith(".c") for name in kernels) and any(name.endswith(".h") for name in kernels)
    assert any(name.startswith("cabinllm/calibration/data/") and name.endswith(".jsonl") for name in data)
    missing = sorted((set(data) | set(REQUIRED_DATA)) - wheel_names)
    assert not missing, f"package data missing from the wheel: {missing}"


def test_wheel_has_only_cabinllm_at_the_top(wheel_names: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_names}
    assert not tops & set(FORBIDDEN_TOP_LEVEL), sorted(tops)
    assert {top for top in tops if not top.endswith(".dist-info")} == {"cabinllm"}


def test_entry_points_name_modules_in_the_wheel(wheel: Path, wheel_names: set[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (entry_file,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_file).decode("utf-8"))
        scripts = dict(parser["console_scripts"])
        assert scripts == PYPROJECT["project"]["scripts"]
        for script, target in scripts.items():
            module, _, function = target.partition(":")
            assert module.startswith("cabinllm."), f"{script} = {target}"
            file = f"{_wheel_path(module)}.py"
            assert file in wheel_names, f"{script} = {target}: {file} is not in the wheel"
            tree = ast.parse(archive.read(file))
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            assert function in defined, f"{script} = {target}: no top-level {function}() in {file}"


WHEEL_ONLY_CHECK = """
import json, sys
from importlib import resources
from pathlib import Path
unpacked, site_dirs = Path(sys.argv[1]), sys.argv[2:]
sys.path[:0] = [str(unpacked)]
sys.path.extend(site_dirs)
import cabinllm.runtime.kernels
from cabinllm.builders.targets import load_targets
from cabinllm.calibration.sources import builtin_path, open_source
dialogues, _ = open_source("builtin")
print(json.dumps({
    "kernels": cabinllm.runtime.kernels.__file__,
    "c_sources": sorted(p.name for p in resources.files("cabinllm.runtime.kernels").iterdir() if p.name.endswith(".c")),
    "targets": sorted(load_targets()),
    "builtin": str(builtin_path()),
    "first_dialogue": next(iter(dialogues), None) is not None,
    "modules": sorted(str(Path(m.__file__).resolve()) for n, m in sys.modules.items()
                      if n.startswith("cabinllm.") and getattr(m, "__file__", None)),
    "finders": [type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path],
}))
"""


def test_wheel_files_work_alone(wheel: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -I -S: no site processing, so the venv's editable install (a .pth that adds a meta-path finder mapping
    # cabinllm.* onto this tree) never loads, and no cwd or PYTHONPATH entry either. The venv's site-packages go
    # on sys.path by hand, after the unpacked wheel, only for the third-party dependencies.
    site_dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    result = _run_python(["-I", "-S", "-c", WHEEL_ONLY_CHECK, str(unpacked), *site_dirs], cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert not any("Editable" in finder for finder in report["finders"]), report["finders"]
    base = unpacked.resolve()
    assert Path(report["kernels"]).resolve().is_relative_to(base)
    outside = [m for m in report["modules"] if not Path(m).is_relative_to(base)]
    assert not outside, f"cabinllm modules loaded from outside the wheel: {outside}"
    assert report["c_sources"] == sorted(p.name for p in (ROOT / "runtime" / "kernels").glob("*.c"))
    profiles = tomllib.loads((ROOT / "builders" / "data" / "targets.toml").read_text(encoding="utf-8"))
    assert report["targets"] == sorted(profiles)
    assert Path(report["builtin"]).resolve().is_relative_to(base)
    assert report["first_dialogue"]


BARE_IMPORTS = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        found[name] = None
    else:
        found[name] = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
print(json.dumps(found))
"""


def test_bare_folder_names_do_not_import_from_the_tree(tmp_path: Path) -> None:
    result = _run_python(["-c", BARE_IMPORTS, *BARE_NAMES], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found: dict[str, list[str] | None] = json.loads(result.stdout.splitlines()[-1])
    for name, paths in found.items():
        inside = [p for p in paths or [] if p and Path(p).resolve().is_relative_to(ROOT)]
        assert not inside, f"`import {name}` finds this repository's folder: {inside}"


@pytest.mark.slow  # imports onnxruntime-genai's builder with its torch models
def test_onnxruntime_genai_builder_imports_its_own_builders(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai")
    probe = ("import onnxruntime_genai.models.builder as b, builders, pathlib; print(pathlib.Path(builders.__file__)"
             ".resolve().is_relative_to(pathlib.Path(b.__file__).parent.resolve()))")
    result = _run_python(["-c", probe], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "True", "`builders` is not onnxruntime_genai/models/builders"

