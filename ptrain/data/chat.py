"""Row validation and chat-template tokenisation with assistant-only loss masks.

Accepted SFT rows:
  chat               {"messages": [{"role": ..., "content": str}, ...]}
  prompt_completion  {"prompt": str | messages, "completion": str | messages}
A str prompt becomes one user turn and a str completion one assistant turn. In chat rows
every assistant turn is trained on; in prompt/completion rows only the completion is.

`tokenize_conversation` returns the token ids of the rendered conversation and a 0/1 mask
of the tokens the loss counts (assistant content and its end-of-turn token). With a
template that marks assistant content with `{% generation %}` (the embedded one, and many
published ones) the mask comes from `apply_chat_template(return_assistant_tokens_mask=True)`;
otherwise from rendering growing prefixes of the conversation.

`tokenize_sft_rows` runs the whole pass over a source: every row is validated and
tokenised once, bad rows go to the `BadRowReport`, and the good ones are stored compactly
in `TokenizedRows`, a random-access source for the Grain pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ptrain.data import report as R
from ptrain.data.report import BadRowReport
from ptrain.data.sources import RowDecodeError

KNOWN_ROLES = ("system", "user", "assistant", "tool")


class RowProblem(Exception):
    """Why one row cannot be used: a reason from ptrain.data.report and a description."""

    def __init__(self, reason: str, problem: str):
        super().__init__(problem)
        self.reason = reason
        self.problem = problem


# --------------------------------------------------------------------------- validation


def as_messages(value: Any, field: str, default_role: str) -> list[dict[str, Any]]:
    """A str (one turn of default_role) or a list of {role, content} dicts, validated."""
    if isinstance(value, str):
        if default_role == "assistant" and not value.strip():
            raise RowProblem(R.EMPTY_ASSISTANT, f"'{field}' is an empty string")
        return [{"role": default_role, "content": value}]
    if not isinstance(value, (list, tuple)):
        raise RowProblem(R.WRONG_TYPE, f"'{field}' must be a string or a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowProblem(
                R.WRONG_TYPE, f"{field}[{i}] must be an object with role and content, got {type(m).__name__}"
            )
        if "role" not in m:
            raise RowProblem(R.MISSING_FIELD, f"{field}[{i}] has no 'role'")
        if "content" not in m:
            raise RowProblem(R.MISSING_FIELD, f"{field}[{i}] has no 'content'")
        role, content = m["role"], m["content"]
        if not isinstance(role, str):
            raise RowProblem(R.WRONG_TYPE, f"{field}[{i}].role must be a string, got {type(role).__name__}")
        if role not in KNOWN_ROLES:
            raise RowProblem(R.UNKNOWN_ROLE, f"{field}[{i}].role '{role}' is not one of {', '.join(KNOWN_ROLES)}")
        if content is None and role == "assistant":
            raise RowProblem(R.EMPTY_ASSISTANT, f"{field}[{i}] is an assistant turn with null content")
        if not isinstance(content, str):
            raise RowProblem(R.WRONG_TYPE, f"{field}[{i}].content must be a string, got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise RowProblem(R.EMPTY_ASSISTANT, f"{field}[{i}] is an empty assistant turn")
        out.append(dict(m))
    return out


def detect_format(row: dict[str, Any], fmt: str) -> str:
    """The row's SFT format: fmt itself, or for fmt=auto the one its fields say."""
    if fmt != "auto":
        return fmt
    if "messages" in row:
        return "chat"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "chosen" in row or "rejected" in row:
        raise RowProblem(
            R.MISSING_FIELD,
            "a preference row (chosen/rejected) in an SFT stage; use it in a DPO stage with data.format=preference",
        )
    raise RowProblem(R.MISSING_FIELD, f"neither 'messages' nor 'prompt' + 'completion' (fields: {sorted(row)})")


def sft_conversation(row: dict[str, Any], fmt: str) -> tuple[list[dict[str, Any]], int]:
    """(messages, n_prompt_messages) of one SFT row. Turns before n_prompt_messages are never trained on."""
    kind = detect_format(row, fmt)
    if kind == "chat":
        if "messages" not in row:
            raise RowProblem(R.MISSING_FIELD, "no 'messages' field (data.format=chat)")
        if isinstance(row["messages"], str):
            raise RowProblem(R.WRONG_TYPE, "'messages' must be a list of messages, got a string")
        msgs = as_messages(row["messages"], "messages", "user")
        if not any(m["role"] == "assistant" for m in msgs):
            raise RowProblem(R.EMPTY_ASSISTANT, "no assistant turn to train on")
        return msgs, 0
    if kind == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in row:
                raise RowProblem(R.MISSING_FIELD, f"no '{key}' field (data.format=prompt_completion)")
        prompt = as_messages(row["prompt"], "prompt", "user")
        completion = as_messages(row["completion"], "completion", "assistant")
        if not any(m["role"] == "assistant" for m in completion):
            raise RowProblem(R.EMPTY_ASSISTANT, "the completion has no assistant turn")
        return prompt + completion, len(prompt)
    raise RowProblem(R.MISSING_FIELD, f"format '{kind}' is not an SFT format; pass chat, prompt_completion or auto")


# --------------------------------------------------------------------------- tokenisation


def _has_generation_tags(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def _ids(tokenizer, messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


def _prefix_ids(tokenizer, messages: list[dict[str, Any]], i: int, full: list[int], **kw) -> list[int]:
    """The render of messages[:i], checked to be a prefix of `full`, the whole conversation's
    render: masks from growing prefixes are only right for templates that render a turn the
    same whatever follows it."""
    prefix = _ids(tokenizer, messages[:i], **kw)
    if full[: len(prefix)] != prefix:
        raise RowProblem(
            R.TEMPLATE_ERROR,
            "the chat template renders earlier turns differently once later turns "
            "follow (Qwen3's drops past <think> blocks, for one), so the assistant tokens cannot be "
            "located; use a template that marks them with {% generation %}, or one turn per row",
        )
    return prefix


def _generation_prefix_len(tokenizer, messages: list[dict[str, Any]], i: int, full: list[int]) -> int:
    """Tokens before the content of assistant turn i: the render of messages[:i] with a
    generation prompt. An opening assistant turn has a prefix too (BOS, a default system
    prompt, the assistant header), but transformers renders no empty conversation; there it
    is what the turn's render shares with the render of the same turn left empty."""
    if i:
        return len(_prefix_ids(tokenizer, messages, i, full, add_generation_prompt=True))
    try:
        turn = _ids(tokenizer, messages[:1])
        empty = _ids(tokenizer, [dict(messages[0], content="")])
    except Exception:  # noqa: BLE001 - a template that rejects an empty turn: mask from the start
        return 0
    return next((k for k, (a, b) in enumerate(zip(turn, empty)) if a != b), min(len(turn), len(empty)))


def tokenize_conversation(
    tokenizer, messages: list[dict[str, Any]], n_prompt: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [N] int32 and loss mask [N] int8 (1 on assistant tokens after the first n_prompt turns)."""
    if _has_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.asarray(out["input_ids"], np.int32)
        mask = np.asarray(out["assistant_masks"], np.int8)
    else:
        # Mask by growing prefixes: assistant turn i spans the tokens between the render of
        # messages[:i] with a generation prompt and the render of messages[:i+1].
        full = _ids(tokenizer, messages)
        ids = np.asarray(full, np.int32)
        mask = np.zeros(len(ids), np.int8)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start = _generation_prefix_len(tokenizer, messages, i, full)
                end = len(_prefix_ids(tokenizer, messages, i + 1, full))
                # The render of a finished turn ends with the template's separator (ChatML:
                # "\n" after <|im_end|>); that is formatting, not something to learn.
                while end > start and not tokenizer.decode([int(ids[end - 1])]).strip():
                    end -= 1
                mask[start:end] = 1
    if n_prompt:
        prompt_len = len(_ids(tokenizer, messages[:n_prompt], add_generation_prompt=True))
        mask[:prompt_len] = 0
    return ids, mask


def _is_embedded_chatml(tokenizer) -> bool:
    from ptrain.data.tokenizer import CHAT_TEMPLATE

    return getattr(tokenizer, "chat_template", None) == CHAT_TEMPLATE


def _render_chatml(messages: list[dict[str, Any]], n_prompt: int) -> tuple[str, list[tuple[int, int]], int]:
    """The embedded ChatML template in Python: (text, assistant char spans, chars before the completion)."""
    from ptrain.data.tokenizer import IM_END, IM_START

    parts, spans, pos, prompt_chars = [], [], 0, 0
    for i, m in enumerate(messages):
        if i == n_prompt and n_prompt:
            prompt_chars = pos + len(f"{IM_START}assistant\n")
        head = f"{IM_START}{m['role']}\n"
        if m["role"] == "assistant":
            body = m["content"] + IM_END
            spans.append((pos + len(head), pos + len(head) + len(body)))
            piece = head + body + "\n"
        else:
            piece = head + m["content"] + IM_END + "\n"
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), spans, prompt_chars


def tokenize_conversations(
    tokenizer, conversations: list[tuple[list[dict[str, Any]], int]]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`tokenize_conversation` over many (messages, n_prompt) pairs.

    With the embedded ChatML template this renders in Python and encodes the whole list in
    one Rust call (several times faster than apply_chat_template per row; a test checks the
    two agree token for token and mask for mask). Other templates go row by row.
    """
    if not _is_embedded_chatml(tokenizer):
        return [tokenize_conversation(tokenizer, m, n) for m, n in conversations]
    rendered = [_render_chatml(m, n) for m, n in conversations]
    encodings = tokenizer.backend_tokenizer.encode_batch([r[0] for r in rendered], add_special_tokens=False)
    out = []
    for (_, spans, prompt_chars), enc in zip(rendered, encodings):
        ids = np.asarray(enc.ids, np.int32)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), np.int8)
        for a, b in spans:
            mask[(offsets[:, 0] < b) & (offsets[:, 1] > a) & (offsets[:, 0] >= prompt_chars)] = 1
        out.append((ids, mask))
    return out


def prompt_ids(tokenizer, messages: list[dict[str, Any]]) -> np.ndarray:
    """Token ids [P] int32 of messages followed by the assistant generation prompt."""
    return np.asarray(_ids(tokenizer, messages, add_generation_prompt=True), np.int32)


def fit_length(
    ids: np.ndarray, mask: np.ndarray, max_tokens: int, truncate: bool
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Cut (ids, mask) to max_tokens from the right, or raise RowProblem too_long / no target.

    Returns (ids, mask, was_truncated).
    """
    if len(ids) <= max_tokens:
        return ids, mask, False
    if not truncate:
        raise RowProblem(
            R.TOO_LONG,
            f"{len(ids)} tokens, more than the {max_tokens} allowed (sequence length + 1); "
            "pass data.truncate=true, a larger train.seq_len, or shorten the row",
        )
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    if not mask[1:].any():
        raise RowProblem(
            R.NO_TARGET,
            f"cut to {max_tokens} tokens, no assistant token is left to train on; "
            "raise train.seq_len or shorten the prompt",
        )
    return ids, mask, True


class TokenizedRows:
    """Tokenised examples stored flat (cheap to pickle into Grain workers).

    Item i: {"tokens": int32 [N_i], "mask": int8 [N_i], "row": int (index in the source)}.
    """

    def __init__(self, examples: list[tuple[np.ndarray, np.ndarray]], rows: list[int]):
        lengths = np.asarray([len(t) for t, _ in examples], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.tokens = np.concatenate([t for t, _ in examples]).astype(np.int32) if examples else np.zeros(0, np.int32)
        self.mask = np.concatenate([m for _, m in examples]).astype(np.int8) if examples else np.zeros(0, np.int8)
        self.rows = np.asarray(rows, np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> dict[str, Any]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"tokens": self.tokens[a:b], "mask": self.mask[a:b], "row": int(self.rows[i])}


_CHUNK = 512  # rows validated and tokenised together


def row_location(source, index: int) -> str:
    return source.where(index) if hasattr(source, "where") else f"row {index}"


def _tokenize_chunk(
    parsed: dict[int, Any], tokenize: Callable[[list], list], problems: dict[int, RowProblem]
) -> dict[int, Any]:
    """Tokenise a chunk's parsed rows in one call; if that raises (a chat template's
    `raise_exception`, say, for roles that do not alternate), row by row, so that only the
    rows the template rejects become problems, each with the template's message."""
    try:
        return dict(zip(parsed, tokenize(list(parsed.values()))))
    except Exception:  # noqa: BLE001 - templates raise jinja2 errors, tokenizers their own
        pass
    out = {}
    for i, row in parsed.items():
        try:
            out[i] = tokenize([row])[0]
        except RowProblem as p:
            problems[i] = p
        except Exception as e:  # noqa: BLE001
            problems[i] = RowProblem(
                R.TEMPLATE_ERROR,
                f"the tokenizer's chat template rejected it "
                f"({type(e).__name__}: {e}); fix the row or use a template that accepts it",
            )
    return out


def tokenize_pass(
    source,
    *,
    parse: Callable[[dict], Any],
    tokenize: Callable[[list], list],
    check: Callable[[Any], tuple[Any, bool]],
    report: BadRowReport,
    max_bad_fraction: float,
) -> tuple[list[Any], list[int]]:
    """One validation + tokenisation pass over source, in chunks, accounting rows in order.

    parse(row) validates one row (raises RowProblem); tokenize(parsed rows) tokenises a
    chunk's good rows in one call; check(tokenised) returns (example, was_truncated) or
    raises RowProblem. Returns (examples, source row index of each) and fills report.
    """
    examples, rows = [], []
    for lo in range(0, len(source), _CHUNK):
        hi = min(lo + _CHUNK, len(source))
        problems: dict[int, RowProblem] = {}
        parsed: dict[int, Any] = {}
        for i in range(lo, hi):
            try:
                try:
                    row = source[i]
                except RowDecodeError as e:
                    raise RowProblem(R.INVALID_JSON, str(e)) from None
                parsed[i] = parse(row)
            except RowProblem as p:
                problems[i] = p
        tokenised = _tokenize_chunk(parsed, tokenize, problems)
        for i in range(lo, hi):
            report.total += 1
            try:
                if i in problems:
                    raise problems[i]
                example, cut = check(tokenised[i])
            except RowProblem as p:
                report.add(p.reason, i, row_location(source, i), p.problem)
                continue
            report.good += 1
            report.truncated += int(cut)
            examples.append(example)
            rows.append(i)
    report.finish(max_bad_fraction)
    return examples, rows


def tokenize_sft_rows(
    source,
    tokenizer,
    *,
    fmt: str,
    seq_len: int,
    truncate: bool,
    bad_rows: str = "skip",
    max_bad_fraction: float = 0.5,
    report_rows: int = 10,
    name: str | None = None,
) -> tuple[TokenizedRows, BadRowReport]:
    """Validate and tokenise every row of source for SFT; examples hold at most seq_len + 1 tokens.

    (seq_len + 1 tokens give seq_len next-token pairs.) Raises BadRowError per the policy.
    """

    def check(tokens: tuple[np.ndarray, np.ndarray]):
        ids, mask = tokens
        if not mask[1:].any():
            raise RowProblem(R.EMPTY_ASSISTANT, "the chat template left no assistant token to train on")
        ids, mask, cut = fit_length(ids, mask, seq_len + 1, truncate)
        return (ids, mask), cut

    rep = BadRowReport(source=name or repr(source), policy=bad_rows, keep_rows=report_rows)
    examples, rows = tokenize_pass(
        source,
        parse=lambda row: sft_conversation(row, fmt),
        tokenize=lambda convs: tokenize_conversations(tokenizer, convs),
        check=check,
        report=rep,
        max_bad_fraction=max_bad_fraction,
    )
    return TokenizedRows(examples, rows), rep
