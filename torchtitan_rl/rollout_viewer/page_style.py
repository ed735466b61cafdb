"""The CSS of the rollout page (inlined into it: the page loads nothing)."""

STYLE = """
:root { --fg: #1d1f23; --muted: #6b7280; --line: #d9dce1; --accent: #2563eb; --good: #15803d;
  --bad: #b91c1c; --trained: #e8f5e9; --trained-edge: #2e7d32; --env: #f3f4f6; --env-edge: #9ca3af; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, sans-serif; color: var(--fg); background: #fafafa; }
header { padding: 10px 16px; background: #fff; border-bottom: 1px solid var(--line);
  display: flex; gap: 16px; align-items: center; }
header h1 { font-size: 16px; margin: 0; font-weight: 600; }
.tab { border: 1px solid var(--line); background: #fff; padding: 4px 12px; border-radius: 4px; cursor: pointer; }
.tab.active { background: var(--accent); color: #fff; border-color: var(--accent); }
.tab:disabled { color: var(--muted); cursor: default; }
main { display: grid; grid-template-columns: minmax(320px, 420px) 1fr; gap: 16px; padding: 16px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px; min-width: 0; }
h2 { font-size: 14px; margin: 0 0 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 3px 6px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { font-weight: 600; white-space: nowrap; }
th[data-sort] { cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \\25B2"; }
th.sorted-desc::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { font-family: ui-monospace, monospace; font-size: 12px; max-width: 28em; overflow: hidden;
  text-overflow: ellipsis; white-space: nowrap; }
tr.step-row, tr.record { cursor: pointer; }
tr.step-row:hover, tr.record:hover { background: #eef2ff; }
tr.selected { background: #dbeafe; }
.steps-scroll { max-height: calc(100vh - 120px); overflow: auto; }
.table-scroll { overflow-x: auto; }
#steps { font-size: 12px; }
.summary { color: var(--muted); margin: 0 0 8px; }
#histogram svg { display: block; max-width: 100%; }
#histogram rect.bar { fill: var(--accent); }
#histogram text { font-size: 10px; fill: var(--muted); }
.controls { display: flex; gap: 12px; align-items: center; margin: 8px 0; }
#search { flex: 1; padding: 4px 8px; border: 1px solid var(--line); border-radius: 4px; font: inherit; }
.ok { color: var(--good); }
.no { color: var(--bad); }
#detail:empty { display: none; }
main.with-detail { grid-template-columns: minmax(260px, 320px) minmax(0, 1fr) minmax(0, 1fr); }
#detail { position: sticky; top: 16px; align-self: start; max-height: calc(100vh - 32px); overflow: auto;
  background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px; min-width: 0; }
#detail .fields { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0 0 12px; }
#detail .fields dt { color: var(--muted); }
#detail .fields dd { margin: 0; font-variant-numeric: tabular-nums; }
pre { white-space: pre-wrap; word-break: break-word; background: #f8fafc; border: 1px solid var(--line);
  border-radius: 4px; padding: 8px; margin: 4px 0 12px; font-size: 12px; }
.turn { border-left: 4px solid var(--env-edge); background: var(--env); border-radius: 4px;
  padding: 6px 10px; margin: 6px 0; }
.turn.trained { border-left-color: var(--trained-edge); background: var(--trained); }
.turn pre { background: transparent; border: 0; padding: 0; margin: 4px 0 0; }
.turn-head { display: flex; gap: 10px; font-size: 12px; }
.role { font-weight: 600; }
.badge { border-radius: 8px; padding: 0 6px; font-size: 11px; background: #fff; border: 1px solid var(--line); }
.eval-answer { border: 1px solid var(--line); border-radius: 4px; padding: 6px 10px; margin: 6px 0; }
.eval-answer.correct { border-left: 4px solid var(--good); }
.eval-answer.wrong { border-left: 4px solid var(--bad); }
button.close { float: right; }
.empty { color: var(--muted); font-style: italic; }
"""
