"""Prompt datasets (JSONL, Parquet, datasets.Dataset), chat templates, filtering, errors
with row numbers, and the deterministic resumable loader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from geartrain import DataError
from geartrain.data import DataConfig, PromptDataset, PromptLoader
from geartrain.testing import tiny_tokenizer
from geartrain.testing.tiny import CHARACTERS


def char_ids(text: str) -> list[int]:
    """The tiny tokenizer's ids by hand: 4 special tokens, then the printable characters."""
    return [4 + CHARACTERS.index(c) for c in text]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def write_jsonl(path: Path, rows: list, blank_after: int | None = None) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = [
    {"prompt": "12+7=", "ground_truth": "19", "level": 1},
    {"messages": [{"role": "user", "content": "3+4="}], "ground_truth": 7, "source": "unit"},
    {"prompt": "100+250=", "ground_truth": "350"},
]


def test_jsonl_rows_schema_meta_and_chat_template_for_messages(tmp_path, tok):
    ds = PromptDataset(write_jsonl(tmp_path / "p.jsonl", ROWS, blank_after=1), tok)
    assert len(ds) == 3 and ds.num_filtered == 0
    first, second, third = ds.rows
    assert (first.prompt, first.prompt_ids, first.ground_truth, first.meta) == (
        "12+7=",
        char_ids("12+7="),
        "19",
        {"level": 1},
    )
    # default apply_chat_template=None: messages rows go through the template, plain prompts do not
    assert second.prompt == "user: 3+4=\nassistant: "
    assert second.prompt_ids == char_ids("user: 3+4=\nassistant: ")
    assert second.ground_truth == "7" and second.meta == {"source": "unit"}
    assert second.where.endswith("p.jsonl, line 3")  # the blank line 2 is skipped but counted
    assert third.where.endswith("p.jsonl, line 4")


def test_chat_template_on_plain_prompts_with_system_prompt(tmp_path, tok):
    cfg = DataConfig(apply_chat_template=True, system_prompt="be brief")
    ds = PromptDataset(ROWS, tok, cfg)
    assert ds[0].prompt == "system: be brief\nuser: 12+7=\nassistant: "
    assert ds[0].prompt_ids == char_ids(ds[0].prompt)
    with pytest.raises(DataError, match=r"row 2: 'messages' rows need data.apply_chat_template"):
        PromptDataset(ROWS, tok, DataConfig(apply_chat_template=False))


def test_long_prompts_are_filtered_counted_and_logged(tok, caplog):
    rows = [{"prompt": "x" * n, "ground_truth": "1"} for n in (3, 8, 5, 6, 12)]
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        ds = PromptDataset(rows, tok, DataConfig(max_prompt_length=5))
    assert [len(r.prompt_ids) for r in ds.rows] == [3, 5]
    assert ds.num_filtered == 3
    assert any("dropped 3 of 5 prompts longer than max_prompt_length=5" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match="every prompt is longer than max_prompt_length=2"):
        PromptDataset(rows, tok, DataConfig(max_prompt_length=2))


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"prompt": "1+1=", "ground_truth": "2"', "line 4: not valid JSON"),
        ('["1+1=", "2"]', "line 4: a row must be an object"),
        ({"ground_truth": "2"}, "line 4: a row needs exactly one of 'prompt' and 'messages', it has neither"),
        ({"prompt": "a", "messages": [], "ground_truth": "2"}, "line 4: .* it has both"),
        ({"prompt": None, "ground_truth": "2"}, r"line 4: .* it has neither \('prompt' is null\)"),
        (
            {"prompt": None, "messages": None, "ground_truth": "2"},
            r"line 4: .* it has neither \('prompt' and 'messages' are null\)",
        ),
        ({"prompt": "", "ground_truth": "2"}, "line 4: 'prompt' must be a non-empty string"),
        ({"prompt": 12, "ground_truth": "2"}, "line 4: 'prompt' must be a non-empty string"),
        ({"messages": [{"role": "user"}], "ground_truth": "2"}, r"line 4: 'messages'\[0\] must be an object"),
        ({"messages": "hi", "ground_truth": "2"}, "line 4: 'messages' must be a non-empty list"),
        ({"prompt": "1+1="}, "line 4: missing 'ground_truth'"),
        ({"prompt": "1+1=", "ground_truth": ["2"]}, "line 4: 'ground_truth' must be a string or a number"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, tok, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[2], bad_row], blank_after=1)
    with pytest.raises(DataError, match=f"bad.jsonl, {message}"):
        PromptDataset(path, tok)


def test_missing_ground_truth_allowed_when_not_required(tok):
    ds = PromptDataset([{"prompt": "hi"}], tok, DataConfig(require_ground_truth=False))
    assert ds[0].ground_truth is None


def test_custom_keys(tok):
    cfg = DataConfig(prompt_key="question", ground_truth_key="answer")
    ds = PromptDataset([{"question": "q?", "answer": "a", "prompt": "kept as meta"}], tok, cfg)
    assert (ds[0].prompt, ds[0].ground_truth, ds[0].meta) == ("q?", "a", {"prompt": "kept as meta"})


def test_parquet_and_hf_dataset_sources(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+1=", "ground_truth": "2", "id": 0}, {"prompt": "2+2=", "ground_truth": "4", "id": 1}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    from_parquet = PromptDataset(path, tok)
    from_hf = PromptDataset(datasets.Dataset.from_list(rows), tok)
    for ds in (from_parquet, from_hf):
        assert [r.prompt_ids for r in ds.rows] == [char_ids("1+1="), char_ids("2+2=")]
        assert [r.meta for r in ds.rows] == [{"id": 0}, {"id": 1}]
    assert from_parquet[1].where == f"{path}, row 2"
    chat = tmp_path / "chat.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"messages": [{"role": "user", "content": "5+5="}], "ground_truth": "10"}]), chat
    )
    from_config = PromptDataset.from_config(DataConfig(path=str(chat)), tok)
    assert from_config[0].prompt_ids == char_ids("user: 5+5=\nassistant: ")
    assert from_config[0].messages == [{"role": "user", "content": "5+5="}]
    # a malformed Parquet row is named by its 1-based row number
    bad = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "ground_truth": "1"}, {"prompt": None, "ground_truth": "2"}]), bad
    )
    with pytest.raises(DataError, match="bad.parquet, row 2: a row needs exactly one"):
        PromptDataset(bad, tok)
    with pytest.raises(DataError, match="row 2: a row needs exactly one"):
        PromptDataset(
            datasets.Dataset.from_list([{"prompt": "a", "ground_truth": "1"}, {"prompt": None, "ground_truth": "2"}]),
            tok,
        )


@pytest.mark.parametrize("suffix", ["jsonl", "json", "csv"])
def test_a_file_saved_with_a_byte_order_mark_reads_like_one_without(tmp_path, tok, suffix):
    """Windows editors and Excel save UTF-8 with a byte-order mark: it is not part of the
    first row (it was refused as invalid JSON, or glued onto the first CSV column's name)."""
    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "4"}]
    if suffix == "jsonl":
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
    elif suffix == "json":
        text = json.dumps(rows)
    else:
        text = "prompt,ground_truth\r\n" + "".join(f"{r['prompt']},{r['ground_truth']}\r\n" for r in rows)
    plain, marked = tmp_path / f"plain.{suffix}", tmp_path / f"marked.{suffix}"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    expected = [(r.prompt_ids, r.ground_truth) for r in PromptDataset(plain, tok).rows]
    assert [(r.prompt_ids, r.ground_truth) for r in PromptDataset(marked, tok).rows] == expected
    assert expected[0] == (char_ids("1+1="), "2")


def test_bad_paths(tmp_path, tok):
    with pytest.raises(DataError, match="no such data file"):
        PromptDataset(tmp_path / "missing.jsonl", tok)
    (tmp_path / "p.tsv").write_text("prompt\n")
    with pytest.raises(DataError, match="unknown data format '.tsv'"):
        PromptDataset(tmp_path / "p.tsv", tok)


# ------------------------------------------------------------------ TRL's conversational format
TRL_MESSAGES = [{"role": "user", "content": "2+2="}]
TRL_ROWS = [{"prompt": TRL_MESSAGES, "ground_truth": "4"}, {"prompt": "3+3=", "ground_truth": "6"}]


def test_messages_key_prompt_reads_trls_conversational_prompt_column(tok):
    """docs/coming_from_trl.md maps TRL's prompt column to data.messages_key; that key may
    be the prompt key itself, and the value's type says which a row holds."""
    ds = PromptDataset(TRL_ROWS, tok, DataConfig(messages_key="prompt"))
    chat, plain = ds.rows
    assert chat.prompt == tok.apply_chat_template(TRL_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat.prompt == "user: 2+2=\nassistant: " and chat.prompt_ids == char_ids(chat.prompt)
    assert chat.messages == TRL_MESSAGES and chat.meta == {}
    assert (plain.prompt, plain.messages) == ("3+3=", None)
    with pytest.raises(DataError, match=r"row 1: a row needs 'prompt' \(a string or a list of \{role, content\}"):
        PromptDataset([{"ground_truth": "4"}], tok, DataConfig(messages_key="prompt"))


def test_a_list_of_messages_under_prompt_is_read_as_messages_by_default(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    default = PromptDataset(TRL_ROWS, tok)
    assert [(r.prompt, r.messages) for r in default.rows] == [
        ("user: 2+2=\nassistant: ", TRL_MESSAGES),
        ("3+3=", None),
    ]
    path = tmp_path / "trl.parquet"  # Parquet readers give a list of structs as a numpy array
    pq.write_table(pa.Table.from_pylist(TRL_ROWS[:1]), path)
    assert PromptDataset(path, tok)[0].messages == TRL_MESSAGES
    with pytest.raises(DataError, match=r"row 1: 'prompt' rows need data.apply_chat_template"):
        PromptDataset(TRL_ROWS, tok, DataConfig(apply_chat_template=False))


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"prompt": [{"role": "user"}], "ground_truth": "2"}, r"line 4: 'prompt'\[0\] must be an object with string"),
        ({"prompt": [], "ground_truth": "2"}, "line 4: 'prompt' must be a non-empty list of {role, content} objects"),
        ({"prompt": [{"role": "user", "content": " "}], "ground_truth": "2"}, "line 4: every message of 'prompt'"),
        ({"prompt": TRL_MESSAGES, "messages": TRL_MESSAGES, "ground_truth": "2"}, "line 4: .* it has both"),
        ({"prompt": {"role": "user"}, "ground_truth": "2"}, "line 4: 'prompt' must be a non-empty string or a list"),
    ],
)
def test_a_malformed_conversational_prompt_names_its_row(tmp_path, tok, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[2], bad_row], blank_after=1)
    with pytest.raises(DataError, match=f"bad.jsonl, {message}"):
        PromptDataset(path, tok)


# ------------------------------------------------------------------ loader
def numbers_dataset(tok, n: int = 10) -> PromptDataset:
    return PromptDataset([{"prompt": f"{i}+0=", "ground_truth": str(i)} for i in range(n)], tok)


def test_messages_ending_with_an_assistant_message_are_continued(tok):
    """A conversation whose last message is the assistant's is a prefix to continue (TRL's
    ``continue_final_message``): no end of that turn, no new assistant header after it."""
    rows = [
        {"messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "The sum is"}]},
        {"messages": [{"role": "user", "content": "3+4="}]},
    ]
    continued, fresh = PromptDataset(rows, tok, DataConfig(require_ground_truth=False)).rows
    whole = tok.apply_chat_template(rows[0]["messages"], tokenize=False)  # the finished conversation
    assert continued.prompt_ids == char_ids(whole[: whole.index("The sum is") + len("The sum is")])
    assert tok.decode(fresh.prompt_ids).endswith("assistant: ")


def test_loader_order_is_pinned_by_seed_and_epoch(tok):
    ds = numbers_dataset(tok)
    loader = PromptLoader(ds, 4, seed=0)
    assert len(loader) == 2
    # numpy's PCG64 permutation seeded with (seed, epoch): pinned so a resumed run in a new
    # version of geartrain still sees the same order
    assert loader.order(0) == [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]
    assert loader.order(1) == [9, 1, 3, 8, 7, 6, 0, 4, 2, 5]
    assert PromptLoader(ds, 4, seed=7).order(0) == [8, 0, 7, 1, 3, 6, 2, 4, 5, 9]
    batches = [loader.next_batch() for _ in range(3)]
    # drop_last: the tail (indices 8, 1) of epoch 0 is skipped
    assert [b.indices for b in batches] == [[4, 6, 2, 7], [3, 5, 9, 0], [9, 1, 3, 8]]
    assert [b.epoch for b in batches] == [0, 0, 1]
    assert batches[0].ground_truths == ["4", "6", "2", "7"]
    assert batches[0].prompt_ids[0] == char_ids("4+0=")


def test_loader_without_shuffle_or_drop_last_and_epoch_iteration(tok):
    loader = PromptLoader(numbers_dataset(tok), 4, shuffle=False, drop_last=False)
    assert len(loader) == 3
    assert [b.indices for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (loader.epoch, loader.index) == (1, 0)
    assert [b.epoch for b in loader] == [1, 1, 1]
    with pytest.raises(DataError, match="batch_size 11 is larger than the 10 prompts"):
        PromptLoader(numbers_dataset(tok), 11)


def test_loader_resume_gives_exactly_the_same_next_batches(tmp_path, tok):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": f"{i}*2=", "ground_truth": str(2 * i)} for i in range(7)])
    cfg = DataConfig(batch_size=3, seed=123)
    first = PromptLoader.from_config(PromptDataset(path, tok, cfg))
    for _ in range(3):  # crosses into epoch 1
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as it would sit in a checkpoint
    expected = [first.next_batch().indices for _ in range(5)]
    resumed = PromptLoader.from_config(PromptDataset(path, tok, cfg))
    resumed.load_state_dict(state)
    assert [resumed.next_batch().indices for _ in range(5)] == expected
    assert {k: v for k, v in state.items() if k != "fingerprint"} == {
        "epoch": 1,
        "index": 3,
        "seed": 123,
        "shuffle": True,
        "num_prompts": 7,
    }
    other_seed = PromptLoader(PromptDataset(path, tok, cfg), 3, seed=5)
    with pytest.raises(DataError, match="seed 123 .now 5."):
        other_seed.load_state_dict(state)


def test_loader_resume_over_other_prompts_of_the_same_number_is_refused(tmp_path, tok):
    """Issue 35, round 13: a resume whose data file was rewritten with other rows of the same
    number (or given other rows through ``run_job(data=...)``) went on without a word: only
    the number of prompts was compared."""
    rows = [{"prompt": f"{i}*2=", "ground_truth": str(2 * i)} for i in range(7)]
    cfg = DataConfig(batch_size=3, seed=123)
    first = PromptLoader.from_config(PromptDataset(write_jsonl(tmp_path / "a.jsonl", rows), tok, cfg))
    first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    same = PromptLoader.from_config(PromptDataset(write_jsonl(tmp_path / "b.jsonl", rows), tok, cfg))
    same.load_state_dict(state)  # the same prompts from another file: nothing changed
    other = [{"prompt": f"{i}*3=", "ground_truth": str(3 * i)} for i in range(7)]
    changed = PromptLoader.from_config(PromptDataset(write_jsonl(tmp_path / "c.jsonl", other), tok, cfg))
    with pytest.raises(
        DataError, match=r"other prompts \(the same number, 7, with other contents or in another order\)"
    ):
        changed.load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "fingerprint"}  # a checkpoint from before fingerprints
    changed.load_state_dict(older)


def test_sample_meta_is_prompt_major(tok):
    batch = PromptLoader(numbers_dataset(tok, 4), 2, shuffle=False).next_batch()
    meta = batch.sample_meta(3)
    assert meta["ground_truth"] == ["0", "0", "0", "1", "1", "1"]
    assert meta["uid"] == ["0:0", "0:0", "0:0", "0:1", "0:1", "0:1"]
    assert meta["prompt"][3] == "1+0="


def test_message_roles_outside_the_chat_format_are_said_once_with_their_rows(tmp_path, tok, caplog):
    """Probe 26 of issue 35's round 8: a message with the role "wizard" (or the typo "usr")
    reached the chat template without a word."""
    usual = [{"role": r, "content": "1+1="} for r in ("system", "developer", "user", "assistant", "tool", "user")]
    rows = [
        {"messages": usual, "ground_truth": "2"},
        {"messages": [{"role": "wizard", "content": "2+2="}, {"role": "usr", "content": "x"}], "ground_truth": "4"},
        {"messages": [{"role": "user", "content": "3+3="}], "ground_truth": "6"},
        {"messages": [{"role": "usr", "content": "4+4="}], "ground_truth": "8"},
    ]
    path = write_jsonl(tmp_path / "roles.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset(path, tok, DataConfig(max_prompt_length=400))
    said = [r.getMessage() for r in caplog.records if "role" in r.getMessage()]
    assert said == [
        f"{path}: 3 message(s) in 2 row(s) have a role that is none of system, developer, user, assistant, tool: "
        f"e.g. 'wizard' ({path}, line 2), 'usr' ({path}, line 4). The chat template gets them as they are (a typo?)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset([rows[0], rows[2]], tok, DataConfig(max_prompt_length=400))
    assert not [r for r in caplog.records if "role" in r.getMessage()]


def test_message_keys_other_than_role_and_content_are_said_once(tmp_path, tok, caplog):
    """Probe 38 of issue 35's round 9: ``tool_calls`` beside a string content was dropped
    without a word (only role and content reach the chat template)."""
    rows = [
        {"messages": [{"role": "user", "content": "1+1="}], "ground_truth": "2"},
        {"messages": [{"role": "user", "content": "2+2=", "tool_calls": "garbage", "name": "x"}], "ground_truth": "4"},
    ]
    path = write_jsonl(tmp_path / "keys.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        ds = PromptDataset(path, tok, DataConfig(max_prompt_length=400))
    assert ds[1].messages == [{"role": "user", "content": "2+2="}]
    said = [r.getMessage() for r in caplog.records if "'role' nor 'content'" in r.getMessage()]
    assert said == [
        f"{path}: 2 message key(s) in 1 row(s) are neither 'role' nor 'content' and are not read (only those two "
        f"reach the chat template): e.g. 'tool_calls' ({path}, line 2). Put what the model should see in 'content'"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset([rows[0]], tok, DataConfig(max_prompt_length=400))
    assert not caplog.records


def test_invisible_characters_in_a_ground_truth_are_said_once(tmp_path, tok, caplog):
    """Probe 34 of issue 35's round 9: a ground truth wrapped in U+202E / U+200B (copied from
    a web page) was accepted without a word, though exact_match can never match it."""
    rows = [
        {"prompt": "1+1=", "ground_truth": "2"},
        {"prompt": "2+2=", "ground_truth": "\u202e4\u200b"},
        {"prompt": "3+3=", "ground_truth": "6 \u00e9"},  # visible non-ASCII: nothing to say
    ]
    path = write_jsonl(tmp_path / "truth.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset(path, tok)
    said = [r.getMessage() for r in caplog.records if "invisible" in r.getMessage()]
    assert said == [
        f"{path}: 2 invisible character(s) in the 'ground_truth' of 1 row(s): e.g. U+202E RIGHT-TO-LEFT OVERRIDE "
        f"({path}, line 2). A reward that compares text (exact_match) compares them too, so no response can match "
        "such a row; remove them from the data"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset([rows[0], rows[2]], tok)
    assert not [r for r in caplog.records if "invisible" in r.getMessage()]


@pytest.mark.parametrize(
    ("row", "config", "hint"),
    [
        (
            {"Prompt": "1+1=", "ground_truth": "2"},
            {},
            "it has 'Prompt': did you mean 'prompt'? (rename the key, or set data.prompt_key='Prompt')",
        ),
        (
            {"mesages": [{"role": "user", "content": "1+1="}], "ground_truth": "2"},
            {},
            "it has 'mesages': did you mean 'messages'? (rename the key, or set data.messages_key='mesages')",
        ),
        (
            {"Question": "1+1=", "ground_truth": "2"},
            {"prompt_key": "question", "messages_key": "question"},
            "it has 'Question': did you mean 'question'? (rename the key, or set data.prompt_key='Question')",
        ),
    ],
)
def test_a_row_missing_its_prompt_names_a_key_that_looks_like_it(tmp_path, tok, row, config, hint):
    """Probe 36 of issue 35's round 9: a 'Prompt' column got "it has neither" with no word
    about the key that is there."""
    path = write_jsonl(tmp_path / "near.jsonl", [row])
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok, DataConfig(**config))
    assert str(info.value).endswith(hint), info.value
    with pytest.raises(DataError) as info:
        PromptDataset(write_jsonl(tmp_path / "far.jsonl", [{"text": "1+1=", "ground_truth": "2"}]), tok)
    assert "did you mean" not in str(info.value)


def test_a_byte_order_mark_inside_a_jsonl_file_reads_as_none(tmp_path, tok):
    """Probe 30 of issue 35's round 9: two files saved with byte-order marks and joined with
    `cat` were refused at the second file's first line with Python's "decode using
    utf-8-sig" advice."""
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(4)]
    half = ["\n".join(json.dumps(r) for r in part) + "\n" for part in (rows[:2], rows[2:])]
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(b"".join(h.encode("utf-8-sig") for h in half))
    assert [(r.prompt, r.ground_truth) for r in PromptDataset(joined, tok).rows] == [
        (r["prompt"], r["ground_truth"]) for r in rows
    ]


def test_a_jsonl_file_with_lone_cr_line_ends_says_so(tmp_path, tok):
    """Probe 31 of issue 35's round 9: lines ending in CR alone (classic Mac OS) read as one
    line and were refused as "Extra data", which does not say why."""
    path = tmp_path / "mac.jsonl"
    path.write_bytes(b"\r".join(json.dumps(r).encode() for r in ROWS[:2]) + b"\r")
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok)
    assert str(info.value).startswith(f"{path}, line 1: not valid JSON (Extra data"), info.value
    assert str(info.value).endswith(
        "; the file's lines end in a lone CR (classic Mac OS line ends): save it with LF (or CRLF) line ends"
    )


def test_a_null_prompt_is_not_told_to_rename_its_key_to_itself(tmp_path, tok):
    """Issue 35, round 12: a row whose 'prompt' is null got "it has 'prompt': did you mean
    'prompt'? (rename the key, ...)"."""
    path = write_jsonl(tmp_path / "null.jsonl", [{"prompt": None, "ground_truth": "2"}])
    with pytest.raises(DataError) as info:
        PromptDataset(path, tok)
    assert "('prompt' is null)" in str(info.value) and "did you mean" not in str(info.value), info.value
