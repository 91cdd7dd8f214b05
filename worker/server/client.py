"""The HTTP client for the hooked server (SGLang, vLLM or the reference). One session per process.

The engine is asked of the server (``engine``), again once the server refused a connection, a
ready marker is new or it answered 404 (another engine may serve there now). Answers are
translated by ``answers.error_for``. A refused connection, or a failed request while the server
fails a health check, is ``ServerUnavailable``; a reset or dropped connection while it is
healthy is ``ServerBusy``; a timeout while it is healthy is ``Transient``, a counted attempt.
Tests: tests/farm/test_faults.py::test_hung_server_spends_no_attempts, tests/vllm/farm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson

from engine_dump import engines, markers
from engine_dump.engines import Decoded, Engine, Sampling
from engine_dump.markers import SharedDumpDir
from worker.core.errors import ConfigError, FarmError, ServerBusy, ServerUnavailable, Transient
from worker.core.settings import Settings
from worker.server import answers


class ServerClient:
    """Async client; create inside the event loop that will use it."""

    def __init__(self, base_url: str, timeout_s: float, dump_dir: Path | None = None,
                 writer: str | None = None) -> None:
        """``dump_dir``: the server's, where a vLLM hook's marker says its batch budget;
        ``writer``: the server start whose marker that is (a probe dump's ``M_WRITER``)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self.dump_dir = dump_dir
        self.writer = writer
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._engine: Engine | None = None
        self._epoch: tuple[tuple[str, int], ...] = ()  # the ready markers when it was asked

    @classmethod
    def of(cls, settings: Settings, timeout_s: float | None = None,
           writer: str | None = None) -> ServerClient:
        """The client of ``settings``' server (timeout: the request timeout unless given)."""
        return cls(settings.server_url, settings.request_timeout_s if timeout_s is None
                   else timeout_s, settings.dump_dir, writer)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The one session; a closed client opens no new one (nothing would close it)."""
        if self._closed:
            raise aiohttp.ClientConnectionError("the client was closed")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, json_serialize=lambda o: orjson.dumps(o).decode()
            )
        return self._session

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None,
                       timeout_s: float | None = None,
                       headers: dict[str, str] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(10.0, timeout_s))
        try:
            async with self.session.request(method, url, json=body, timeout=timeout,
                                            headers=headers) as resp:
                data = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            self._engine = None  # down: what comes back up is asked again
            raise ServerUnavailable(f"{method} {url}: {type(e).__name__}: {e}") from e
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise Transient(f"{method} {url}: {type(e).__name__}: {e}") from e
        if status == 404:  # not the engine's path: another engine may serve here now
            self._engine = None
        error = answers.error_for(path, status, data)
        if error is not None:
            raise error
        try:
            return orjson.loads(data) if data else None
        except orjson.JSONDecodeError as e:  # a success that is not the server's (a portal)
            raise ServerBusy(f"{method} {url}: a {status} answer that is not JSON: "
                             f"{data[:120]!r}", status) from e

    async def engine(self, timeout_s: float | None = None) -> Engine:
        """The engine behind ``base_url``, asked once: SGLang (and the reference server)
        answers ``/model_info``; vLLM answers ``/v1/models`` with ``max_model_len``.

        Raises:
            ServerUnavailable: the server does not answer (down, loading, a gateway's refusal).
            ConfigError: it answers, but as neither engine.
        """
        if self._engine is None or self._restarted():
            self._engine = None
            self._epoch = self._markers()  # before asking: a start meanwhile is seen next time
            try:
                self._engine = await self._detect(timeout_s)
            except (ServerUnavailable, ConfigError):
                raise
            except Transient as e:  # no answer in time, a 5xx: the server's state, not a sample's
                raise ServerUnavailable(f"{self.base_url}: which engine serves cannot be "
                                        f"asked: {e}") from e
        return self._engine

    def _markers(self) -> tuple[tuple[str, int], ...]:
        return markers.epoch(self.dump_dir) if self.dump_dir is not None else ()

    def _restarted(self) -> bool:
        """A ready marker came or changed since the engine was asked: a server (re)started."""
        return self.dump_dir is not None and self._markers() != self._epoch

    async def _detect(self, timeout_s: float | None) -> Engine:
        try:
            info = await self._request("GET", "/model_info", timeout_s=timeout_s)
        except ServerBusy as e:  # 404 and other 4xx: not SGLang's path; vLLM has no such path
            if e.status != 404:
                raise
        else:
            if isinstance(info, dict) and "model_path" in info:
                return engines.sglang_engine(info)
        models = await self._request("GET", "/v1/models", timeout_s=timeout_s)
        try:
            version = await self._request("GET", "/version", timeout_s=timeout_s)
        except FarmError:  # a gateway may pass only the API: the version is for people
            version = None
        said = version.get("version", "") if isinstance(version, dict) else ""
        engine = engines.vllm_engine(models, str(said))
        if engine is None:
            raise ConfigError(f"the server at {self.base_url} is neither SGLang (no "
                              f"/model_info) nor vLLM (/v1/models answered {models!r:.200}): "
                              "point FARM_SERVER_URL at the hooked inference server")
        return engine

    async def generate(self, rid: str, input_ids: list[int], dp_rank: int | None = None,
                       prompt_logprobs: bool = False) -> dict[str, Any]:
        """The prefill request of one sample, which the hook dumps (``Engine.generate``);
        ``dp_rank`` pins it to that DP group; ``prompt_logprobs``: the proof's logprobs too.

        Raises:
            ServerUnavailable: the request failed and the server fails its health check too
                (down, or hung: a SIGSTOPped server accepts connections and answers nothing).
            ServerBusy: refused for now by the server or a gateway, or reset while it is healthy.
            BadInput: the engine refused the request for its content."""
        path, body, headers = (await self.engine()).generate(rid, input_ids, dp_rank,
                                                             prompt_logprobs)
        result = await self._checked(path, body, headers)
        if not isinstance(result, dict):
            raise Transient(f"unexpected {path} answer: {result!r:.200}")
        return result

    async def _checked(self, path: str, body: Any, headers: dict[str, str],
                       timeout_s: float | None = None) -> Any:
        """POST a request of a sample's, its failure told apart by the server's health."""
        try:
            return await self._request("POST", path, body, timeout_s=timeout_s,
                                       headers=headers)
        except ServerUnavailable:
            raise
        except Transient as e:
            if not isinstance(e.__cause__, TimeoutError | aiohttp.ClientError | ConnectionError):
                raise  # the server answered (a 5xx, or not JSON): it is up
            if not await self.healthy():
                raise ServerUnavailable(f"{e}; and the server fails its health check") from e
            if not isinstance(e.__cause__, TimeoutError):  # a reset, a dropped connection
                raise ServerBusy(f"{e}; the server itself is healthy: the network or a "
                                 "gateway in front of it dropped the request") from e
            raise  # a timeout while the server is healthy: a counted attempt

    async def decode(self, rid: str, input_ids: list[int], sampling: Sampling,
                     timeout_s: float, dp_rank: int | None = None) -> Decoded:
        """A generation from ``input_ids`` (``Engine.decode``), within ``timeout_s``.

        Raises as ``generate`` (a timeout while the server is healthy is ``Transient``, a
        counted attempt), and ``Transient`` for an answer that is not a generation's."""
        engine = await self.engine()
        path, body, headers = engine.decode(rid, input_ids, sampling, dp_rank)
        result = await self._checked(path, body, headers, timeout_s)
        try:
            return engine.decoded(result)
        except ValueError as e:
            raise Transient(f"{path}: {e}") from e

    async def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info``; for vLLM the same keys from ``/v1/models``."""
        engine = await self.engine()
        if engine.name == engines.VLLM:
            return engines.vllm_model_info(engine)
        info = await self._request("GET", "/model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise Transient(f"unexpected /model_info answer: {info!r:.200}")
        return info

    async def server_info(self) -> dict[str, Any]:
        """SGLang's ``/server_info`` (its server args: chunked prefill size, limits, ...); for
        vLLM its limits under the same names (``Engine.server_info``).

        Raises:
            ConfigError: two vLLM servers write the dump dir and no ``writer`` says whose."""
        engine = await self.engine()
        if engine.name == engines.VLLM:
            try:
                return engine.server_info(self.dump_dir, self.writer)
            except SharedDumpDir as e:
                raise ConfigError(f"{self.dump_dir}: {e}") from e
        info = await self._request("GET", "/server_info")
        if not isinstance(info, dict):
            raise Transient(f"unexpected /server_info answer: {info!r:.200}")
        return info

    async def reachable(self, timeout_s: float | None = None) -> bool:
        """A cheap liveness probe (no forward pass, unlike SGLang's /health)."""
        try:
            if self._engine is None or self._restarted():  # asking is itself a cheap request
                await self.engine(timeout_s)
                return True
            await self._request("GET", self._engine.liveness_path, timeout_s=timeout_s)
        except FarmError:  # any answer but a success: not reachable, not healthy
            return False
        return True

    async def healthy(self) -> bool:
        """Whether the server is healthy within the request timeout (60 s at most): SGLang
        runs a one-token generation (``/health_generate``), vLLM checks its engine core."""
        try:
            await self._request("GET", (await self.engine()).health_path,
                                timeout_s=min(60.0, self.timeout.total or 60.0))
        except FarmError:  # any answer but a success: not reachable, not healthy
            return False
        return True
