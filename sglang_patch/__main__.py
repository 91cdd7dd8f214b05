import sys

from engine_dump import dumpdir, markers, nccl
from sglang_patch import verify

USAGE = ("usage: python -m sglang_patch verify [--dump-dir DIR [--server URL]] [--live-only]\n"
         "       python -m sglang_patch markers --dump-dir DIR [--remove-dead]\n"
         "       python -m sglang_patch dumpdir --dump-dir DIR [--create]\n"
         "       python -m sglang_patch nccl --log-dir DIR")
COMMANDS = {"verify": verify.main, "markers": markers.main, "dumpdir": dumpdir.main,
            "nccl": nccl.main}

if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    asked = sys.argv[1:2] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
