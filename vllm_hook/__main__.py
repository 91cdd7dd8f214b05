import sys

from vllm_hook import verify

USAGE = "usage: python -m vllm_hook verify [--dump-dir DIR] [--live-only]"
COMMANDS = {"verify": verify.main}

if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    asked = sys.argv[1:2] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
