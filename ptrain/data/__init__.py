"""Data: Grain pipelines from local files or the embedded task to train-step batches.

Modules (the file list is the architecture):
  tokenizer   the embedded byte-level BPE tokenizer with a ChatML template; loading local ones; stop ids
  tasks       the embedded arithmetic task: worked solutions, preference pairs, and its verifier
  sources     random-access JSONL / Parquet / Arrow / in-memory row sources; a config's splits
  chat        row validation, chat-template tokenisation, assistant-only loss masks
  report      bad-row counting and the skip / fail policy
  grain_ops   what every iterator shares: the examples cache, the Grain dataset, DataIterator (exact resume)
  sft         SFT iterators (shuffle, epochs, packing), eval passes, packed-vs-unpacked checks
  preference  preference pairs for the DPO family
  prompts     eval prompts (exact match) and prompt iterators for RL stages
  stats       `python -m ptrain.data.stats`: inspect a file (bad rows, trained part), packing fill, speed

Typical use in a stage driver:
    tok = get_tokenizer(cfg.tokenizer_path, run_dir + "/tokenizer", cfg.tokenizer_vocab_size)
    cfg = write_generated(cfg, run_dir + "/data")        # the embedded task as JSONL
    it = make_sft_iterator(cfg, tok, batch_size=B, seq_len=L, seed=cfg.shuffle_seed)
    batch = next(it)                                    # dict of numpy [B, L], see ptrain/__init__.py
    state = it.get_state(); it.set_state(state)         # exact resume (saved in checkpoints)
"""

from ptrain.data.chat import TokenizedRows, tokenize_conversation, tokenize_sft_rows
from ptrain.data.grain_ops import DataChangedError, DataIterator, clear_cache
from ptrain.data.preference import make_preference_iterator, make_preference_pass, preference_examples
from ptrain.data.prompts import EvalPrompt, batch_prompts, make_eval_prompts, make_prompt_iterator
from ptrain.data.report import BadRowError, BadRowReport
from ptrain.data.sft import (
    CONTRACT_KEYS,
    make_sft_dataset,
    make_sft_iterator,
    pack_examples,
    sft_examples,
    shifted_examples,
    unpacked_batch,
)
from ptrain.data.sources import (
    ArrowSource,
    JsonlSource,
    ListSource,
    ParquetSource,
    open_source,
    open_split,
    write_generated,
)
from ptrain.data.tokenizer import build_tokenizer, get_tokenizer, load_tokenizer, stop_token_ids

__all__ = [
    "ArrowSource",
    "BadRowError",
    "BadRowReport",
    "CONTRACT_KEYS",
    "DataChangedError",
    "DataIterator",
    "EvalPrompt",
    "JsonlSource",
    "ListSource",
    "ParquetSource",
    "TokenizedRows",
    "batch_prompts",
    "build_tokenizer",
    "clear_cache",
    "get_tokenizer",
    "load_tokenizer",
    "make_eval_prompts",
    "make_preference_iterator",
    "make_preference_pass",
    "make_prompt_iterator",
    "make_sft_dataset",
    "make_sft_iterator",
    "open_source",
    "open_split",
    "pack_examples",
    "preference_examples",
    "sft_examples",
    "shifted_examples",
    "stop_token_ids",
    "tokenize_conversation",
    "tokenize_sft_rows",
    "unpacked_batch",
    "write_generated",
]
