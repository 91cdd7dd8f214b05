import sys

from sglang_patch.verify import main

USAGE = "usage: python -m sglang_patch verify [--dump-dir DIR [--server URL]] [--live-only]"

if len(sys.argv) < 2 or sys.argv[1] != "verify":
    print(USAGE, file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[2:]))
