"""The set-up promises of the repository: README's two commands, .ci/run, pinned requirements, import hygiene."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL_AND_START = "bash deploy/install.sh && bash start.sh --model tiny"
INSTALL_AND_TEST = "bash deploy/install.sh --test && python -m pytest -q"


def code_block_lines(markdown: str) -> list[str]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_has_exactly_the_two_setup_commands():
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert code_block_lines(setup) == [INSTALL_AND_START, INSTALL_AND_TEST]


def test_ci_runs_the_readme_test_command_and_fails_on_no_tests(tmp_path):
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and f"'{INSTALL_AND_TEST}'" in ci
    # run .ci/run in a copy whose install.sh puts a fake pytest into the fresh virtual environment .ci/run made
    # (it is active: $VIRTUAL_ENV), exiting with a chosen code; exit 5 (nothing collected) must fail the run
    (tmp_path / ".ci").mkdir()
    (tmp_path / "deploy").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for code, expected in ((5, 1), (0, 0), (1, 1)):
        (tmp_path / "deploy" / "install.sh").write_text(
            'site=$(python -c "import sysconfig; print(sysconfig.get_paths()[\'purelib\'])")\n'
            'case "$site" in "$VIRTUAL_ENV"/*) ;; *) echo "not in the fresh venv: $site" >&2; exit 3;; esac\n'
            f'mkdir -p "$site/pytest" && touch "$site/pytest/__init__.py" && '
            f'echo "raise SystemExit({code})" > "$site/pytest/__main__.py"\n')
        out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=120)
        assert out.returncode == expected, (code, out.stderr)
        if code == 5:
            assert "no tests" in out.stderr


def test_requirements_are_pinned_and_install_script_parses():
    lines = [l.strip() for l in (REPO / "requirements.txt").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][\w.+]*", l) for l in lines), lines
    assert lines[0].startswith("torch==")
    names = {l.split("==")[0].lower() for l in lines}
    assert {"gradio", "gradio_client", "transformers", "playwright", "pytest"} <= names
    install = (REPO / "deploy" / "install.sh").read_text()
    assert "DS_BUILD_OPS=0" in install and "--no-build-isolation deepspeed==0.19.8" in install
    assert subprocess.run(["bash", "-n", str(REPO / "deploy" / "install.sh")]).returncode == 0


def test_import_is_light_and_web_layer_never_imports_torch():
    code = ("import sys, app; assert 'torch' not in sys.modules and 'gradio' not in sys.modules;"
            "import qwen_chat.web.server, qwen_chat.web.ui, qwen_chat.web.handlers;"
            "assert 'torch' not in sys.modules, 'web layer imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_nothing_points_outside_the_repository():
    """Product code, tests and docs cite only files of this repository: no design notes of a sibling folder, no
    issue numbers of the tracker that built it, no bare ids of its acceptance cases (a C and two digits)."""
    outside = re.compile("|".join([re.escape(".." + "/shared"), re.escape("/work/" + "shared"), r"(?i:\bissue \d+\b)",
                                   r"\bC\d\d[a-z]?\b"]))
    paths = [REPO / "README.md", REPO / "app.py", REPO / "start.sh"]
    for folder in ("qwen_chat", "tests", "docs"):
        paths += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".jinja", ".json")]
    found = [f"{p.relative_to(REPO)}:{n}" for p in paths
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not found, found


def test_no_product_module_is_over_400_lines():
    """A newcomer finds each concern in a module small enough to read: none under qwen_chat/ over 400 lines."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines())
             for p in (REPO / "qwen_chat").rglob("*.py")}
    assert sizes, "no modules found under qwen_chat/"
    assert {name: n for name, n in sizes.items() if n > 400} == {}
