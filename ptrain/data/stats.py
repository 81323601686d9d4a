"""Inspect and measure a data configuration: bad rows, an example, speed, packing fill.

    python -m ptrain.data.stats --batch-size 32 --seq-len 128 [--n-train 20000] [--no-packing]
    python -m ptrain.data.stats --train-path my.jsonl [--format auto] [--tokenizer DIR] [--seq-len 2048]

Prints the bad-row report, the first example with the trained (loss-masked) tokens in
[[...]], rows/s of the tokenisation pass, batches/s of the iterator, the fraction of batch
slots holding real tokens (fill) and the fraction that carry loss. `packing_stats` is
the reusable part (a recipe author picks seq_len with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from ptrain.config.data import DataConfig, GeneratedTaskConfig
from ptrain.data.grain_ops import clear_cache
from ptrain.data.sft import make_sft_iterator, sft_examples


def packing_stats(
    cfg: DataConfig, tokenizer, *, batch_size: int, seq_len: int, n_batches: int = 50
) -> dict[str, float]:
    """Fill (real tokens / slots), loss fraction (loss tokens / slots), examples per row, over n_batches."""
    it = make_sft_iterator(cfg, tokenizer, batch_size=batch_size, seq_len=seq_len)
    fill = loss = segs = 0.0
    for _ in range(n_batches):
        b = next(it)
        fill += float((b["segment_ids"] > 0).mean())
        loss += float(b["loss_mask"].mean())
        segs += float(b["segment_ids"].max(axis=1).mean())
    return {"fill": fill / n_batches, "loss_fraction": loss / n_batches, "examples_per_row": segs / n_batches}


def show_example(tokenizer, tokens, mask) -> str:
    """Decode one example with the runs of loss-masked tokens wrapped in [[...]]."""
    out, run, on = [], [], False
    for t, m in zip(tokens.tolist(), mask.tolist()):
        if bool(m) != on and run:
            text = tokenizer.decode(run)
            out.append(f"[[{text}]]" if on else text)
            run = []
        on = bool(m)
        run.append(t)
    if run:
        text = tokenizer.decode(run)
        out.append(f"[[{text}]]" if on else text)
    return "".join(out)


def main(argv=None) -> None:
    from ptrain.data.tokenizer import build_tokenizer, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--bins", type=int, default=0, help="packing bins (0: batch size)")
    ap.add_argument("--no-packing", action="store_true")
    ap.add_argument("--train-path", help="a local JSONL or Parquet file instead of the generated task")
    ap.add_argument("--format", default="auto", help="auto | chat | prompt_completion")
    ap.add_argument("--tokenizer", help="a local tokenizer folder (default: the embedded tokenizer)")
    args = ap.parse_args(argv)

    tok = load_tokenizer(args.tokenizer) if args.tokenizer else build_tokenizer()
    cfg = DataConfig(
        generated=GeneratedTaskConfig(n_train=args.n_train, n_eval=16),
        packing=not args.no_packing,
        packing_bins=args.bins,
        format=args.format,
        max_bad_fraction=1.0,
    )
    if args.train_path:
        kind = "parquet" if args.train_path.endswith((".parquet", ".pq")) else "jsonl"
        cfg = dataclasses.replace(cfg, source=kind, train_path=args.train_path)
    clear_cache()
    t0 = time.perf_counter()
    examples, rep = sft_examples(cfg, tok, seq_len=args.seq_len)
    t_tok = time.perf_counter() - t0
    print(rep.summary())
    print("first example, trained tokens in [[...]]:")
    print(show_example(tok, examples[0]["tokens"], examples[0]["mask"]))
    lengths = examples.lengths() - 1
    it = make_sft_iterator(cfg, tok, batch_size=args.batch_size, seq_len=args.seq_len)
    next(it)
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    t_it = time.perf_counter() - t0
    st = packing_stats(cfg, tok, batch_size=args.batch_size, seq_len=args.seq_len, n_batches=min(args.batches, 50))
    slots = args.batch_size * args.seq_len
    print(
        f"tokenise: {len(examples)} rows in {t_tok:.2f} s = {len(examples) / t_tok:,.0f} rows/s; "
        f"example length (next-token pairs) mean {lengths.mean():.1f} min {lengths.min()} max {lengths.max()}"
    )
    print(
        f"iterator: {args.batches / t_it:,.1f} batches/s = {args.batches * slots / t_it:,.0f} token slots/s "
        f"(batch {args.batch_size} x {args.seq_len}, packing={'on' if cfg.packing else 'off'})"
    )
    print(f"fill {st['fill']:.3f}  loss tokens {st['loss_fraction']:.3f}  examples/row {st['examples_per_row']:.2f}")


if __name__ == "__main__":
    main()
