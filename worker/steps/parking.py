"""Publishing parked samples again once their data file can be read at its recorded path.

A worker parks a sample whose data file it cannot read (worker/state/corpus.py). Every worker's
main process checks the run's unreadable files on its janitor timer: a file readable here
again (remounted, restored, or re-pointed by ``enqueue`` to a path this host has) gets its
parked samples published again, each by exactly one process (``Corpus.take_parked``).
"""

from __future__ import annotations

import logging

from celery import Celery

from worker.core import run as runs
from worker.core.errors import Transient
from worker.core.settings import Settings
from worker.state import broker
from worker.state.corpus import Corpus, readable
from worker.state.index import RunIndex
from worker.state.publish import send_all

log = logging.getLogger("hsfarm.parking")


def resume_parked(settings: Settings, run_id: str, app: Celery) -> int:
    """Publish the parked samples of every unreadable data file that reads here now.
    Returns how many. A Redis that does not answer (or any other failure: this runs on the
    worker's timer, which must go on) is tried again on the next round."""
    try:
        return _resume(settings, run_id, app)
    except Transient as e:
        log.warning("parked samples not checked: %s", e)
    except Exception:
        log.exception("parked samples not checked")
    return 0


def _resume(settings: Settings, run_id: str, app: Celery) -> int:
    index = RunIndex(broker.client(settings), run_id)
    corpus = Corpus(index)
    files = corpus.files()
    sent = 0
    for fid in corpus.unreadable():
        info = files.get(fid)
        if info is None or readable(info.path) is not None:
            continue
        taken = corpus.take_parked(fid)
        try:
            sent += publish(app, settings, index, taken) if taken else 0
        except BaseException:
            corpus.repark(taken, fid)  # none is left in no state
            raise
        corpus.clear_unreadable(fid)
        log.info("data file #%d %s reads again: %d parked samples published again", fid,
                 info.path, len(taken))
    return sent


def publish(app: Celery, settings: Settings, index: RunIndex, sample_keys: list[str]) -> int:
    """Publish one message per registered sample of ``sample_keys`` on the run's queue."""
    queue = runs.queue_for(settings, index.run_id)
    publication = index.next_publication()
    refs = (reg.ref(key)
            for key, reg in zip(sample_keys, index.registered(sample_keys), strict=True)
            if reg is not None)
    return send_all(app, queue, index.run_id, publication, refs)
