"""The embedded tokenizer: a small byte-level BPE built locally, with a ChatML template.

Built with `tokenizers` (no download): 256 byte tokens, 4 special tokens and BPE merges
learned on the arithmetic task's text plus a paragraph of generic English, up to
`vocab_size` (default 512, so the tiny embedded model's embedding stays cheap). Digits
are always split one per token: arithmetic is learnable only when the model sees
each digit, and it keeps the tokenisation of numbers independent of their neighbours.

The chat template is ChatML and wraps assistant content (plus its closing
`<|im_end|>`, so the model learns to stop) in `{% generation %}`, which gives
`apply_chat_template(..., return_assistant_tokens_mask=True)` its assistant mask.
Saved as tokenizer.json + tokenizer_config.json + special_tokens_map.json +
chat_template.jinja through `transformers.PreTrainedTokenizerFast`, so
`AutoTokenizer.from_pretrained(folder)` loads it offline. Same inputs, same bytes.
"""

from __future__ import annotations

import json
import os

from ptrain.data import tasks

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, PAD)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A little generic English so merges also cover ordinary words, not only the task.
_GENERIC_TEXT = """\
You are a helpful assistant. The user asks a question and the assistant answers it.
Please show your work step by step, then give the final answer on its own line.
Language models learn to predict the next token of a text. Post-training teaches a
pretrained model to follow instructions, to prefer good answers over bad ones, and to
solve problems whose answers can be checked. The quick brown fox jumps over the lazy dog.
What is the sum of these numbers? What is the difference? What is the product?
Think about the question, check each step, and write the answer clearly.
"""


def _training_text() -> list[str]:
    # Role names as the template writes them, so "assistant" is one token, not four.
    roles = [f"{role}\n" for role in ("system", "user", "assistant", "tool")] * 50
    return tasks.sample_text() + _GENERIC_TEXT.splitlines() * 20 + roles


def build_tokenizer(out_dir: str | None = None, vocab_size: int = 512):
    """Train the embedded byte-level BPE tokenizer; save it to out_dir when given.

    Returns a `transformers.PreTrainedTokenizerFast` with eos=<|endoftext|>, pad=<|pad|>,
    the ChatML template above and `model_max_length` unset. Deterministic in vocab_size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens; pass at least 260"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        save_tokenizer(fast, out_dir)
    return fast


def save_tokenizer(tokenizer, out_dir: str) -> str:
    """Write tokenizer files into out_dir (created if needed) that transformers 4.x and 5.x both load.

    transformers 5 writes tokenizer_class "TokenizersBackend" and a list-valued
    "extra_special_tokens", which transformers 4.x (what SGLang installs pin) rejects; the
    classic names mean the same to both. Also writes special_tokens_map.json.
    """
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    make_portable(out_dir)
    return out_dir


def make_portable(folder: str) -> None:
    """Rewrite folder/tokenizer_config.json with names both transformers 4.x and 5.x understand."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    elif isinstance(extra, dict):
        cfg["extra_special_tokens"] = extra
    cfg.pop("backend", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k)}
    if cfg.get("additional_special_tokens"):
        special["additional_special_tokens"] = cfg["additional_special_tokens"]
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def load_tokenizer(path: str):
    """Load a local Hugging Face tokenizer folder (never downloads); check it can do chat."""
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(
            f"no tokenizer.json in '{path}'; pass a local Hugging Face tokenizer folder "
            "(or leave data.tokenizer_path null for the embedded tokenizer)"
        )
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"the tokenizer in '{path}' has no chat template; chat and preference rows need one. "
            "Add chat_template to its tokenizer_config.json (or chat_template.jinja)"
        )
    if tok.pad_token_id is None:
        # Padding positions are masked everywhere; any id works, eos is the usual choice.
        tok.pad_token = tok.eos_token
    return tok


def get_tokenizer(tokenizer_path: str | None, out_dir: str | None = None, vocab_size: int = 512):
    """The run's tokenizer: load tokenizer_path if given, else build the embedded one.

    out_dir: where to save (or reuse) the embedded tokenizer, e.g. <run_dir>/tokenizer;
    an existing folder there is loaded, so a resumed run keeps the exact same file.
    """
    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path)
    if out_dir is not None and os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return load_tokenizer(out_dir)
    return build_tokenizer(out_dir, vocab_size=vocab_size)


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: the chat template's <|im_end|>, else end-of-sequence."""
    stop = [tokenizer.convert_tokens_to_ids(s) for s in (IM_END,) if s in tokenizer.get_vocab()]
    return stop or [tokenizer.eos_token_id]
