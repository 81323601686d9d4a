"""Data config: where rows come from, how they are read, tokenised, packed and checked.

`DataConfig` is the Hydra `data` group schema. Sequence length and batch size are not
here: they belong to the train config (`train.seq_len`, `train.global_batch_size`) and
are passed to the iterator builders in `ptrain.data`.

`validate_data_config(cfg)` rejects impossible values and missing files before any
compute; each message names the key (`data.<field>`) and says what to pass.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from ptrain.config.choices import BAD_ROW_POLICIES, FORMATS, SOURCE_KINDS, TASK_OPS, one_of

TABLE_EXTENSIONS = {"parquet": (".parquet", ".pq"), "arrow": (".arrow",)}
"""File extensions of the table sources (a folder or glob of shards is read by them)."""


class DataConfigError(ValueError):
    """A data config value that cannot work; the message names the key and what to pass."""


@dataclass
class GeneratedTaskConfig:
    """Knobs of the embedded arithmetic task (`ptrain.data.tasks`)."""

    n_train: int = 20000
    """Distinct training problems (rows). Must be >= 1."""
    n_eval: int = 256
    """Distinct held-out problems, disjoint from the training ones. Must be >= 1."""
    min_digits: int = 2
    """Fewest digits of the first operand. 1 <= min_digits <= max_digits."""
    max_digits: int = 3
    """Most digits of the first operand (and of the second for + and -). At most 9."""
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    """Operations to draw from, each equally likely: '+', '-' (result never negative),
    '*' (multi-digit times one digit)."""
    seed: int | None = None
    """Seed of the problem draw; the same knobs and seed give byte-identical files. null:
    derived from the top-level `seed` (ptrain/config/seeds.py)."""
    noise: float = 0.0
    """Share of training rows (chat format) whose worked solution holds one plausible slip
    (a dropped carry or a wrong digit, so a wrong final answer): imperfect demonstrations,
    as human or model-written SFT data has. Held-out rows and task metadata stay correct.
    In [0, 1)."""


@dataclass
class EnvDataConfig:
    """Knobs of source=envs: SFT rows written from the run's environments, each a task's
    prompt and the environment's own demonstration of a correct response
    (`demonstration(task)`: reasoning in <think>...</think>, then the answer in the format
    its verifier rewards)."""

    n_train: int = 2000
    """Training rows (>= 1), drawn from the environments by their weights (envs.<name>.weight);
    past an environment's n_train tasks its tasks repeat."""
    n_eval: int = 16
    """Held-out rows per environment (>= 0): demonstrations of its first held-out tasks."""
    envs: list[str] = field(default_factory=list)
    """Names of the environments (keys of `envs:`) to write rows from; empty: all of them."""


@dataclass
class ReasoningConfig:
    """Nano's reasoning controls, taught by transforming training rows (ptrain/data/reasoning.py)."""

    strip: float = 0.0
    """Share of training rows whose reasoning is removed (`<think></think>` then the answer),
    so a prompt ending in `<think></think>` gets an answer without reasoning. Nano: 0.10."""
    budget: float = 0.0
    """Share of training rows whose reasoning is cut to a budget N stated in the user turn
    (`{thinking token budget: N}`), the answer kept. Nano: 0.03."""


@dataclass
class DataConfig:
    source: str = "generated"
    """Where rows come from: generated (the embedded arithmetic task, written as JSONL into
    the run directory) | envs (demonstrations of the run's environments' tasks, written as
    JSONL into the run directory; see `envs` below) | jsonl | parquet | arrow (local files at train_path / eval_path;
    arrow reads a Hugging Face `datasets` cache or `save_to_disk` folder)."""
    train_path: str | None = None
    """Training data for source=jsonl|parquet|arrow (required there): a file; for parquet and
    arrow also a folder of shards or a glob (data/train-*.parquet). Ignored for generated."""
    eval_path: str | None = None
    """Held-out data, same forms as train_path; None: no held-out evaluation for that source."""
    format: str = "auto"
    """Row layout: auto (detect per row) | chat ({"messages": [{role, content}, ...]}) |
    prompt_completion ({"prompt": str|messages, "completion": str|messages}) | preference
    ({"prompt", "chosen", "rejected"}; DPO stages). auto never picks preference: a DPO stage
    sets format=preference."""
    packing: bool = True
    """Pack several examples per row (segment ids keep attention and targets inside each
    example). False: one example per row, padded to the sequence length."""
    packing_bins: int = 0
    """First-fit packing bins open at once (more bins: less padding, more epoch mixing).
    0: the batch size. Must be >= 0."""
    shuffle: bool = True
    """Shuffle training rows (a new permutation each epoch). Held-out passes never shuffle."""
    shuffle_seed: int | None = None
    """Seed of the shuffle and of the packing-bin order; null: derived from the top-level
    `seed` (ptrain/config/seeds.py)."""
    num_epochs: int | None = None
    """Passes over the training rows; None repeats forever (train.steps decides the length).
    Must be >= 1 when set."""
    truncate: bool = True
    """Over-long examples are cut at the sequence length, from the right. False: an example
    longer than the sequence length is a bad row (reason too_long)."""
    bad_rows: str = "skip"
    """What a bad row does: skip (drop it, count it, report reasons and row numbers) |
    fail (raise at the first one, naming file, row and problem)."""
    max_bad_fraction: float = 0.5
    """With bad_rows=skip, fail anyway when more than this fraction of the rows is bad
    (a wrong format or the wrong file, not a few bad rows). In [0, 1]."""
    report_rows: int = 10
    """Row numbers kept per bad-row reason in the report. Must be >= 0."""
    tokenizer_path: str | None = None
    """Local Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with a
    chat template). None: the model folder's tokenizer, else the embedded byte-level BPE
    tokenizer that ptrain builds locally."""
    tokenizer_vocab_size: int = 512
    """Vocabulary size of the embedded tokenizer (256 bytes + 4 special tokens + merges).
    Must be >= 260."""
    num_workers: int = 0
    """Grain worker processes; 0 runs the pipeline in-process (best for small data)."""
    generated: GeneratedTaskConfig = field(default_factory=GeneratedTaskConfig)
    """Embedded task knobs, used when source=generated."""
    envs: EnvDataConfig = field(default_factory=EnvDataConfig)
    """Environment demonstration knobs, used when source=envs."""
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)
    """Reasoning-off and thinking-budget transforms of chat training rows (SFT stages)."""
    tool_hallucination: float = 0.0
    """Share of chat training rows whose prompt declares no tools that call an undeclared tool
    before their answer (ptrain/data/tool_hallucination.py): the flaw of SFT data mixing tool
    and tool-free conversations that Nemotron 3 Nano's DPO removes (arXiv 2512.20848 App. C),
    planted where a recipe demonstrates that stage. In [0, 1]; 0 leaves every row as it is."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise DataConfigError(f"config key 'data.{key}': {msg}")


def validate_data_config(cfg: DataConfig) -> None:
    """Raise DataConfigError (or FileNotFoundError for a missing file) naming the key and the fix."""
    _check(
        cfg.source in SOURCE_KINDS, "source", f"unknown source '{cfg.source}'; pass one of {', '.join(SOURCE_KINDS)}"
    )
    _check(cfg.format in FORMATS, "format", f"unknown format '{cfg.format}'; pass one of {', '.join(FORMATS)}")
    _check(cfg.bad_rows in BAD_ROW_POLICIES, "bad_rows", f"pass {one_of(BAD_ROW_POLICIES)}, got '{cfg.bad_rows}'")
    _check(
        0.0 <= cfg.max_bad_fraction <= 1.0,
        "max_bad_fraction",
        f"must be in [0, 1], got {cfg.max_bad_fraction}; pass e.g. 0.1 (1.0 never fails)",
    )
    _check(cfg.report_rows >= 0, "report_rows", f"must be >= 0, got {cfg.report_rows}; pass e.g. 10")
    _check(
        cfg.packing_bins >= 0,
        "packing_bins",
        f"must be >= 0, got {cfg.packing_bins}; pass 0 for the batch size or a bin count",
    )
    _check(
        cfg.num_epochs is None or cfg.num_epochs >= 1,
        "num_epochs",
        f"must be >= 1, got {cfg.num_epochs}; pass a positive count, or null to repeat forever",
    )
    _check(
        cfg.num_workers >= 0,
        "num_workers",
        f"must be >= 0, got {cfg.num_workers}; pass 0 (in-process) or a worker count",
    )
    _check(
        cfg.tokenizer_vocab_size >= 260,
        "tokenizer_vocab_size",
        f"got {cfg.tokenizer_vocab_size}; pass at least 260 (256 bytes + 4 special tokens), e.g. 512",
    )
    if cfg.tokenizer_path is not None and not os.path.isfile(os.path.join(cfg.tokenizer_path, "tokenizer.json")):
        raise FileNotFoundError(
            f"config key 'data.tokenizer_path': no tokenizer.json in '{cfg.tokenizer_path}'; pass a local "
            "Hugging Face tokenizer folder, or null for the embedded tokenizer (nothing is downloaded)"
        )
    r = cfg.reasoning
    _check(r.strip >= 0, "reasoning.strip", f"must be >= 0, got {r.strip}; pass a share such as 0.1")
    _check(r.budget >= 0, "reasoning.budget", f"must be >= 0, got {r.budget}; pass a share such as 0.03")
    _check(
        r.strip + r.budget <= 1,
        "reasoning.strip",
        f"reasoning.strip + reasoning.budget is {r.strip + r.budget}, above 1; lower either share",
    )
    _check(
        0 <= cfg.tool_hallucination <= 1,
        "tool_hallucination",
        f"must be a share in [0, 1], got {cfg.tool_hallucination}; pass 0 to leave the rows as they are",
    )
    if cfg.source == "envs":
        e = cfg.envs
        _check(e.n_train >= 1, "envs.n_train", f"must be >= 1, got {e.n_train}; pass a positive row count")
        _check(e.n_eval >= 0, "envs.n_eval", f"must be >= 0, got {e.n_eval}; pass 0 for no held-out rows")
        return
    if cfg.source == "generated":
        g = cfg.generated
        _check(g.n_train >= 1, "generated.n_train", f"must be >= 1, got {g.n_train}; pass a positive row count")
        _check(g.n_eval >= 1, "generated.n_eval", f"must be >= 1, got {g.n_eval}; pass a positive row count")
        _check(
            1 <= g.min_digits <= g.max_digits <= 9,
            "generated.min_digits",
            f"got min_digits={g.min_digits} max_digits={g.max_digits}; pass 1 <= min_digits <= max_digits <= 9",
        )
        _check(0 <= g.noise < 1, "generated.noise", f"must be in [0, 1), got {g.noise}")
        _check(
            len(g.ops) > 0 and all(op in TASK_OPS for op in g.ops),
            "generated.ops",
            f"pass a non-empty list drawn from {list(TASK_OPS)}, got {list(g.ops)}",
        )
        return
    _check(
        cfg.train_path is not None,
        "train_path",
        f"source={cfg.source} needs a training file; pass data.train_path=/path/to/train.{cfg.source}",
    )
    for key in ("train_path", "eval_path"):
        path = getattr(cfg, key)
        if path is None:
            continue
        exts = TABLE_EXTENSIONS.get(cfg.source, (".jsonl", ".json", ".ndjson"))
        if cfg.source in TABLE_EXTENSIONS and not os.path.isfile(path):
            found = (
                [f for f in glob.glob(os.path.join(path, "*")) if f.endswith(exts)]
                if os.path.isdir(path)
                else glob.glob(path)
            )
            if not found:
                raise FileNotFoundError(
                    f"config key 'data.{key}': no {cfg.source} data at '{path}'; pass a local {exts[0]} file, a "
                    f"folder of them or a glob such as data/train-*{exts[0]} (nothing is downloaded)"
                )
            continue
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"config key 'data.{key}': file '{path}' does not exist; pass the path of a local "
                f"{cfg.source} file (nothing is downloaded)"
            )
        ext = os.path.splitext(path)[1].lower()
        _check(
            ext in exts,
            key,
            f"'{path}' does not look like a {cfg.source} file (extension {ext or 'none'}); "
            f"pass a {'/'.join(exts)} file or set data.source to match the file",
        )
