"""The rollout page: one self-contained HTML file (inline CSS and JavaScript, the records as JSON
in the page) that loads nothing, so it opens anywhere, offline, from a file. Its script
(``page_script``) draws the steps, histograms, tables and records from the embedded data."""

import html
import json
import math

from torchtitan_rl.rollout_files import KINDS
from torchtitan_rl.rollout_viewer.page_script import SCRIPT
from torchtitan_rl.rollout_viewer.page_style import STYLE

# Nothing outside the page may load (no network, no file): inline styles and scripts only.
CONTENT_POLICY = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<header><h1 id="title"></h1><nav id="tabs"></nav></header>
<main>
<section><h2>Steps</h2><div class="steps-scroll"><table id="steps"></table></div></section>
<section>
<h2 id="step-title"></h2>
<p class="summary" id="step-summary"></p>
<div id="histogram"></div>
<div class="controls">
<input id="search" type="search" placeholder="search the prompt and completion text" aria-label="search">
<span id="shown"></span>
</div>
<div class="table-scroll"><table id="records"></table></div>
</section>
<aside id="detail"></aside>
</main>
<script type="application/json" id="rollout-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""


def _page_value(value: object) -> object:
    """``value`` as the page holds it: non-finite floats (not JSON) become null, and an episode
    turn's token ids their count (the page shows the text)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_page_value(v) for v in value]
    if isinstance(value, dict):
        if "token_ids" in value and "role" in value:
            value = {**{k: v for k, v in value.items() if k != "token_ids"}, "num_tokens": len(value["token_ids"])}
        return {k: _page_value(v) for k, v in value.items()}
    return value


def script_json(data: object) -> str:
    """``data`` as JSON that is safe inside a <script> element: no ``<`` (so neither ``</script>``
    nor ``<!--`` in a completion ends or changes the element), ``>`` and ``&`` written as
    escapes too; JSON.parse reads them back unchanged."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(title: str, steps_by_kind: dict[str, dict[int, list[dict]]]) -> str:
    """The page for ``{kind: {step: records}}`` (kinds: ``rollouts``, ``evals``; either may be
    missing or empty)."""
    data = {
        "title": title,
        "kinds": {
            kind: [{"step": step, "records": _page_value(records)} for step, records in sorted(steps.items())]
            for kind, steps in steps_by_kind.items()
            if kind in KINDS
        },
    }
    return TEMPLATE.format(
        policy=CONTENT_POLICY, title=html.escape(title), style=STYLE, data=script_json(data), script=SCRIPT
    )
