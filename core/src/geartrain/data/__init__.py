"""Prompt data: datasets from JSONL, Parquet or a ``datasets.Dataset`` (no downloads),
chat templates, length filtering, and a deterministic, resumable loader.

    dataset = PromptDataset("train.jsonl", tokenizer, DataConfig(max_prompt_length=256))
    loader = PromptLoader.from_config(dataset)
    batch = loader.next_batch()            # batch.prompt_ids -> Rollout.generate
    state = loader.state_dict()            # into the checkpoint; load_state_dict to resume
"""

from geartrain.data.config import DataConfig
from geartrain.data.dataset import PromptDataset, PromptRow
from geartrain.data.loader import PromptBatch, PromptLoader
from geartrain.data.sources import DataSource, read_rows

__all__ = ["DataConfig", "DataSource", "PromptBatch", "PromptDataset", "PromptLoader", "PromptRow", "read_rows"]
