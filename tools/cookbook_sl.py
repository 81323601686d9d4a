"""Run tinker-cookbook's supervised trainer on a conversations file against a Tinker server.

    python -m ptrain.tinker --model-path runs/sft/stages/sft/export --no-auth &
    python tools/cookbook_sl.py --base-url http://127.0.0.1:8000 --model-name runs/sft/stages/sft/export

The trainer is the cookbook's own (`tinker_cookbook.supervised.train.main`, the one
`recipes/sl_basic.py` drives) with its `FromConversationFileBuilder`: sl_basic itself reads
the NoRobots dataset from the Hugging Face hub, which this driver swaps for a local JSONL
file of `{"messages": [{"role", "content"}, ...]}` lines (default: the cookbook's own
`example_data/conversations.jsonl`), as sl_basic's comment suggests. Nothing else changes.

`--model-name` is what the server serves (`--base-model`, by default its model folder): the
cookbook loads the tokenizer by that name, and a local folder needs no hub. The metrics go
to `<log-path>/metrics.jsonl` (train_mean_nll per step).
"""

from __future__ import annotations

import argparse
import asyncio
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the Tinker server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model-name", required=True, help="the server's base model (a local folder: its tokenizer)")
    ap.add_argument("--file", default=None, help="JSONL conversations (default: the cookbook's example file)")
    ap.add_argument("--log-path", default="runs/cookbook_sl")
    ap.add_argument("--renderer", default="role_colon", help="a cookbook renderer name (role_colon: plain text)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: one epoch)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--learning-rate", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=0)
    args = ap.parse_args(argv)

    try:
        import tinker_cookbook
        from tinker_cookbook.supervised import train
        from tinker_cookbook.supervised.data import FromConversationFileBuilder
        from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    except ImportError:
        raise SystemExit(
            "tools/cookbook_sl.py needs tinker-cookbook: pip install --no-deps tinker-cookbook==0.5.8 "
            "chz blobfile pyrage termcolor tml-renderers tinker"
        ) from None

    path = args.file or os.path.join(os.path.dirname(tinker_cookbook.__file__), "example_data", "conversations.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"--file {path}: no such file; pass a JSONL file of conversations")
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model_name,
        renderer_name=args.renderer,
        max_length=args.max_length,
        batch_size=args.batch_size,
    )
    config = train.Config(
        log_path=args.log_path,
        model_name=args.model_name,
        recipe_name="ptrain_cookbook_sl",
        renderer_name=args.renderer,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=path),
        learning_rate=args.learning_rate,
        lr_schedule="linear",
        num_epochs=args.epochs,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        save_every=args.save_every,
        eval_every=0,
        max_steps=args.steps,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
