import sys
from collections.abc import Callable
from functools import partial

from engine_dump import dumpdir, markers, nccl
from vllm_hook import launch, verify

USAGE = ("usage: python -m vllm_hook verify [--dump-dir DIR [--server URL]] [--live-only]\n"
         "       python -m vllm_hook markers --dump-dir DIR [--remove-dead]\n"
         "       python -m vllm_hook dumpdir --dump-dir DIR [--create]\n"
         "       python -m vllm_hook launch-args --model-path DIR [--layers A B C]\n"
         "       python -m vllm_hook nccl --log-dir DIR")
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "verify": verify.main,
    "markers": partial(markers.main, prog="python -m vllm_hook markers"),
    "dumpdir": partial(dumpdir.main, prog="python -m vllm_hook dumpdir"),
    "launch-args": launch.main,
    "nccl": partial(nccl.main, prog="python -m vllm_hook nccl")}

if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    asked = sys.argv[1:2] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
