"""Result document, table and plot of the service benchmark (``bench/serve_bench.py``).

``result_doc`` lays the measurements out under the published keys; ``table`` is the summary printed last;
``plot`` draws aggregate output tok/s and TTFT p50/p99 against concurrency (matplotlib when it is installed,
else a plain Pillow drawing with the same content).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

CONCURRENCY = (1, 8, 32, 64, 128)
CAP_CONCURRENCY = (8, 32)
BUSY_CONCURRENCY = ("32", "128")  # the bursts of ``gpu_busy_share``
PROMPT_SIZES = ("1k", "8k", "32k", "128k")
KINDS = ("1k", "8k", "image", "burst8")  # the request kinds of first_use_ttft_ms / steady_ttft_ms


def _pick(bursts: dict, key: str, levels) -> dict:
    return {str(c): (bursts.get(str(c)) or {}).get(key) for c in levels}


def result_doc(*, batch1: Optional[float], bursts: dict, prompts: dict, cap24: dict, startup_s: Optional[float],
               context: dict) -> dict:
    """The JSON document: ``batch1_tok_s`` (tokens/s), ``aggregate_tok_s`` / ``ttft_ms_p50`` / ``ttft_ms_p99``
    keyed by concurrency "1".."128" (tokens/s; milliseconds), ``prompt_ttft_ms`` keyed "1k".."128k"
    ({"p50", "p99"} in ms, or None), ``cap24`` ({"started", "aggregate_tok_s", "ttft_ms_p50", "ttft_ms_p99"}
    keyed "8", "32", plus "error" when it did not start), ``startup_s`` (seconds), then ``context``'s keys.

    ``bursts``: concurrency (str) -> ``serve_http.burst`` summary; ``prompts``: size -> {"p50", "p99"} or None;
    ``cap24``: {"started": bool, "bursts": {...}, "error": str or None, ...}."""
    cap_bursts = cap24.get("bursts") or {}
    cap = {"started": bool(cap24.get("started")),
           "aggregate_tok_s": _pick(cap_bursts, "aggregate_tok_s", CAP_CONCURRENCY),
           "ttft_ms_p50": _pick(cap_bursts, "ttft_ms_p50", CAP_CONCURRENCY),
           "ttft_ms_p99": _pick(cap_bursts, "ttft_ms_p99", CAP_CONCURRENCY)}
    cap.update({k: v for k, v in cap24.items() if k not in ("started", "bursts")})
    doc = {"batch1_tok_s": batch1,
           "aggregate_tok_s": _pick(bursts, "aggregate_tok_s", CONCURRENCY),
           "ttft_ms_p50": _pick(bursts, "ttft_ms_p50", CONCURRENCY),
           "ttft_ms_p99": _pick(bursts, "ttft_ms_p99", CONCURRENCY),
           "prompt_ttft_ms": {k: prompts.get(k) for k in PROMPT_SIZES},
           "cap24": cap,
           "startup_s": startup_s}
    doc.update(context)
    return doc


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _weights(doc: dict) -> str:
    """What the service said of its weights (``/v1/models`` engine.weights): FP8 and 4-bit layers and the dtype."""
    try:
        w = doc["models"]["data"][0]["engine"]["weights"]
    except (KeyError, IndexError, TypeError):
        return "-"
    fp8, int4 = w.get("fp8_modules") or 0, w.get("int4_modules") or 0
    parts = ([f"FP8 for {fp8} layers ({(w.get('fp8_bytes') or 0) / 2 ** 30:.2f} GiB)"] if fp8 else []) + \
        ([f"4-bit for {int4} layers ({(w.get('int4_bytes') or 0) / 2 ** 30:.2f} GiB)"] if int4 else [])
    return f"{', '.join(parts)}, {w.get('dtype')} for the rest" if parts else str(w.get("dtype"))


def table(doc: dict) -> str:
    """The summary table (plain text) of a ``result_doc``."""
    rows = [("metric", "value"), ("weights", _weights(doc)), ("start-up to /healthz 200 (s)", _f(doc.get("startup_s"))),
            ("start-up again, warm (s)", _f(doc.get("startup_warm_s"))),
            ("batch-1 decode (tok/s)", _f(doc.get("batch1_tok_s")))]
    first, steady = doc.get("first_use_ttft_ms") or {}, doc.get("steady_ttft_ms") or {}
    for kind in KINDS if first or steady else ():
        rows.append((f"TTFT {kind}: first use after ready / steady (ms)",
                     f"{_f(first.get(kind))} / {_f(steady.get(kind))}"))
    shared = doc.get("shared_system_prompt")
    if shared:
        rows.append(("shared 4k system prompt: TTFT p50 (ms), cached tokens",
                     f"{_f(shared['ttft_ms'])}, {shared['cached_tokens']}"))
    for size in PROMPT_SIZES:
        v = doc["prompt_ttft_ms"].get(size)
        why = ((doc.get("detail") or {}).get("prompts", {}).get(size) or {}).get("error")
        rows.append((f"TTFT {size}-token prompt p50 / p99 (ms)",
                     f"{_f(v['p50'])} / {_f(v['p99'])}" if v else f"null ({(why or 'not measured')[:160]})"))
    for label, v in (doc.get("followup_ttft_ms") or {}).items():
        rows.append((f"follow-up TTFT after {label}, cached / uncached (ms)",
                     f"{_f(v['cached'])} / {_f(v['uncached'])}" if v else "null"))
    detail = (doc.get("detail") or {}).get("bursts", {})
    for c in CONCURRENCY:
        k = str(c)
        extra = detail.get(k) or {}
        note = f"  ({extra.get('ok')}/{extra.get('streams')} ok)" if extra.get("streams") else ""
        rows.append((f"{c:>3} streams: aggregate tok/s, TTFT p50 / p99 ms",
                     f"{_f(doc['aggregate_tok_s'][k])}, {_f(doc['ttft_ms_p50'][k])} / {_f(doc['ttft_ms_p99'][k])}"
                     + note))
    rows.extend(host_rows(doc))
    cap = doc["cap24"]
    if not cap["started"]:
        rows.append(("24 GB cap: started", f"no ({(cap.get('error') or 'skipped')[:70]})"))
    for c in CAP_CONCURRENCY if cap["started"] else ():
        k = str(c)
        rows.append((f"24 GB cap, {c:>2} streams: aggregate tok/s, TTFT p50 / p99 ms",
                     f"{_f(cap['aggregate_tok_s'][k])}, {_f(cap['ttft_ms_p50'][k])} / {_f(cap['ttft_ms_p99'][k])}"))
    lc = cap.get("long_context")
    if lc:
        rows.append((f"24 GB cap, {lc['streams']} x {lc['tokens']} tokens: fit by KV / ran at once / ok",
                     f"{lc['kv_fit']} / {lc['max_running']} / {lc['burst']['ok']} ({lc['preemptions']} preemptions)"))
    rows.append(("peak GPU memory (GiB, nvidia-smi)", _f(doc.get("peak_gpu_memory_gib"), "{:.2f}")))
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def host_rows(doc: dict) -> list[tuple[str, str]]:
    """The table's rows of ``host_cpu_us_per_token``, ``gpu_busy_share`` and ``noisy_neighbour``."""
    detail = doc.get("detail") or {}
    cpu = doc.get("host_cpu_us_per_token")
    streams = (detail.get("host_cpu") or {}).get("streams", 128)
    rows = [(f"host CPU/token, {streams} streams: front / engine (us)",
             f"{_f(cpu.get('front'))} / {_f(cpu.get('engine'))}" if cpu else "-")]
    busy = doc.get("gpu_busy_share") or {}
    rows.append(("GPU busy share, 32 / 128 streams (upper bound)",
                 " / ".join(_f(busy.get(k), "{:.2f}") for k in BUSY_CONCURRENCY)))
    nn = doc.get("noisy_neighbour")
    if nn:
        nd = detail.get("noisy_neighbour") or {}
        mb = (nd.get("body_chars") or 0) / 2 ** 20
        rows.append((f"noisy neighbour {mb:.0f} MB, {nn['streams']} streams: status, s, max gap",
                     f"{nn['status']}, {_f(nn['big_request_s'], '{:.2f}')} s, {_f(nn['max_gap_ms'], '{:.0f}')} ms"
                     + (f" (baseline {_f(nd['baseline_max_gap_ms'], '{:.0f}')} ms)"
                        if nd.get("baseline_max_gap_ms") is not None else "")))
    return rows


def _series(doc: dict) -> list[tuple[str, list, list, str]]:
    """(label, x, y, panel) of every line: panel "tok" (tokens/s) or "ttft" (ms)."""
    out = []
    for label, src, levels in (("", doc, CONCURRENCY), ("24 GB cap ", doc["cap24"], CAP_CONCURRENCY)):
        for key, name, panel in (("aggregate_tok_s", "aggregate tok/s", "tok"), ("ttft_ms_p50", "TTFT p50", "ttft"),
                                 ("ttft_ms_p99", "TTFT p99", "ttft")):
            pts = [(c, src[key][str(c)]) for c in levels if src.get(key, {}).get(str(c)) is not None]
            if pts:
                out.append((label + name, [p[0] for p in pts], [p[1] for p in pts], panel))
    return out


def plot(doc: dict, path: Path) -> str:
    """Write the PNG of aggregate tok/s and TTFT p50/p99 against concurrency to ``path``; returns the library
    used ("matplotlib" or "pillow")."""
    title = f"Qwen3.5 service through HTTP, {doc.get('gpu', '?')}, {doc.get('date', '')}"
    try:
        import matplotlib
    except ImportError:
        _plot_pillow(doc, Path(path), title)
        return "pillow"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, xs, ys, panel in _series(doc):
        ax = a1 if panel == "tok" else a2
        ax.plot(xs, ys, ("o-" if "p99" not in label else "s--") if "cap" not in label else "^:", label=label)
    for ax, ylabel in ((a1, "aggregate output tok/s"), (a2, "TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a2.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _plot_pillow(doc: dict, path: Path, title: str) -> None:
    import math

    from PIL import Image, ImageDraw

    w, h, pad = 1100, 440, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 10), title, fill="black")
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    series = _series(doc)
    for i, (panel, ylabel, log_y) in enumerate((("tok", "aggregate output tok/s", False), ("ttft", "TTFT (ms)", True))):
        x0, x1, y0, y1 = pad + i * w // 2, (i + 1) * w // 2 - 20, h - pad, 50
        d.rectangle([x0, y1, x1, y0], outline="black")
        d.text((x0, y1 - 14), ylabel, fill="black")
        d.text(((x0 + x1) // 2 - 40, y0 + 22), "concurrent streams", fill="black")
        lines = [s for s in series if s[3] == panel]
        values = [v for s in lines for v in s[2] if v and v > 0]
        if not values:
            continue
        lo, hi = (min(values), max(values))
        f = (lambda v: math.log10(v)) if log_y else (lambda v: v)
        lo_t, hi_t = (f(lo) - 0.1, f(hi) + 0.1) if log_y else (0.0, hi * 1.1)
        span = (hi_t - lo_t) or 1.0
        xmap = lambda c: x0 + 20 + (x1 - x0 - 40) * math.log2(c) / math.log2(CONCURRENCY[-1])  # noqa: E731
        ymap = lambda v: y0 - (y0 - y1) * (f(v) - lo_t) / span  # noqa: E731
        for c in CONCURRENCY:
            d.line([xmap(c), y0, xmap(c), y0 + 4], fill="black")
            d.text((xmap(c) - 8, y0 + 6), str(c), fill="black")
        for frac in (0.0, 0.5, 1.0):
            v = lo_t + span * frac
            label = 10 ** v if log_y else v
            yy = y0 - (y0 - y1) * frac
            d.text((x0 - 52, yy - 6), f"{label:.0f}" if label >= 10 else f"{label:.2f}", fill="black")
        for k, (label, xs, ys, _) in enumerate(lines):
            color = colors[k % len(colors)]
            pts = [(xmap(x), ymap(y)) for x, y in zip(xs, ys) if y and y > 0]
            if len(pts) > 1:
                d.line(pts, fill=color, width=2)
            for px, py in pts:
                d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)
            d.text((x0 + 10, y1 + 8 + 14 * k), label, fill=color)
    img.save(path)
