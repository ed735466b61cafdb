"""Built-in tasks, and loading dataset rows from JSON, JSONL and parquet files with errors naming the file and line."""

import json
import operator
import re
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan_rl.data.chat import tokenize_row
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.rows import FileRows, row_base_dir, row_where
from torchtitan_rl.data.tasks import BUILTIN_TASKS
from torchtitan_rl.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()

# ---------------------------------------------------------------- built-in tasks


@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_tasks_are_deterministic_in_the_seed(task):
    generate = BUILTIN_TASKS[task]
    assert generate(50, seed=3) == generate(50, seed=3)
    assert generate(50, seed=3) != generate(50, seed=4)
    assert len(generate(17, seed=0)) == 17


def conversation(row: dict) -> tuple[str, str]:
    user, assistant = row["messages"]
    assert (user["role"], assistant["role"]) == ("user", "assistant")
    return user["content"], assistant["content"]


def test_arithmetic_preferences_choose_the_right_answer_over_a_near_miss():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for row in BUILTIN_TASKS["arithmetic_preferences"](300, seed=0):
        [user] = row["prompt"]
        a, op, b = user["content"].removeprefix("What is ").removesuffix("?").split()
        right = ops[op](int(a), int(b))
        assert row["chosen"] == str(right)
        wrong = int(row["rejected"])
        assert wrong >= 0 and 1 <= abs(wrong - right) <= 10


def test_arithmetic_answers_are_correct():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    seen_ops = set()
    for row in BUILTIN_TASKS["arithmetic"](300, seed=0):
        question, answer = conversation(row)
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
        assert answer == str(ops[op](int(a), int(b)))
        seen_ops.add(op)
    assert seen_ops == set(ops)


def test_reverse_answers_are_correct():
    for row in BUILTIN_TASKS["reverse"](100, seed=0):
        question, answer = conversation(row)
        text = re.fullmatch(r"Reverse the string: ([a-z]{3,8})", question).group(1)
        assert answer == "".join(reversed(text))


# ---------------------------------------------------------------- loading rows

ROWS = [{"text": "hello"}, {"prompt": "Q", "completion": "A"}, {"text": "wörld"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def as_dicts(rows) -> list[dict]:
    # datasets fills the columns a row lacks with None.
    return [{key: value for key, value in rows[i].items() if value is not None} for i in range(len(rows))]


def test_load_jsonl_json_and_parquet_files(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    json_array = tmp_path / "rows.json"
    json_array.write_text(json.dumps(ROWS), encoding="utf-8")
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}]), parquet)

    assert as_dicts(load_rows("ignored", str(jsonl), "train", 0, 0)) == ROWS
    assert as_dicts(load_rows("ignored", str(json_array), "train", 0, 0)) == ROWS
    assert as_dicts(load_rows("ignored", str(parquet), "train", 0, 0)) == [{"text": "a"}, {"text": "b"}]


def test_load_directory_of_files_in_sorted_order(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    write_jsonl(tmp_path / "part-1.jsonl", rows[1:])
    write_jsonl(tmp_path / "part-0.jsonl", rows[:1])
    (tmp_path / "README.md").write_text("not data")
    assert as_dicts(load_rows("", str(tmp_path), "train", 0, 0)) == rows


def test_concurrent_loads_of_the_same_file_agree(tmp_path):
    # Stand-in for several ranks of one node loading the same file at the same time.
    rows = [{"text": f"row {i}"} for i in range(200)]
    path = str(write_jsonl(tmp_path / "rows.jsonl", rows))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: as_dicts(load_rows("", path, "train", 0, 0)), range(4)))
    assert all(result == rows for result in results)


def test_loaded_chat_rows_tokenize(tmp_path):
    chat_rows = BUILTIN_TASKS["reverse"](3, seed=1)
    rows = load_rows("", str(write_jsonl(tmp_path / "chat.jsonl", chat_rows)), "train", 0, 0)
    assert [tokenize_row(rows[i], TOKENIZER) for i in range(3)] == [tokenize_row(r, TOKENIZER) for r in chat_rows]


def test_load_builtin_task():
    rows = load_rows("arithmetic", "", "train", num_synthetic_samples=12, seed=5)
    assert list(rows) == BUILTIN_TASKS["arithmetic"](12, 5)


def test_missing_path_error(tmp_path):
    with pytest.raises(ValueError, match=r"training\.dataset_path=.*does not exist"):
        load_rows("", str(tmp_path / "nope.jsonl"), "train", 0, 0)


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.json", "[]")])
def test_empty_file_error(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match="empty"):
        load_rows("", str(tmp_path / name), "train", 0, 0)


def test_empty_parquet_and_empty_task_errors(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty"):
        load_rows("", str(tmp_path / "empty.parquet"), "train", 0, 0)
    with pytest.raises(ValueError, match="empty"):
        load_rows("reverse", "", "train", num_synthetic_samples=0, seed=0)


@pytest.mark.parametrize(
    "lines, bad_line, reason",
    [
        (['{"text": "a"}', "", '{"text": "b"}', '{"text": b}', '{"text": "c"}'], 4, "Expecting value"),
        (['{"text": "a"}', '["not", "an", "object"]'], 2, "expected a JSON object"),
        (['{"text": "a"}', '{"text": "unterminated'], 2, "Unterminated string"),
    ],
)
def test_malformed_jsonl_line_is_named(tmp_path, lines, bad_line, reason):
    write_jsonl(tmp_path / "good.jsonl", ROWS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    for dataset_path in [bad, tmp_path]:
        with pytest.raises(ValueError, match=rf"bad\.jsonl.* line {bad_line}: {reason}"):
            load_rows("", str(dataset_path), "train", 0, 0)


def test_malformed_json_array_line_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"text": "a"},\n  {"text": b}\n]\n')
    with pytest.raises(ValueError, match=r"bad\.json.* line 3"):
        load_rows("", str(bad), "train", 0, 0)


def test_unsupported_files_error(tmp_path):
    (tmp_path / "rows.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"unsupported dataset file .*rows\.csv"):
        load_rows("", str(tmp_path / "rows.csv"), "train", 0, 0)
    with pytest.raises(ValueError, match="directory with no"):
        load_rows("", str(tmp_path), "train", 0, 0)
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match="mixes JSON and parquet"):
        load_rows("", str(tmp_path), "train", 0, 0)


def test_hub_name_not_in_local_cache_is_not_downloaded():
    with pytest.raises(ValueError, match=r"(?s)not_cached_org/no_such_dataset.*local HF cache.*nothing is downloaded"):
        load_rows("not_cached_org/no_such_dataset", "", "train", 0, 0)
    with pytest.raises(ValueError, match="arithmetic"):
        load_rows("not_cached_org/no_such_dataset", "", "train", 0, 0)


# ---------------------------------------------------------------- JSON rows keep their file and line


def test_json_rows_keep_file_and_line_and_mixed_content_types(tmp_path):
    # 'content' is a string in one row and a list of parts in the next: one Arrow column could
    # not hold both, the plain reader does.
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "yo"},
            ]
        },
    ]
    (tmp_path / "a.jsonl").write_text("\n" + json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    (tmp_path / "b.json").write_text("[\n  " + json.dumps(rows[0]) + ",\n\n  " + json.dumps(rows[1]) + "\n]\n")
    loaded = load_rows("", str(tmp_path), "train", 0, 0)
    assert isinstance(loaded, FileRows) and list(loaded) == rows + rows
    assert [loaded.origin(i) for i in range(4)] == [
        (str(tmp_path / "a.jsonl"), 2),
        (str(tmp_path / "a.jsonl"), 4),
        (str(tmp_path / "b.json"), 2),
        (str(tmp_path / "b.json"), 4),
    ]
    assert row_where(loaded, 3) == f"dataset row 3 ({tmp_path / 'b.json'}:4)"
    assert row_base_dir(loaded, 0) == str(tmp_path)
    assert tokenize_row(loaded[0], TOKENIZER) == tokenize_row(loaded[1], TOKENIZER)
    assert row_where([{}], 0) == "dataset row 0" and row_base_dir([{}], 0) is None


@pytest.mark.parametrize(
    "content, line, reason",
    [
        ('[\n{"text": "a"},\n"b"\n]', 3, "expected a JSON object, got str"),
        ('[\n{"text": "a"}\n{"text": "b"}\n]', 3, "Expecting ',' delimiter"),
        ('[\n{"text": "a"},\n]', 3, "Expecting value"),
        ('[\n{"text": "a"}\n', 3, "the array is not closed"),
        ('[{"text": "a"}]\n{"text": "b"}', 2, "Extra data"),
    ],
)
def test_malformed_json_arrays_are_named(tmp_path, content, line, reason):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ValueError, match=rf"bad\.json.* at line {line}: {reason}"):
        load_rows("", str(tmp_path / "bad.json"), "train", 0, 0)


def test_non_utf8_file_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.* is not UTF-8 at line 2"):
        load_rows("", str(tmp_path / "bad.jsonl"), "train", 0, 0)
