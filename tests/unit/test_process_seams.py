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
            "import qwen_chat.engine.client.engine_hub, qwen_chat.engine.client.engine_client;"
            "import qwen_chat.engine.client.router, qwen_chat.engine.text.prompt_worker;"
            "from qwen_chat.engine.output.replies import ReplyAssembler;"
            "from qwen_chat.engine.checkpoints.folders import cached_checkpoint; cached_checkpoint('tiny');"
            "cached_checkpoint('owner/not-cached');"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'));"
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]


def _package_imports() -> dict[str, set[str]]:
    """{module: the qwen_chat modules it imports anywhere (functions included; ``if TYPE_CHECKING:`` blocks
    left out)}."""
    mods = {}
    for path in (REPO / "qwen_chat").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in mods)
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles_in_the_package():
    graph = _package_imports()
    cycles = []
    for start in graph:  # a path back to the start through the imports is a cycle
        todo, seen = list(graph[start]), set()
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
    assert sorted(cycles) == []
