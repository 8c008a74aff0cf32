"""Installs cannot drift: every third-party package the code imports is pinned, and the pins agree.

The imports of every .py file under qwen_chat/, tests/, bench/ and app.py (absolute imports, top-level name)
are mapped to their distributions with ``importlib.metadata.packages_distributions()``; each must be pinned
with ``==`` in requirements.txt or constraints.txt (the lock file deploy/install.sh applies), or, for triton,
by deploy/install.sh (matched to the torch build).  A new ``import foo`` of an unpinned package fails here.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "qwen_chat", ROOT / "tests", ROOT / "bench", ROOT / "app.py"]
INSTALL_SH = ROOT / "deploy" / "install.sh"

# Modules that are not installed on a CPU test host, so importlib.metadata cannot map them: module -> the
# distribution that provides it, which must be pinned in constraints.txt or deploy/install.sh.
NOT_INSTALLED_HERE = {
    # the fast prefill kernels (qwen_chat/engine/model/delta_rule.py, bench, tests/gpu): deploy/install.sh
    # installs fla-core + flash-linear-attention on CUDA hosts only; fla-core provides the `fla` package
    "fla": "fla-core",
    # bench plots only (bench/decode_bench.py; bench/serve_report.py falls back to Pillow): never installed by
    # deploy/install.sh, pinned with its dependencies in constraints.txt
    "matplotlib": "matplotlib",
}
# Distributions pinned by deploy/install.sh instead of constraints.txt: triton must match the torch build (a
# CUDA torch requires its own exact triton), so install.sh takes torch's requirement, else triton==3.6.0.
PINNED_BY_INSTALL_SH = {"triton"}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a requirements/constraints file (normalised name -> version); any other
    requirement line is an error: everything must be pinned exactly."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if not line or line.startswith("-"):
            continue
        m = _PIN.match(line)
        assert m, f"{path.name}:{n}: not pinned with ==: {raw!r}"
        name = _norm(m.group(1))
        assert name not in pins, f"{path.name}:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _install_sh_pins() -> dict[str, str]:
    """``name==version`` pins written in deploy/install.sh (its pip command lines and the Triton fall-back)."""
    text = "\n".join(line for line in INSTALL_SH.read_text().splitlines() if not line.lstrip().startswith("#"))
    return {_norm(n): v for n, v in re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][A-Za-z0-9.+!-]*)", text)}


def _py_files() -> list[Path]:
    files: list[Path] = []
    for p in SCANNED:
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return files


def _imported_modules(files: list[Path]) -> dict[str, list[str]]:
    """Top-level names of the absolute imports (``import a.b`` and ``from a.b import c`` -> ``a``) -> files."""
    found: dict[str, list[str]] = {}
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(str(f.relative_to(ROOT)))
    return found


def _local_names(files: list[Path]) -> set[str]:
    """Names importable from the repository itself: the packages, and any .py file or folder next to a
    scanned file or at the root (scripts in bench/ import their neighbours, e.g. ``import serve_http``)."""
    names = {"qwen_chat", "tests", "bench", "app"}
    for folder in {ROOT, *(f.parent for f in files)}:
        for child in folder.iterdir():
            if child.suffix == ".py":
                names.add(child.stem)
            elif child.is_dir() and not child.name.startswith("."):
                names.add(child.name)
    return names


def test_every_imported_third_party_package_is_pinned():
    req, cons, sh = _pins(ROOT / "requirements.txt"), _pins(ROOT / "constraints.txt"), _install_sh_pins()
    files = _py_files()
    assert len(files) > 50, files  # the scan found the code
    local = _local_names(files)
    module_dists = importlib.metadata.packages_distributions()
    problems = []
    checked = set()
    for module, where in sorted(_imported_modules(files).items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        if module in module_dists:
            dists = module_dists[module]
        elif module in NOT_INSTALLED_HERE:
            dists = [NOT_INSTALLED_HERE[module]]
        else:
            problems.append(f"import {module} ({where[0]}): not installed here and not in NOT_INSTALLED_HERE; "
                            f"pin its distribution in requirements.txt and constraints.txt")
            continue
        for dist in map(_norm, dists):
            checked.add(dist)
            if dist in PINNED_BY_INSTALL_SH:
                if dist not in sh:
                    problems.append(f"import {module} ({where[0]}): {dist} is not pinned in deploy/install.sh")
            elif dist not in req and dist not in cons:
                problems.append(f"import {module} ({where[0]}): distribution {dist} is not pinned with == in "
                                f"requirements.txt or constraints.txt")
    assert not problems, "\n".join(problems)
    # the scan saw the main dependencies (guards against a scan that silently finds nothing)
    assert {"torch", "transformers", "gradio", "fastapi", "xgrammar", "deepspeed", "triton"} <= checked, checked


def test_allow_listed_modules_are_pinned():
    cons, sh = _pins(ROOT / "constraints.txt"), _install_sh_pins()
    for module, dist in NOT_INSTALLED_HERE.items():
        assert _norm(dist) in cons or _norm(dist) in sh, f"{module}: {dist} pinned neither in constraints.txt " \
                                                         f"nor in deploy/install.sh"


def test_requirements_agree_with_the_lock_file():
    req, cons = _pins(ROOT / "requirements.txt"), _pins(ROOT / "constraints.txt")
    missing = sorted(set(req) - set(cons))
    assert not missing, f"in requirements.txt but not in constraints.txt: {missing}"
    differ = {n: (req[n], cons[n]) for n in req if req[n] != cons[n]}
    assert not differ, f"requirements.txt and constraints.txt pin differently (requirements, constraints): {differ}"


def test_install_sh_pins_agree_with_the_lock_file_and_triton_is_left_to_it():
    cons, sh = _pins(ROOT / "constraints.txt"), _install_sh_pins()
    # triton depends on the torch build: only install.sh pins it (torch's own requirement, else 3.6.0)
    assert "triton" not in cons
    assert sh.get("triton") == "3.6.0", sh
    assert 'requires("torch")' in INSTALL_SH.read_text()
    differ = {n: (v, cons.get(n)) for n, v in sh.items() if n not in PINNED_BY_INSTALL_SH and cons.get(n) != v}
    assert not differ, f"deploy/install.sh and constraints.txt pin differently (install.sh, constraints): {differ}"
    # every pip install goes through the lock file
    for n, line in enumerate(INSTALL_SH.read_text().splitlines(), 1):
        if "pip install" in line and not line.lstrip().startswith("#"):
            assert "-c constraints.txt" in line, f"install.sh:{n}: pip install without -c constraints.txt: {line}"
