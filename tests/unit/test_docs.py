"""The docs stay true to the tree: every relative link and ``#anchor`` of README.md and
docs/**/*.md resolves, every config key they name is a JobConfig field, and every metric tag they
name is one the code writes (a string literal or an f-string of torchtitan_rl/, read with ast)."""

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

from torchtitan_rl.config.job_config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# First segments of the logged tags; test_metric_prefixes_are_the_codes keeps the list true.
METRIC_PREFIXES = (
    "loss_metrics",
    "tokens",
    "data",
    "memory",
    "rl",
    "eval",
    "time",
    "throughput",
    "comm",
    "moe",
    "sft_warmup",
    "rollouts",
)
FILE_SUFFIX = re.compile(r"\.(py|md|toml|json|jsonl|gz|sh|txt|parquet|pickle|svg|png|html|safetensors|whl)\b")
# Python names the docs mention that read like `section.key`.
CODE_NAMES = {"optimizer.step", "model.shard_tokens"}
# <name>, {i}, a bare N, and * stand for any text in a documented tag.
DOC_PLACEHOLDER = re.compile(r"<[^>]*>|\{[^}]*\}|(?<![A-Za-z])N(?![A-Za-z])|\*")


@dataclasses.dataclass
class Page:
    path: Path
    prose: str  # the page with its fenced code blocks blanked
    blocks: list[tuple[str, str]]  # fenced code blocks: (language, body)

    @property
    def code_spans(self) -> list[str]:
        return [m.group(2) for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", self.prose, re.DOTALL)]


def read_page(path: Path) -> Page:
    prose, blocks, fence, language, body = [], [], None, "", []
    for line in path.read_text().splitlines():
        opening = re.match(r"\s*(```+|~~~+)\s*(\S*)", line)
        if fence is None and opening:
            fence, language, body = opening.group(1), opening.group(2), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append((language, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return Page(path, "\n".join(prose), blocks)


@cache
def pages() -> dict[Path, Page]:
    return {path: read_page(path) for path in PAGES}


def heading_anchor(title: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation but - and _ dropped,
    each space a -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Page) -> set[str]:
    seen: dict[str, int] = {}
    for match in re.finditer(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", page.prose, re.MULTILINE):
        anchor = heading_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        if count:
            seen[f"{anchor}-{count}"] = 1
    return set(seen)


def links(page: Page) -> list[str]:
    text = re.sub(r"`+[^`]*`+", "", page.prose)  # code spans hold no links
    return [m.group(1) for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)]


def broken_links(page: Page) -> list[str]:
    broken = []
    for link in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        path = (page.path.parent / target).resolve() if target else page.path
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(pages().get(path) or read_page(path)):
            broken.append(f"{link}: no heading with anchor #{anchor}")
    return broken


def config_keys() -> dict[str, set[str]]:
    """Section -> keys, read from JobConfig's dataclasses."""
    config = JobConfig()
    return {
        section.name: {field.name for field in dataclasses.fields(getattr(config, section.name))}
        for section in dataclasses.fields(config)
    }


def named_keys(page: Page) -> list[str]:
    """`section.key` and `--section.key` in the prose's code spans, `[section] key` spans, and
    flags and TOML tables in the code blocks; `section.key` only where section is a section."""
    sections = config_keys()
    dotted = re.compile(r"(?<![\w./-])(?:--)?([a-z_]+)\.([a-z]\w*)(?![\w(])")
    named = []
    for span in page.code_spans:
        named += [
            f"{s}.{k}"
            for s, k in dotted.findall(span)
            if s in sections and not FILE_SUFFIX.match(f".{k}") and f"{s}.{k}" not in CODE_NAMES
        ]
        header = re.match(r"\[([a-z_]+)\]\s+([a-z_]\w*)", span)
        if header:
            named.append(f"{header.group(1)}.{header.group(2)}")
    for language, body in page.blocks:
        if language == "toml":
            section = None
            for line in body.splitlines():
                table = re.match(r"\s*\[([A-Za-z_.]+)\]", line)
                key = re.match(r"\s*([A-Za-z_]\w*)\s*=", line)
                if table:
                    section = table.group(1)
                    named.append(f"{section}.")  # the table itself must be a section
                elif key and section:
                    named.append(f"{section}.{key.group(1)}")
        elif language != "python":
            named += [f"{s}.{k}" for s, k in re.findall(r"--([a-z_]+)\.([A-Za-z_]\w*)", body) if s in sections]
    return named


def unknown_keys(page: Page) -> list[str]:
    sections, renamed = config_keys(), JobConfig.renamed_keys
    unknown = []
    for name in named_keys(page):
        section, _, key = name.partition(".")
        if name not in renamed and (section not in sections or (key and key not in sections[section])):
            unknown.append(name)
    return unknown


@cache
def code_tags() -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
    """What torchtitan_rl/ can log: concrete strings (literals, f-strings expanded) and the
    f-strings as patterns. A placeholder inside a segment (f"rl/reward_{name}") stands for any
    text; one that is a whole segment (f"rl/{name}") for a name the code spells out somewhere."""
    literals, fstrings = set(), []
    for path in sorted((ROOT / "torchtitan_rl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        pieces_of_fstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
                fstrings.append(pieces)
                pieces_of_fstrings.update(id(v) for v in node.values)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces_of_fstrings:
                literals.add(node.value)
    names = {s for s in literals if re.fullmatch(r"[\w@.%()-]+(/[\w@.%()-]+)*", s)}

    def whole_segment(pieces, i):
        return (i == 0 or (pieces[i - 1] or "").endswith("/")) and (
            i + 1 == len(pieces) or (pieces[i + 1] or "").startswith("/")
        )

    def expand(pieces, values):
        out = [""]
        for i, piece in enumerate(pieces):
            choices = [piece] if piece is not None else (values if whole_segment(pieces, i) else ["\0", *values])
            out = [head + choice for head in out for choice in choices]
        return out

    def regex(pieces, values_regex):
        parts = []
        for i, piece in enumerate(pieces):
            parts.append(
                re.escape(piece) if piece is not None else (values_regex if whole_segment(pieces, i) else ".+")
            )
        return re.compile("".join(parts))

    tag_fstrings = [p for p in fstrings if p and p[0] and "/" in p[0] and p[0].split("/")[0] in METRIC_PREFIXES]
    # Names built by a one-placeholder f-string (f"gspo/{name}") may fill another's segment.
    nested = [p for p in fstrings if p and p[0] and re.fullmatch(r"[a-z_]+/", p[0]) and p.count(None) == 1]
    level_one = {s for p in nested for s in expand(p, sorted(names))}
    values = sorted(names | level_one)
    samples = {s for s in literals if "/" in s} | {s for p in tag_fstrings for s in expand(p, values)}
    values_regex = "(?:" + "|".join(map(re.escape, values)) + ")"
    patterns = tuple(regex(p, values_regex) for p in tag_fstrings)
    return frozenset(samples), patterns


def named_tags(page: Page) -> list[str]:
    texts = page.code_spans + [body for language, body in page.blocks if language != "python"]
    tokens = [token.strip(".,;:'\"") for text in texts for token in text.split()]
    prefix = re.compile(rf"({'|'.join(METRIC_PREFIXES)})/\S")
    # Not a tag: a folder, a file or a module's attribute (data/datasets.load_rows).
    return [t for t in tokens if prefix.match(t) and not t.endswith("/") and not re.search(r"\.[A-Za-z_]", t)]


def tag_exists(tag: str) -> bool:
    samples, patterns = code_tags()
    if tag in samples:
        return True
    doc_regex = re.compile(".*".join(map(re.escape, DOC_PLACEHOLDER.split(tag))))
    doc_sample = DOC_PLACEHOLDER.sub("\0", tag)
    return any(doc_regex.fullmatch(s) for s in samples) or any(p.fullmatch(doc_sample) for p in patterns)


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_and_anchors_resolve(path):
    assert broken_links(pages()[path]) == []


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_config_keys_exist(path):
    assert unknown_keys(pages()[path]) == []


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_metric_tags_are_logged_by_the_code(path):
    assert [tag for tag in named_tags(pages()[path]) if not tag_exists(tag)] == []


def test_metric_prefixes_are_the_codes():
    samples, _ = code_tags()
    assert {tag.split("/")[0] for tag in samples} >= set(METRIC_PREFIXES)


def test_the_checks_catch_mistakes(tmp_path):
    """Each check on a page with one mistake of its kind (and the same page corrected)."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section, with `code`\n")
    good = (
        "# Title\n\n## Set up\n\n[here](#set-up), [there](other.md#a-section-with-code)\n\n"
        "`rl.group_size`, `--training.steps 3`, `[lora] rank = 8`, `rl/reward_mean`, `rl/reward_<name>`, "
        "`moe/load_imbalance/layer_{i}`, `time/step_s`\n\n```toml\n[rl]\ngroup_size = 4\n```\n"
    )
    mistakes = {
        "[there](other.md#a-section-with-code)": "[there](other.md#a-section)",
        "[here](#set-up)": "[here](missing.md)",
        "`rl.group_size`": "`rl.group_sizes`",
        "group_size = 4": "groups = 4",
        "`rl/reward_mean`": "`rl/rewards_mean`",
        "`time/step_s`": "`time/step`",
    }
    page = tmp_path / "page.md"
    page.write_text(good)
    checked = read_page(page)
    assert (broken_links(checked), unknown_keys(checked)) == ([], [])
    assert all(tag_exists(tag) for tag in named_tags(checked))
    for right, wrong in mistakes.items():
        page.write_text(good.replace(right, wrong))
        checked = read_page(page)
        found = broken_links(checked) + unknown_keys(checked) + [t for t in named_tags(checked) if not tag_exists(t)]
        assert len(found) == 1, (wrong, found)
