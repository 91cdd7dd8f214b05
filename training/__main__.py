"""``python -m training index|export --from OUT``: the producer's two training commands, where
only ``hsfarm[training]`` is installed (a trainer's machine: no Celery, Redis or transformers).

Exit codes as the producer's: 0 all well; 1 done, but some samples failed or were rejected;
2 could not run.
"""

from __future__ import annotations

import argparse
import sys

from training import cli
from worker.core.errors import ConfigError

EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training")
    cli.add_commands(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--from OUT is required (the output dir)")
    try:
        return cli.main(args, args.out[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
