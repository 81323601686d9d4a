"""Metric sinks: a console progress bar, a JSONL file of every metric, TensorBoard.

Drivers call `MetricsLogger.log(step, metrics, prefix)` with host floats; nothing in
here runs inside jit. On resume, `truncate_after(step)` drops JSONL records past the
restored step so a resumed run's file reads like an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np

from ptrain.config.outputs import LoggingConfig


def to_host(metrics: dict) -> dict[str, float]:
    """Device scalars/arrays -> plain floats (arrays of size > 1 are kept as lists)."""
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = float(a) if a.size == 1 else a.tolist()
    return out


class JsonlSink:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=float) + "\n")

    def truncate_after(self, step: int) -> None:
        """Keep only records with step <= `step` (records of a killed run's lost steps go)."""
        self._f.close()
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                if rec.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)
        self._f = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, logdir: str, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard hides earlier files' events at steps >= it, as the JSONL
        # truncation drops them, so a resumed run's curves do not show lost steps twice.
        self._w = SummaryWriter(logdir, purge_step=purge_step)

    def write(self, step: int, record: dict) -> None:
        for k, v in record.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                # TensorBoard tags allow [A-Za-z0-9_./-]; pass@k becomes pass_at_k.
                self._w.add_scalar(k.replace("@", "_at_"), v, step)

    def close(self) -> None:
        self._w.close()


class ConsoleProgress:
    """A rich progress bar: step, loss, tokens/s and ETA; eval results print as lines."""

    def __init__(self, total: int, start: int, description: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._p.start()
        self._task = self._p.add_task(description, total=total, completed=start, info="")

    def update(self, step: int, record: dict) -> None:
        info = []
        for key, fmt in (("loss", "loss {:.4f}"), ("tokens_per_s", "{:,.0f} tok/s"), ("lr", "lr {:.2e}")):
            if key in record and isinstance(record[key], float):
                info.append(fmt.format(record[key]))
        self._p.update(self._task, completed=step, info="  ".join(info))

    def print(self, text: str) -> None:
        self._p.console.print(text)

    def close(self) -> None:
        self._p.stop()


class MetricsLogger:
    """Fans one record out to the configured sinks."""

    def __init__(self, cfg: LoggingConfig, stage_dir: str, *, total_steps: int, start_step: int, name: str):
        self.cfg = cfg
        # Records past the restored step are a killed run's lost steps. A stage that starts
        # over (step 0) logs its step-0 data and evaluation records again, so those go too.
        keep_through = start_step if start_step > 0 else -1
        self.jsonl = JsonlSink(os.path.join(stage_dir, "metrics.jsonl")) if cfg.jsonl else None
        self.tb = (
            TensorBoardSink(os.path.join(stage_dir, "tensorboard"), purge_step=keep_through + 1)
            if cfg.tensorboard
            else None
        )
        self.console = ConsoleProgress(total_steps, start_step, name) if cfg.console else None
        if self.jsonl is not None:
            self.jsonl.truncate_after(keep_through)
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> dict:
        record = {f"{prefix}/{k}": v for k, v in metrics.items()}
        if self.jsonl:
            self.jsonl.write({"step": step, "time": round(time.time() - self._t0, 3), **record})
        if self.tb:
            self.tb.write(step, record)
        if self.console:
            if prefix == "train":
                self.console.update(step, metrics)
            else:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
                self.console.print(f"[{prefix}] step {step}: {shown}")
        return record

    def print(self, text: str) -> None:
        if self.console:
            self.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for sink in (self.jsonl, self.tb, self.console):
            if sink is not None:
                sink.close()
