"""Every option of the long-running commands says what it does in its help."""

from __future__ import annotations


def test_every_option_of_the_long_commands_says_what_it_does() -> None:
    import argparse

    from producer.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("adopt", "audit", "demo", "enqueue", "export"):
        silent = [a.option_strings for a in sub.choices[name]._actions
                  if a.option_strings and a.dest != "help" and not a.help]
        assert not silent, (name, silent)
