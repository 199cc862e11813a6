"""Async HTTP client for vLLM servers: hidden-state extraction and response regeneration.

The pipeline never imports vLLM; it sends token ids to ``/v1/completions`` on a server
started with ``extract_hidden_states`` and reads the safetensors file the server writes
(the file lives on the server's filesystem, so client and server must share it).

The file protocol (lock, read, validate, delete) is in :mod:`draftflow.vllm.hidden_states_file`.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx
import torch

from draftflow.vllm.errors import (  # noqa: F401  (re-exported: callers catch them from here)
    EndpointUnavailable,
    ExtractionNotEnabled,
    InvalidHiddenStates,
    RequestFailed,
    VLLMError,
)
from draftflow.vllm.hidden_states_file import (  # noqa: F401  (re-exported)
    discard_hidden_states,
    is_staging_name,
    read_hidden_states,
    remove_hidden_states,
    staging_path,
    validate_hidden_states,
    wait_for_lock,
)

RETRYABLE_STATUS_MIN = 500  # 5xx: the server (or a proxy) failed; 4xx: our request is wrong


@dataclass
class ExtractedSample:
    """Hidden states of one prompt, in memory: the caller decides where they are stored."""

    token_ids: torch.Tensor  # int64 [num_tokens]
    hidden_states: torch.Tensor  # [num_tokens, num_layers, hidden_size], the server's dtype
    endpoint: str
    request_id: str


@dataclass
class ChatReply:
    """One regenerated assistant turn; `finish_reason` "length" means it hit `max_tokens`."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


# ---------------------------------------------------------------------------------------
# Pure helpers, shared with the synchronous probe in draftflow.vllm.server
# ---------------------------------------------------------------------------------------


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def completion_payload(model: str, token_ids: Sequence[int]) -> dict:
    """One prompt as token ids (so the tokenization is ours), one generated token."""
    return {"model": model, "prompt": list(token_ids), "max_tokens": 1, "return_token_ids": True}


def error_message(response: httpx.Response) -> str:
    """The server's reason: OpenAI-style {"error": {"message"}}, or vLLM's 401 {"error": "..."}."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)[:500]


def hidden_states_path(body: dict, endpoint: str, prompt: Sequence[int], staging_dirs: Sequence[str]) -> str:
    """The file named by a completion response, after checking that it lies in one of our
    `staging_dirs` (else it is never touched) and that the server saw our prompt."""
    params = body.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    if not path:
        raise ExtractionNotEnabled(
            f"{endpoint} answered without `kv_transfer_params.hidden_states_path`: hidden-state "
            "extraction is not enabled on this server (start it with --speculative-config "
            "method=extract_hidden_states and --kv-transfer-config for the hidden-states connector)"
        )
    staging_path(path, staging_dirs)
    choices = body.get("choices") or [{}]
    echoed = choices[0].get("prompt_token_ids")
    if echoed is not None and list(echoed) != list(prompt):
        discard_hidden_states(path)
        raise InvalidHiddenStates(
            f"server echoed {len(echoed)} prompt tokens that differ from the {len(prompt)} sent", path
        )
    return path


# ---------------------------------------------------------------------------------------
# The async client
# ---------------------------------------------------------------------------------------


class VLLMClient:
    """Talks to one or more vLLM endpoints; use as ``async with VLLMClient(...) as c:``.

    `concurrency` bounds requests in flight *per endpoint*. Connection errors and 5xx are
    retried `retries` times with exponential backoff; 4xx never are (the request is wrong).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        api_key: str | None = None,
        concurrency: int = 4,
        retries: int = 3,
        timeout_s: float = 120.0,
        backoff_s: float = 0.5,
        num_layers: int | None = None,
        hidden_size: int | None = None,
        lock_timeout_s: float = 60.0,
        exclusive_lock: bool = False,
        staging_dirs: Sequence[str] = (),
    ):
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("at least one endpoint is needed")
        self.endpoints = [e.rstrip("/") for e in self.endpoints]
        self.api_key = api_key
        self.retries, self.backoff_s = retries, backoff_s
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.lock_timeout_s, self.exclusive_lock = lock_timeout_s, exclusive_lock
        self.concurrency = concurrency
        # The only folders whose files this client reads or deletes: a path a server names
        # elsewhere fails its sample and is left alone (hidden_states_file.staging_path).
        self.staging_dirs: tuple[str, ...] = tuple(staging_dirs)
        self._limits = {e: asyncio.Semaphore(concurrency) for e in self.endpoints}
        self._model_names: dict[str, str] = {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=concurrency * len(self.endpoints) + 4),
            headers=auth_headers(api_key),
        )

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing --------------------------------------------------------------------

    def _endpoint(self, endpoint: str | None) -> str:
        return (endpoint or self.endpoints[0]).rstrip("/")

    async def _request(
        self, method: str, endpoint: str, path: str, on_retry: Callable[[], None] | None = None, **kwargs
    ) -> httpx.Response:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                if on_retry is not None:
                    on_retry()
                # Exponential backoff with jitter so retries from many workers do not align.
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0) * (0.5 + random.random()))
            try:
                response = await self._http.request(method, endpoint + path, **kwargs)
            except httpx.TransportError as err:
                last = EndpointUnavailable(f"{endpoint}{path}: {type(err).__name__}: {err}")
                continue
            if response.status_code >= RETRYABLE_STATUS_MIN:
                last = RequestFailed(endpoint, response.status_code, error_message(response))
                continue
            if response.status_code >= 400:
                raise RequestFailed(endpoint, response.status_code, error_message(response))
            return response
        assert last is not None
        raise last

    # -- server information ----------------------------------------------------------

    async def health(self, endpoint: str | None = None) -> bool:
        """True when `/health` answers 200 (no retries: a health probe must be quick)."""
        try:
            response = await self._http.get(self._endpoint(endpoint) + "/health", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def models(self, endpoint: str | None = None) -> list[str]:
        response = await self._request("GET", self._endpoint(endpoint), "/v1/models")
        return [m["id"] for m in response.json().get("data", [])]

    async def version(self, endpoint: str | None = None) -> str:
        response = await self._request("GET", self._endpoint(endpoint), "/version")
        return str(response.json().get("version", ""))

    async def model_name(self, endpoint: str | None = None) -> str:
        """The served model id to put in requests (cached per endpoint)."""
        ep = self._endpoint(endpoint)
        if ep not in self._model_names:
            names = await self.models(ep)
            if not names:
                raise VLLMError(f"{ep}/v1/models lists no model")
            self._model_names[ep] = names[0]
        return self._model_names[ep]

    # -- extraction ------------------------------------------------------------------

    async def extract(
        self, token_ids: Sequence[int], *, request_id: str | None = None, endpoint: str | None = None
    ) -> ExtractedSample:
        """Hidden states of one prompt (validated, files removed)."""
        ep = self._endpoint(endpoint)
        prompt = [int(t) for t in token_ids]
        request_id = _unique(request_id)
        model = await self.model_name(ep)
        retried: list[bool] = []
        async with self._limits[ep]:
            try:
                response = await self._request(
                    "POST",
                    ep,
                    "/v1/completions",
                    on_retry=lambda: retried.append(True),
                    json=completion_payload(model, prompt),
                    headers={"X-Request-Id": request_id},
                )
                path = hidden_states_path(_json(response, ep), ep, prompt, self.staging_dirs)
                # Lock waits and file reads block: keep them off the event loop.
                tokens, hidden = await asyncio.to_thread(
                    read_hidden_states,
                    path,
                    prompt,
                    self.num_layers,
                    self.hidden_size,
                    self.lock_timeout_s,
                    self.exclusive_lock,
                )
            finally:
                if retried:
                    await asyncio.to_thread(self.discard_files_of, request_id)
        return ExtractedSample(tokens, hidden, ep, request_id)

    def discard_files_of(self, request_id: str) -> int:
        """Delete the staging files of every attempt at ``request_id`` (a retried request leaves
        the file of each attempt the server finished): only in our staging folders, only names
        the server gives that request. Returns how many were removed."""
        prefixes = (f"cmpl-{request_id}-", f"chatcmpl-{request_id}-")
        removed = 0
        for folder in self.staging_dirs:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if name.startswith(prefixes) and name.endswith(".safetensors") and is_staging_name(name):
                    discard_hidden_states(os.path.join(folder, name), self.lock_timeout_s)
                    removed += 1
        return removed

    async def extract_many(
        self,
        samples: Iterable[tuple[str, Sequence[int]]],
        *,
        return_exceptions: bool = True,
        on_result: Callable[[int, ExtractedSample | VLLMError], None] | None = None,
    ) -> list[ExtractedSample | VLLMError]:
        """Data-parallel extraction of (sample_id, token_ids) pairs over every endpoint.

        Each endpoint runs `concurrency` workers that pull from one shared queue, so faster
        endpoints take more samples. Results come back in input order; with
        `return_exceptions`, a failed sample's slot holds its error (and the rest continue),
        otherwise the first failure cancels the others and is raised. `on_result(index,
        result)` is called as each sample finishes (progress reporting).
        """
        items = list(samples)
        results: list[ExtractedSample | VLLMError | None] = [None] * len(items)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(items)):
            queue.put_nowait(i)

        async def worker(ep: str) -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                sample_id, tokens = items[i]
                try:
                    results[i] = await self.extract(tokens, request_id=str(sample_id), endpoint=ep)
                except VLLMError as err:
                    if not return_exceptions:
                        raise
                    results[i] = err
                if on_result is not None:
                    on_result(i, results[i])

        try:
            async with asyncio.TaskGroup() as group:
                for ep in self.endpoints:
                    for _ in range(self.concurrency):
                        group.create_task(worker(ep))
        except* VLLMError as group_error:
            raise group_error.exceptions[0] from None
        return results  # type: ignore[return-value]

    # -- regeneration ----------------------------------------------------------------

    async def chat(
        self,
        messages: list[dict],
        max_tokens: int,
        temperature: float = 0.0,
        *,
        endpoint: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """The target's reply text to `messages` (response regeneration); greedy by default."""
        reply = await self.chat_reply(
            messages, max_tokens, temperature, endpoint=endpoint, request_id=request_id
        )
        return reply.text

    async def chat_reply(
        self,
        messages: list[dict],
        max_tokens: int,
        temperature: float = 0.0,
        *,
        endpoint: str | None = None,
        request_id: str | None = None,
    ) -> ChatReply:
        """Like :meth:`chat`, with finish reason and token counts (to spot truncated replies)."""
        ep = self._endpoint(endpoint)
        model = await self.model_name(ep)
        payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        request_id = _unique(request_id)
        retried: list[bool] = []
        try:
            async with self._limits[ep]:
                response = await self._request(
                    "POST",
                    ep,
                    "/v1/chat/completions",
                    on_retry=lambda: retried.append(True),
                    json=payload,
                    headers={"X-Request-Id": request_id},
                )
            body = _json(response, ep)
            await self._discard_side_file(body)
        finally:
            if retried:
                await asyncio.to_thread(self.discard_files_of, request_id)
        choice, usage = body["choices"][0], body.get("usage") or {}
        return ChatReply(
            text=choice["message"].get("content") or "",
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    async def sample(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        *,
        endpoint: str | None = None,
    ) -> ChatReply:
        """A seeded, sampled continuation of token ids (completions endpoint), stopping at the
        model's end-of-turn; self-generated user turns are written this way."""
        ep = self._endpoint(endpoint)
        model = await self.model_name(ep)
        payload = {
            "model": model,
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": int(seed),
        }
        async with self._limits[ep]:
            response = await self._request(
                "POST",
                ep,
                "/v1/completions",
                json=payload,
                headers={"X-Request-Id": uuid.uuid4().hex},
            )
        body = _json(response, ep)
        await self._discard_side_file(body)
        choice, usage = body["choices"][0], body.get("usage") or {}
        return ChatReply(
            text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    async def _discard_side_file(self, body: dict) -> None:
        # An extraction server writes a file for every request; nobody else would delete it.
        path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            staging_path(path, self.staging_dirs)
            await asyncio.to_thread(discard_hidden_states, path, self.lock_timeout_s)


def _unique(request_id: str | None) -> str:
    """A request id no other request shares (the caller's, e.g. a sample id, as its prefix): the
    files named after it are this request's alone."""
    suffix = uuid.uuid4().hex[:12]
    return f"{request_id}-{suffix}" if request_id else uuid.uuid4().hex


def _json(response: httpx.Response, endpoint: str) -> dict:
    try:
        return response.json()
    except ValueError:
        raise RequestFailed(
            endpoint, response.status_code, f"response is not JSON: {response.text[:200]!r}"
        ) from None
