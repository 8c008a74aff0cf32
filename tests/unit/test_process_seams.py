"""The seams of the two-process layout, checked without starting a model.

- The engine core (every module under ``qwen_chat/engine``) imports neither FastAPI, Gradio, uvicorn nor the
  web package: nothing of HTTP, SSE or the page in the process that launches the kernels.
- The web front (``qwen_chat.front_process`` with everything it imports, the API, the page, the engine client
  and hub, the prompt pool) never imports torch, so it cannot initialise CUDA; only its prompt workers and the
  engine process do.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEB_MODULES = ("fastapi", "gradio", "uvicorn", "starlette", "qwen_chat.web", "qwen_chat.front_process")


def imported_modules(path: Path) -> set[str]:
    """Every module name a file imports (absolute imports, at any depth of the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_engine_module_imports_the_web_stack():
    found = {}
    for path in sorted((REPO / "qwen_chat" / "engine").rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if any(m == w or m.startswith(w + ".") for w in WEB_MODULES))
        if bad:
            found[str(path.relative_to(REPO))] = bad
    assert found == {}


def test_the_front_process_never_imports_torch():
    code = ("import sys, qwen_chat.front_process;"
            "import qwen_chat.web.server, qwen_chat.web.ui, qwen_chat.web.handlers, qwen_chat.web.api;"
            "import qwen_chat.engine.serving.engine_hub, qwen_chat.engine.serving.engine_client;"
            "import qwen_chat.engine.serving.router, qwen_chat.engine.text.prompt_worker;"
            "from qwen_chat.engine.serving.replies import ReplyAssembler;"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'));"
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
