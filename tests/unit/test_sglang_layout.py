"""The SGLang hook's version gate, which needs no SGLang: older releases are refused by name."""

from __future__ import annotations

from sglang_patch.layout import SUPPORTED_SGLANG, version_problem


def test_an_older_sglang_is_refused_with_the_supported_releases() -> None:
    problem = version_problem("0.5.22")
    assert problem == ("SGLang 0.5.22 is not supported (supported: 0.5.23): releases before "
                       "0.5.23 have no --enable-return-aux-hidden-states (aux capture without "
                       "a draft model); install sglang==0.5.23")
    assert version_problem("0.5.18.post1") is not None and version_problem("0.4.10") is not None


def test_supported_and_newer_releases_pass_the_gate() -> None:
    assert all(version_problem(v) is None for v in SUPPORTED_SGLANG)
    # newer releases start (verify still fails them until tested); "" is no SGLang at all
    assert version_problem("0.5.24") is None and version_problem("0.6.0+cpu") is None
    assert version_problem("0.5.23.post1") is None and version_problem("") is None
