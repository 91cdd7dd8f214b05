"""The HTTP client for the (patched SGLang or reference) server. One session per process.

Translates aiohttp's exceptions at this boundary: a 4xx is the sample's fault (``BadInput``);
a refused connection, or a request that failed (timeout, dropped connection) while the server
then also fails a health check, is ``ServerUnavailable`` (the environment: wait, no attempt
spent); a 5xx, or a failed request while the server is healthy, is ``Transient``.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from worker.errors import BadInput, ServerUnavailable, Transient


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
                if 400 <= resp.status < 500 and not _server_state(data):
                    raise BadInput(f"server rejected {path} ({resp.status}): {_message(data)}")
                if resp.status >= 300:
                    raise Transient(f"server error on {path} ({resp.status}): {_message(data)}")
                return orjson.loads(data) if data else None
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            raise ServerUnavailable(f"{method} {url}: {type(e).__name__}: {e}") from e
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise Transient(f"{method} {url}: {type(e).__name__}: {e}") from e
        except orjson.JSONDecodeError as e:
            raise Transient(f"{method} {url}: response is not JSON: {e}") from e

    async def generate(self, rid: str, input_ids: list[int]) -> dict[str, Any]:
        """Prefill-only request (max_new_tokens=0): the hook dumps it, nothing is decoded.

        Raises:
            ServerUnavailable: the request failed and the server fails its health check too
                (down, or hung: a SIGSTOPped server accepts connections and answers nothing).
        """
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}}
        try:
            result = await self._request("POST", "/generate", body)
        except ServerUnavailable:
            raise
        except Transient as e:
            if not isinstance(e.__cause__, TimeoutError | aiohttp.ClientError | ConnectionError):
                raise  # the server answered (a 5xx, or not JSON): it is up
            if not await self.healthy():
                raise ServerUnavailable(f"{e}; and the server fails its health check") from e
            raise
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
        except (Transient, BadInput):
            return False
        return True

    async def healthy(self) -> bool:
        """Whether the server runs a one-token generation (``/health_generate``) within the
        request timeout (60 s at most)."""
        try:
            await self._request("GET", "/health_generate",
                                timeout_s=min(60.0, self.timeout.total or 60.0))
        except (Transient, BadInput):
            return False
        return True


def _server_state(data: bytes) -> bool:
    """A 4xx that is about the server's state, not the request: the rid is still running."""
    return "Duplicate request ID" in _message(data)


def _message(data: bytes) -> str:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:300].decode("utf-8", "replace")
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:300]
