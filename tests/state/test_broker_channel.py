"""A worker that lost Redis closes its broker connection without exiting, and the messages
it held come back. Real kombu, real Redis, real Celery task messages.

Seen in a farm whose Redis was SIGKILLed and restarted (15 rounds, two workers): Celery's
consumer collected the connection, a connection error stopped the first close of its channel
half-way, kombu's ``collect()`` detached the transport anyway, and the second close, handing
back the unacknowledged messages, read the address from the detached connection:
``AttributeError`` in ``_connparams``, "Unrecoverable error", the worker main process gone (a
regenerating farm test waited 300 s on its one worker in CI)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from kombu import Connection
from kombu.common import ignore_errors
from kombu.message import Message
from kombu.transport import redis as kombu_redis

from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE
from worker.app import FarmApp, create_app
from worker.state import broker, keys

QUEUE = "hsfarm-channel-test"


@pytest.fixture
def app(tmp_path: Path, redis_url: str) -> FarmApp:
    return create_app(LocalFarm(tmp_path / "farm", cache_dir=CACHE, redis_url=redis_url)
                      .settings())


def _held_message(app: FarmApp, conn: Connection) -> Message:
    """A task message received on ``conn`` and not acknowledged, as a worker holds one."""
    app.send_task("hsfarm.test.channel", args=[{"id": 1}], queue=QUEUE)
    message: Message = conn.SimpleQueue(QUEUE).get(timeout=5)
    return message


def _let_go(conn: Connection) -> None:
    """What kombu's ``Connection.collect()`` does after its close of the channels failed: it
    detaches the transport from the connection, and the channel stays open."""
    conn._do_close_transport()


def test_a_channel_closed_after_its_connection_let_go_fails_as_a_lost_connection(
        app: FarmApp) -> None:
    # Given a worker's broker connection, on the farm's transport, holding one message
    conn = app.connection_for_read()
    assert isinstance(conn.transport, broker.Transport)
    assert conn.as_uri().startswith("redis://")  # as Celery logs it and Flower reads it
    message = _held_message(app, conn)
    r = broker.client(app.settings)
    assert r.hexists(keys.KOMBU_UNACKED, message.delivery_tag)

    # When the connection has let go of its transport with the channel open, and Celery
    # closes the channel (as closing the connection does, ignoring connection errors)
    _let_go(conn)
    ignore_errors(conn, message.channel.close)  # raises anything but a connection error

    # Then the close fails as a lost connection would, and an acknowledgement on that
    # channel too, logged: the worker lives on
    with pytest.raises(redis.ConnectionError):
        message.channel._connparams()
    message.ack_log_error(logging.getLogger("test"), conn.connection_errors)
    # And the message is still the broker's, for the visibility timeout or the reaper to
    # bring back
    assert r.hexists(keys.KOMBU_UNACKED, message.delivery_tag)


def test_kombu_s_own_channel_still_fails_there_with_an_attribute_error(app: FarmApp) -> None:
    # Given kombu's own Redis transport (not the farm's) holding one message
    conn = Connection(app.settings.redis_url, transport=kombu_redis.Transport)
    message = _held_message(app, conn)
    # When its connection lets go of the transport with the channel open
    _let_go(conn)
    # Then closing the channel raises what kombu's and Celery's handlers do not expect: the
    # day this fails, kombu mends it and broker.Channel can go
    with pytest.raises(AttributeError, match="hostname"):
        ignore_errors(conn, message.channel.close)
