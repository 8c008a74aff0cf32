"""Helpers shared by the tests (no tests here), one module per kind of helper:

- ``fake_backend``: ``FakeBackend``, the one scripted ``ChatBackend`` (``FakeBackend()`` for the API and ops
  tests, ``FakeBackend.for_ui()`` for the UI tests).
- ``servers``: ``free_port``, ``RunningServer`` (uvicorn in a background thread), ``api_app`` (the API + ops
  app), ``hang_up_after`` (a streaming client leaving mid-way).
- ``waiting``: ``wait_until``, the one polling wait, and ``log_tail``.
- ``metrics``: ``metric_samples`` / ``scrape``, Prometheus samples as a dict.
- ``spy_executor``: ``SpyExecutor``, a ``LocalExecutor`` that records and can gate, fail or script its steps.
- ``small_model``: a small random Qwen3.5 and the comparisons against the transformers reference.
- ``service_harness``: the real service through ``start.sh``, alone or under ``supervisord``.
- ``browsing``: headless chromium through playwright (the ``browser``/``page`` fixtures, ``open_app``, ``send``,
  ``bot_text``, ``field``) for the real-browser tests in tests/web.
- ``two_ranks``, ``multirank_driver``: two-process launches (collectives, DeepSpeed ranks).
- ``triton_checks``: the Triton kernels under the interpreter, run in a subprocess.
"""
