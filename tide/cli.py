"""The entry points' one preamble, and `tide`, the user command that dispatches to them.

Every entry point (`python -m tide.launch`, `tide.train`, `tide.cluster`, `tide.plan`,
`tide.model.assets`, `tide.runtime`, and the workflows) builds its parser with `parser`, then hands
it to `run`: parse, set up logging, run the body. Bad input (a config key, a workload or trace file,
a model path, a store that cannot be written) raises a ValueError whose message is one line naming
the file and the field; `run` prints it as `tide.launch: error: MESSAGE` and exits 2 (the traceback is in
the log at debug level). Anything else is a bug and keeps its traceback.

    tide launch --config configs/local.yaml --out runs/local
    tide submit --config configs/my.yaml --out /shared/runs/r1 --executor sbatch --dry-run
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

COMMANDS = {  # tide CMD -> the module whose main(argv) runs it
    "launch": ("tide.launch", "the whole loop, locally or as a Slurm het job"),
    "train": ("tide.train.__main__", "one training cycle over a run's chunk store"),
    "submit": ("tide.cluster.submit", "submit the het job and wait for it (sbatch or submitit)"),
    "plan": ("tide.plan.__main__", "split a GPU inventory between serving and training; simulate the loop"),
    "assets": ("tide.model.assets", "fetch and list model assets"),
    "runtime": ("tide.runtime.__main__", "one rank of a TIDE job (what srun runs)"),
}
log = logging.getLogger("tide")


def parser(prog: str, doc: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=doc, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def run(p: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int | None],
        argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, log to stderr, run `body(args)`; a ValueError is bad input: one line, exit 2.
    Nothing this process (or a child) creates is writable by others, whatever the caller's umask:
    the store and the drafts are read by other roles, and a stranger's write there is a bad draft."""
    args = p.parse_args(argv)
    os.umask(os.umask(0o022) | 0o002)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return body(args) or 0
    except ValueError as e:  # ConfigError, WorkloadError, AssetError, a store or model path
        log.debug("bad input", exc_info=True)
        print(f"{p.prog.removeprefix('python -m ')}: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
        print(f"usage: tide COMMAND [ARGS...]   (tide COMMAND --help)\n\ncommands:\n{lines}",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, _ = COMMANDS[argv[0]]
    return int(importlib.import_module(module).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
