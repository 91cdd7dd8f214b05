import sys

try:
    from producer.cli import main
except ModuleNotFoundError as e:  # run with a python that lacks the farm's libraries
    if (e.name or "").split(".")[0] in ("producer", "worker", "engine_dump", "training"):
        raise
    print(f"error: {e.name} is not installed in this python ({sys.executable}): run the "
          "farm's commands in the farm's venv (. /opt/hsfarm/.venv/bin/activate, or "
          "/opt/hsfarm/.venv/bin/python -m producer ...), or install them here: pip install "
          "'hsfarm[worker]'", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
