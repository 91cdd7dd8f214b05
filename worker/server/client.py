"""The HTTP client for the (patched SGLang or reference) server. One session per process.

aiohttp's exceptions and the server's answers are translated here (``answers.error_for`` says
what an answer means). A refused connection, or a failed request while the server also fails a
health check, is ``ServerUnavailable``; a reset or dropped connection while it is healthy is
``ServerBusy`` (the network or a gateway); a timeout while it is healthy is ``Transient``, a
counted attempt, as the request timeout is sized for one sample.
Test: tests/farm/test_faults.py::test_hung_server_spends_no_attempts."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from worker.core.errors import FarmError, ServerBusy, ServerUnavailable, Transient
from worker.server import answers


class ServerClient:
    """Async client; create inside the event loop that will use it."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

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
                       timeout_s: float | None = None) -> Any:
        url = f"{self.base_url}{path}"
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(10.0, timeout_s))
        try:
            async with self.session.request(method, url, json=body, timeout=timeout) as resp:
                data = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            raise ServerUnavailable(f"{method} {url}: {type(e).__name__}: {e}") from e
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise Transient(f"{method} {url}: {type(e).__name__}: {e}") from e
        error = answers.error_for(path, status, data)
        if error is not None:
            raise error
        try:
            return orjson.loads(data) if data else None
        except orjson.JSONDecodeError as e:  # a success that is not the server's (a portal)
            raise ServerBusy(f"{method} {url}: a {status} answer that is not JSON: "
                             f"{data[:120]!r}", status) from e

    async def generate(self, rid: str, input_ids: list[int],
                       dp_rank: int | None = None) -> dict[str, Any]:
        """Prefill-only request (max_new_tokens=0): the hook dumps it, nothing is decoded;
        ``dp_rank`` pins it to that attention-DP group (SGLang's ``routed_dp_rank``).

        Raises:
            ServerUnavailable: the request failed and the server fails its health check too
                (down, or hung: a SIGSTOPped server accepts connections and answers nothing).
            ServerBusy: refused for now by the server or a gateway, or reset while it is healthy.
            BadInput: SGLang refused the request for its content."""
        body: dict[str, Any] = {"rid": rid, "input_ids": input_ids,
                                "sampling_params": {"max_new_tokens": 0}}
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        try:
            result = await self._request("POST", "/generate", body)
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
        if not isinstance(result, dict):
            raise Transient(f"unexpected /generate answer: {result!r:.200}")
        return result

    async def model_info(self) -> dict[str, Any]:
        info = await self._request("GET", "/model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise Transient(f"unexpected /model_info answer: {info!r:.200}")
        return info

    async def server_info(self) -> dict[str, Any]:
        """SGLang's ``/server_info`` (its server args: chunked prefill size, limits, ...)."""
        info = await self._request("GET", "/server_info")
        if not isinstance(info, dict):
            raise Transient(f"unexpected /server_info answer: {info!r:.200}")
        return info

    async def reachable(self, timeout_s: float | None = None) -> bool:
        """A cheap liveness probe (``/model_info``: no forward pass, unlike SGLang's /health)."""
        try:
            await self._request("GET", "/model_info", timeout_s=timeout_s)
        except FarmError:  # any answer but a success: not reachable, not healthy
            return False
        return True

    async def healthy(self) -> bool:
        """Whether the server runs a one-token generation (``/health_generate``) within the
        request timeout (60 s at most)."""
        try:
            await self._request("GET", "/health_generate",
                                timeout_s=min(60.0, self.timeout.total or 60.0))
        except FarmError:  # any answer but a success: not reachable, not healthy
            return False
        return True
