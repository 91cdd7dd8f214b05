"""The worker's lifecycle steps (Celery bootsteps): each is given the app, never imports it.

Imports ``worker.core``, ``worker.state`` and ``worker.server`` (tests/unit/test_layers.py)."""

from __future__ import annotations

from worker.steps.host_beat import HostBeat
from worker.steps.janitor import Janitor
from worker.steps.outage import OutageStep
from worker.steps.reaper import Reaper
from worker.steps.reconciler import ReconcilerStep

STEPS = (Janitor, OutageStep, Reaper, ReconcilerStep, HostBeat)
