"""Operations tools: ``render_dashboard`` draws docs/ops/dashboard.png from a real run.

Run ``.venv/bin/python -m bench.ops.render_dashboard`` from the repository root (see docs/ops/).
"""
