"""Data as a TRL user brings it (issue 19, item 4): .jsonl, .json (array or lines),
.parquet, .csv, a directory of files, a dataset saved by ``datasets``, a Dataset or list of
dicts in ``run_job``; column mapping; a hub id refused at once with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from geartrain import DataError
from geartrain.cli import main
from geartrain.data import DataConfig, PromptDataset
from geartrain.testing import tiny_tokenizer

ROWS = [{"question": f"{w}->", "answer": w[::-1], "level": i} for i, w in enumerate(["abc", "hello", "word", "tiny"])]
CFG = DataConfig.model_validate({"prompt_key": "question", "answer_key": "answer", "apply_chat_template": False})


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _seen(dataset: PromptDataset) -> list[tuple[str, str | None, dict]]:
    return [(r.prompt, r.ground_truth, r.meta) for r in dataset.rows]


EXPECTED = [(r["question"], r["answer"], {"level": r["level"]}) for r in ROWS]


def test_every_file_format_and_a_directory_give_the_same_rows(tmp_path: Path, tok) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "b.json").write_text(json.dumps(ROWS, indent=1))
    (tmp_path / "c.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # JSON lines named .json
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "e.csv").write_text(
        "question,answer,level\n" + "".join(f"{r['question']},{r['answer']},{r['level']}\n" for r in ROWS)
    )
    for name in ("a.jsonl", "b.json", "c.json", "d.parquet"):
        assert _seen(PromptDataset(tmp_path / name, tok, CFG)) == EXPECTED, name
    csv_rows = _seen(PromptDataset(tmp_path / "e.csv", tok, CFG))
    assert csv_rows == [(q, a, {"level": str(m["level"])}) for q, a, m in EXPECTED]  # CSV cells are text
    # a directory: its files in name order
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    (folder / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[2:]))
    assert _seen(PromptDataset(folder, tok, CFG)) == EXPECTED
    # a dataset saved by datasets (a Dataset, and a DatasetDict's train split)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert _seen(PromptDataset(tmp_path / "saved", tok, CFG)) == EXPECTED
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved_dict"))
    assert _seen(PromptDataset(tmp_path / "saved_dict", tok, CFG)) == EXPECTED
    # in memory: a Dataset and a list of dicts
    assert _seen(PromptDataset(datasets.Dataset.from_list(ROWS), tok, CFG)) == EXPECTED
    assert _seen(PromptDataset(list(ROWS), tok, CFG)) == EXPECTED


def test_answer_key_is_the_ground_truth_column(tok) -> None:
    assert CFG.ground_truth_key == "answer"
    with pytest.raises(DataError, match="missing 'answer'"):
        PromptDataset([{"question": "x"}], tok, CFG)


def test_a_hub_id_fails_at_once_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str], tok) -> None:
    with pytest.raises(DataError, match="hub datasets are not downloaded by geartrain: save it with"):
        PromptDataset("openai/gsm8k", tok, CFG)
    job = tmp_path / "job.toml"
    job.write_text('[model]\ntiny = "qwen2"\n[reward]\nfunction = "gsm8k"\n[data]\npath = "openai/gsm8k"\n')
    assert main(["check", str(job), "--no-plugins"]) == 2  # refused before datasets is asked anything
    err = capsys.readouterr().err
    assert (
        "data.path: 'openai/gsm8k' is not a file or directory here; if it is a Hugging Face hub id, hub datasets "
        "are not downloaded by geartrain: save it with `datasets.load_dataset(...).save_to_disk(dir)`" in err
    )


def test_unknown_suffix_and_empty_directory_are_named(tmp_path: Path, tok) -> None:
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unknown data format '.txt'"):
        PromptDataset(tmp_path / "x.txt", tok, CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory with no .jsonl, .json, .parquet, .csv files"):
        PromptDataset(tmp_path / "empty", tok, CFG)


def test_the_gsm8k_prep_script_writes_what_the_recipe_and_its_reward_read(tmp_path: Path, tok) -> None:
    import datasets
    from geartrain.rewards import get_reward

    root = Path(__file__).resolve().parents[2]
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_prep", root / "examples/gsm8k/prepare_data.py")
    assert spec is not None and spec.loader is not None
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    raw = [
        {"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3 + 1200 = 1203\n#### 1,203"},
        {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    ]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(raw), "test": datasets.Dataset.from_list(raw[:1])}
    ).save_to_disk(str(tmp_path / "hub_copy"))
    import subprocess
    import sys

    subprocess.run(
        [
            sys.executable,
            str(root / "examples/gsm8k/prepare_data.py"),
            "--from-disk",
            str(tmp_path / "hub_copy"),
            "--out",
            str(tmp_path / "gsm8k"),
        ],
        check=True,
        capture_output=True,
    )
    rows = PromptDataset(tmp_path / "gsm8k" / "train.parquet", tok, DataConfig(apply_chat_template=False)).rows
    assert [r.ground_truth for r in rows] == ["1203", "4"]
    assert rows[0].prompt.endswith(prep.INSTRUCTION)
    assert (
        get_reward("gsm8k")("so 1203.\n#### 1203", rows[0].ground_truth, prompt=rows[0].prompt, meta={})["score"] == 1.0
    )
    assert len(PromptDataset(tmp_path / "gsm8k" / "test.parquet", tok, DataConfig(apply_chat_template=False))) == 1


def test_a_pipe_or_a_device_is_named_as_such_not_as_missing(tmp_path: Path, tok) -> None:
    """Probe rerun for issue 35 item 13: ``data.path`` a FIFO or ``/dev/zero`` was refused as
    'no such data file', though it exists. Nothing is read from it (a FIFO would block)."""
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(DataError) as info:
            PromptDataset(path, tok, CFG)
        assert (
            str(info.value)
            == f"{path}: not a regular file or a directory (a pipe, device or socket); give a data file or a directory"
        )
    with pytest.raises(DataError, match="no such data file"):
        PromptDataset(tmp_path / "absent.jsonl", tok, CFG)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_lone_surrogate_escape_is_named_not_a_tokenizer_traceback(tmp_path: Path, tok, suffix: str) -> None:
    """Probe rerun for issue 35 item 13 (probes3): a JSON string escape ``\\ud800`` (half of a
    UTF-16 pair, no character) parses, then the tokenizer raised a 31-line TypeError, exit 1.
    The row is refused where it is read, naming the line and the key."""
    good = {"question": "ab->", "answer": "ba"}
    bad_line = '{"question": "a\\ud800b->", "answer": "ba"}'
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(good) + "\n" + bad_line + "\n")
        where = "line 2"
    else:
        path.write_text("[" + json.dumps(good) + ",\n" + bad_line + "]\n")
        where = "item 2"
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok, CFG)
    assert str(info.value) == (
        f"{path}, {where}: 'question' holds a lone UTF-16 surrogate escape (\\ud800), which is no "
        "character; write the character itself or a complete surrogate pair"
    )
    # a complete pair is a character and reads as one
    path.write_text('{"question": "\\ud83d\\ude00->", "answer": "x"}\n')
    assert [r.prompt for r in PromptDataset(path, tok, CFG).rows] == ["\U0001f600->"]


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (
            "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
            "(SecurityError: access to attribute '__init__' of 'type' object is unsafe.)",
        ),
        ("{% for m in messages %}{{ m['content'] }", "(TemplateSyntaxError: "),
        ("{{ raise_exception('roles must alternate user/assistant') }}", "(TemplateError: roles must alternate"),
        # probes5: a Python error of the template's own expression was a 42-line traceback, exit 1
        ("{{ messages | length / 0 }}", "(ZeroDivisionError: division by zero)"),
    ],
    ids=["sandbox", "syntax", "raise_exception", "python-error"],
)
def test_a_chat_template_that_fails_is_one_line_naming_the_row(tmp_path: Path, template: str, says: str) -> None:
    """Probe rerun for issue 35 items 1 and 13 (probes3): a model directory whose chat template
    reaches for ``os.system`` ran no code (transformers renders in jinja's sandbox), but
    ``geartrain check`` ended in a 53-line traceback (SecurityError), exit 1; so did a template
    with a syntax error, or one that refuses a row with ``raise_exception``."""
    tok = tiny_tokenizer()
    tok.chat_template = template
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "ab->", "answer": "ba"}) + "\n")
    cfg = DataConfig.model_validate({"prompt_key": "question", "answer_key": "answer", "apply_chat_template": True})
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok, cfg)
    text = str(info.value)
    assert text.startswith(f"{path}, line 1: the tokenizer's chat template failed on this row {says}"), text
    assert text.endswith("or set data.apply_chat_template=false")
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def _refusal(path: Path, tok) -> str:
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok, CFG)
    return str(info.value)


def test_json_the_parser_refuses_is_one_line_naming_the_line(tmp_path: Path, tok) -> None:
    """Probe rerun for issue 35 item 13 (probes5): a row nested 200000 arrays deep
    (RecursionError) and an integer of 5000 digits (Python's int-conversion limit, a
    ValueError) passed ``json.loads``' JSONDecodeError handler: a 44-line traceback, exit 1.
    The same for a ``.json`` array file."""
    good = json.dumps({"question": "ab->", "answer": "ba"})
    deep = '{"question": "ab->", "answer": "ba", "m": ' + "[" * 200000 + "]" * 200000 + "}"
    (tmp_path / "deep.jsonl").write_text(good + "\n" + deep + "\n")
    assert _refusal(tmp_path / "deep.jsonl", tok) == (
        f"{tmp_path / 'deep.jsonl'}, line 2: JSON nested too deeply to read (arrays or objects in each other)"
    )
    (tmp_path / "deep.json").write_text("[" + deep + "]")
    assert _refusal(tmp_path / "deep.json", tok) == (
        f"{tmp_path / 'deep.json'}: JSON nested too deeply to read (arrays or objects in each other)"
    )
    (tmp_path / "big.jsonl").write_text(good + "\n" + '{"question": "ab->", "answer": ' + "9" * 5000 + "}\n")
    said = _refusal(tmp_path / "big.jsonl", tok)
    assert said.startswith(f"{tmp_path / 'big.jsonl'}, line 2: not readable JSON (Exceeds the limit (4300 digits)")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_nan_infinity_and_a_repeated_key_are_refused_naming_the_row(tmp_path: Path, tok, suffix: str) -> None:
    """Probes7 (issue 35): Python's json reads ``NaN``/``Infinity`` (what ``json.dumps`` writes
    for a float NaN) and keeps the last of a key given twice; a ground truth of NaN then became
    the string 'nan', a row no response can score, and a repeated 'question' silently dropped
    the first prompt. Both are refused where the row is read; standard JSON reads as before."""
    good = json.dumps({"question": "ab->", "answer": "ba"})
    cases = {
        '{"question": "ab->", "answer": NaN}': "NaN is not a JSON value; write null, a number or a string",
        '{"question": "ab->", "answer": -Infinity}': "-Infinity is not a JSON value; write null, a number or a string",
        '{"question": "ab->", "question": "cd->", "answer": "dc"}': (
            "key 'question' given twice in one object (only the last would be read)"
        ),
        '{"question": "ab->", "answer": "ba", "m": {"k": 1, "k": 2}}': (
            "key 'k' given twice in one object (only the last would be read)"
        ),
    }
    path = tmp_path / f"rows{suffix}"
    for bad, says in cases.items():
        if suffix == ".jsonl":
            path.write_text(good + "\n" + bad + "\n")
            assert _refusal(path, tok) == f"{path}, line 2: {says}"
        else:
            path.write_text("[" + good + ",\n" + bad + "]\n")
            assert _refusal(path, tok) == f"{path}: {says}"
    path.write_text(good + "\n" if suffix == ".jsonl" else "[" + good + "]")
    assert [(r.prompt, r.ground_truth) for r in PromptDataset(path, tok, CFG).rows] == [("ab->", "ba")]


def test_a_float_ground_truth_that_is_not_finite_is_refused(tmp_path: Path, tok) -> None:
    """Probes7 (issue 35): a Parquet column of floats with a NaN (pandas' missing value) became the
    ground truth 'nan' silently; a number that is not finite is refused naming the row."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": ["ab->", "cd->"], "answer": [1.5, float("nan")]}), path)
    assert _refusal(path, tok) == f"{path}, row 2: 'answer' is nan, which no response can match"


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_a_json_or_csv_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path, tok, suffix: str) -> None:
    """Probe rerun for issue 35 item 13 (probes5): invalid UTF-8 in a ``.json`` array or a
    ``.csv`` file was a 42-line UnicodeDecodeError traceback, exit 1 (``.jsonl`` said it in
    one line)."""
    path = tmp_path / f"rows{suffix}"
    if suffix == ".json":
        path.write_bytes(b'[{"question": "ab->", "answer": "ba"},\n {"question": "a\xffb->", "answer": "x"}]')
        line, column = 2, 17
    else:
        path.write_bytes(b"question,answer\nab->,ba\na\xffb->,x\n")
        line, column = 3, 2
    assert _refusal(path, tok) == (
        f"{path}, line {line}: not UTF-8 (byte 0xff at column {column}); save the file as UTF-8"
    )


def test_a_csv_cell_longer_than_the_csv_modules_limit_is_a_prompt_like_any(tmp_path: Path, tok) -> None:
    """Probe rerun for issue 35 item 13 (probes5): a CSV cell of 200000 characters was a
    37-line ``_csv.Error: field larger than field limit (131072)`` traceback, exit 1. It is
    a prompt like a JSONL one: too long for max_prompt_length, dropped and counted. The csv
    module's own limit is left as it was."""
    import csv

    path = tmp_path / "rows.csv"
    path.write_text('question,answer\nab->,ba\n"' + "x" * 200000 + '",y\n')
    before = csv.field_size_limit()
    dataset = PromptDataset(path, tok, CFG)
    assert [r.prompt for r in dataset.rows] == ["ab->"]
    assert dataset.num_filtered == 1
    assert csv.field_size_limit() == before


def test_a_huge_row_is_dropped_without_being_tokenized(tmp_path: Path) -> None:
    """Probe rerun for issue 35 item 13 (probes5): a JSONL row with a 50 MB prompt was
    tokenized whole before being dropped as longer than max_prompt_length: 3 minutes, then
    the tokenizer aborted (``memory allocation of 268435456 bytes failed``, exit 134) under an
    8 GB address-space limit. A text longer than max_prompt_length times the longest token
    is dropped without tokenizing; the tokenizer (the real one, its calls recorded) never
    sees it."""
    tok = tiny_tokenizer()
    seen: list[int] = []
    real_call = type(tok).__call__

    def recording(self, text, *args, **kwargs):  # the real tokenizer; only the lengths are kept
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return real_call(self, text, *args, **kwargs)

    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"question": "ab->", "answer": "ba"})
        + "\n"
        + json.dumps({"question": "x" * 1_000_000, "answer": "y"})
        + "\n"
    )
    cfg = DataConfig.model_validate(
        {"prompt_key": "question", "answer_key": "answer", "apply_chat_template": False, "max_prompt_length": 16}
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(tok), "__call__", recording)
        dataset = PromptDataset(path, tok, cfg)
    assert [r.prompt for r in dataset.rows] == ["ab->"]
    assert dataset.num_filtered == 1
    assert max(seen) < 1000


_USER_ONLY = "{% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}{% endif %}{% endfor %}<a>"


@pytest.mark.parametrize(
    ("template", "settings", "messages", "says"),
    [
        ("<u>question<a>", {}, None, "leaves out the user message's content, so every prompt would render as the same"),
        (_USER_ONLY, {"system_prompt": "Be brief."}, None, "leaves out system messages, so data.system_prompt would"),
        (
            _USER_ONLY,
            {},
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab->"}],
            "leaves out system messages, so the rows' system messages would be lost",
        ),
    ],
    ids=["ignores-messages", "drops-system-prompt", "drops-rows-system"],
)
def test_a_chat_template_that_loses_messages_is_refused(
    tmp_path: Path, template: str, settings: dict, messages: list | None, says: str
) -> None:
    """Probe rerun for issue 35 (probes5 leftover): a chat template that ignores the messages
    passed ``geartrain check`` and trained every prompt as the same text (a silent wrong
    result); one that drops system messages lost data.system_prompt silently."""
    tok = tiny_tokenizer()
    tok.chat_template = template
    path = tmp_path / "rows.jsonl"
    row = {"messages": messages} if messages else {"question": "ab->"}
    path.write_text(json.dumps({**row, "answer": "ba"}) + "\n")
    cfg = DataConfig.model_validate(
        {"prompt_key": "question", "answer_key": "answer", "apply_chat_template": True, **settings}
    )
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok, cfg)
    assert str(info.value).startswith(f"{path}: the tokenizer's chat template {says}"), str(info.value)
    # the same template is fine where it loses nothing: no system message to keep
    if settings or messages:
        path.write_text(json.dumps({"question": "ab->", "answer": "ba"}) + "\n")
        cfg = DataConfig.model_validate({"prompt_key": "question", "answer_key": "answer", "apply_chat_template": True})
        assert [r.prompt for r in PromptDataset(path, tok, cfg).rows] == ["<u>ab-><a>"]


def test_a_template_emitting_megabytes_a_row_holds_one_row_at_a_time(tmp_path: Path) -> None:
    """Probe rerun for issue 35 (probes5 leftover): a chat template emitting 100 MB per row
    held every row's text before the length filter dropped them (MemoryError, or the machine
    out of memory). Each text is dropped as soon as it is rendered: the peak is about one
    row's text, not the file's."""
    import tracemalloc

    tok = tiny_tokenizer()
    row_chars = 4_000_000
    tok.chat_template = "{{ 'x' * " + str(row_chars) + " }}{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(12)))
    cfg = DataConfig.model_validate(
        {"prompt_key": "question", "answer_key": "answer", "apply_chat_template": True, "max_prompt_length": 16}
    )
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="every prompt is longer than max_prompt_length=16"):
            PromptDataset(path, tok, cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * row_chars, f"peak {peak / 1e6:.0f} MB for rows of {row_chars / 1e6:.0f} MB"


def test_an_empty_csv_cell_is_a_missing_value_as_jsonl_null_is(tmp_path: Path, tok) -> None:
    """Issue 35, round 12: a CSV whose answer cell is empty (how pandas writes None) gave the
    row the ground truth '' silently, where the same row in JSONL ("answer": null) is refused."""
    (tmp_path / "e.csv").write_text("question,answer\n1+1=,2\n2+2=,\n")
    with pytest.raises(DataError) as csv_error:
        PromptDataset(tmp_path / "e.csv", tok, CFG)
    (tmp_path / "e.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": null}\n')
    with pytest.raises(DataError) as jsonl_error:
        PromptDataset(tmp_path / "e.jsonl", tok, CFG)
    assert f"{tmp_path / 'e.csv'}, line 3:" in str(csv_error.value)
    assert str(csv_error.value).split(", line 3: ")[1] == str(jsonl_error.value).split(", line 2: ")[1]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("question,question,answer\n1+1=,zz,2\n", "line 1: column 'question' appears twice (columns 1 and 2)"),
        ("question,answer\n1+1=,2\n2+2,=,4\n", "line 3: 3 cells where the header has 2"),
        ("question,answer\n1+1=,2\n\n2+2=\n", "line 4: 1 cells where the header has 2"),
    ],
    ids=["header-names-a-column-twice", "a-cell-too-many", "a-cell-too-few"],
)
def test_a_csv_whose_cells_do_not_line_up_is_refused_naming_the_line(tmp_path: Path, tok, text: str, said: str) -> None:
    """Issue 35, round 13: a header naming 'prompt' twice gave every row the last column's
    cell, and a row with an unquoted comma in its prompt was read shifted (the third cell
    dropped), both silently (``check``: ok)."""
    (tmp_path / "d.csv").write_text(text)
    with pytest.raises(DataError) as info:
        PromptDataset(tmp_path / "d.csv", tok, CFG)
    assert str(info.value).startswith(f"{tmp_path / 'd.csv'}, {said}"), str(info.value)


def test_a_data_directory_names_what_looks_like_data_it_would_leave_out(tmp_path: Path, tok) -> None:
    """Issue 35, round 13: a broken link named b.jsonl, a B.JSONL, a c.jsonl.gz and a sub/ of
    .jsonl files were skipped without a word (10 rows of the 40 put there); a README or a
    hidden file is still no data."""
    data = tmp_path / "data"
    data.mkdir()
    line = json.dumps(ROWS[0]) + "\n"
    (data / "a.jsonl").write_text(line)
    (data / "README.md").write_text("about")
    (data / ".hidden.jsonl").write_text("not json")
    assert len(PromptDataset(data, tok, CFG).rows) == 1
    (data / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    (data / "B.JSONL").write_text(line)
    (data / "c.jsonl.gz").write_bytes(b"\x1f\x8b")
    (data / "sub").mkdir()
    (data / "sub" / "d.jsonl").write_text(line)
    with pytest.raises(DataError) as info:
        PromptDataset(data, tok, CFG)
    said = str(info.value)
    assert said.startswith(f"{data}: a data directory is read from its .jsonl, .json, .parquet, .csv files only"), said
    for why in (
        "B.JSONL (give the suffix in lower case: .jsonl)",
        "b.jsonl (a link to a file that does not exist)",
        "c.jsonl.gz (compressed: decompress it)",
        "sub/ (a subdirectory of data files",
    ):
        assert why in said, said
    assert "README" not in said and "hidden" not in said, said


def test_a_directory_of_a_hubs_train_and_test_files_trains_on_the_train_split(tmp_path: Path, tok, caplog) -> None:
    """Issue 35, round 15: a hub snapshot's data/ (train-*.parquet and test-*.parquet) as
    data.path read both splits as training prompts (180 + 20 rows), saying nothing."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    (data / "test-00000-of-00001.jsonl").write_text(json.dumps(ROWS[3]) + "\n")
    with caplog.at_level("WARNING"):
        dataset = PromptDataset(data, tok, CFG)
    assert [r.prompt for r in dataset.rows] == [r["question"] for r in ROWS[:3]]
    assert "its file names give the splits test, train: training reads the train split's 1 file(s)" in caplog.text
    (data / "train-00000-of-00001.jsonl").unlink()
    (data / "validation.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataError, match="give the splits test, validation and no train split"):
        PromptDataset(data, tok, CFG)
