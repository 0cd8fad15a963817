"""`python -m tide.train`: one training cycle over a run's chunk store, publishing drafts/vN.

Single process or several (`torchrun --nproc_per_node 2 -m tide.train ...` or the deepspeed
launcher); each rank reads the same files. Rank 0 prints the cycle's result as JSON (and writes
it to --json; libraries may print to stdout too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tide.cli import parser, run
from tide.config import load_config
from tide.store.layout import RunLayout


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m tide.train", __doc__)
    p.add_argument("--config", required=True, type=Path, help="TIDE YAML config (sections model, draft, store, train)")
    p.add_argument("--out", required=True, type=Path, help="run dir holding store/ and drafts/")
    p.add_argument("--window-tokens", type=int, default=0, help="newest stored tokens to train on (0 = all)")
    p.add_argument("--json", type=Path, help="also write the cycle's result to this file")

    def body(args: argparse.Namespace) -> int:
        cfg = load_config(args.config)
        run_dir = RunLayout.open(cfg, args.out)
        from tide.train import DraftTrainer  # DeepSpeed: after the config is known to be good

        trainer = DraftTrainer.from_config(cfg, run_dir)
        result = trainer.cycle(args.window_tokens or None)
        if trainer.rank == 0:
            text = json.dumps(result.to_json() if result else None, indent=1)
            print(text)
            if args.json:
                args.json.write_text(text)
        trainer.shutdown()
        return 0 if result else 1

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
