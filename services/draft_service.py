"""The Draft service: a `DraftRuntime` behind gRPC.

The router calls it in order for each request (it awaits each call of a request before
the next), so the service adds no ordering of its own: it runs each call's forward on
its one compute thread and answers.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from specpipe.common.model.loading import weight_fingerprint
from specpipe.common.runtime.errors import RequestError
from specpipe.common.runtime.loader import load_draft, parse_dtype
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2, draft_pb2_grpc

from .control import FrameError, prune_from_proto, token_activation
from .grpc_util import Server, wait_until_idle
from .metrics import DraftMetrics
from .modelinfo import free_memory_bytes
from .status import status_code

log = logging.getLogger(__name__)
SERVICE_NAME = "specpipe.v1.Draft"


class DraftService(draft_pb2_grpc.DraftServicer):
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        model_id: str = "",
        device: str = "cpu",
        max_cache_bytes: int | None = None,
    ) -> None:
        self.runtime = load_draft(model_dir, parse_dtype(dtype), device, max_cache_bytes)
        self.model_id = model_id or Path(model_dir).name
        self.weight_hash = weight_fingerprint(model_dir)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.draining = False
        self.server = Server([SERVICE_NAME])
        draft_pb2_grpc.add_DraftServicer_to_server(self, self.server.server)
        self.metrics = DraftMetrics()  # served by serve.py with --metrics-port
        stage = self.runtime.runtime
        self.metrics.watch(
            lambda: self.metrics.queued,
            lambda: stage.cache_bytes_used / stage.max_cache_bytes if stage.max_cache_bytes else 0,
            lambda: stage.info().active_requests,
        )

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        port = await self.server.start(host, port)
        await self.server.set_serving(True)
        return port

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING, refuse new requests, and keep
        serving open ones until their router releases them or `seconds` pass."""
        self.draining = True
        await self.server.enter_drain()
        await wait_until_idle(lambda: self.runtime.runtime.info().active_requests, seconds)

    async def stop(self) -> None:
        await self.server.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _call(self, context, fn, *args, rows: int = 0):
        """Run an engine call on the compute thread; engine errors become gRPC statuses."""
        timed = self.metrics.timed(fn, rows)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, timed, *args)
        except (RequestError, FrameError, ValueError) as e:
            await context.abort(status_code(e), f"draft: {e}")

    async def Describe(self, request, context) -> draft_pb2.DraftDescription:
        info = self.runtime.runtime.info()
        return draft_pb2.DraftDescription(
            model_id=self.model_id,
            weight_hash=self.weight_hash,
            vocab_size=info.vocab_size,
            num_layers=info.num_layers,
            dtype=info.dtype,
            device=info.device,
            weight_bytes=info.weight_bytes,
            free_memory_bytes=free_memory_bytes(info.device),
            active_requests=info.active_requests,
        )

    async def Open(self, request, context) -> draft_pb2.OpenDraftResponse:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "draft is shutting down (draining): open the request on another replica",
            )
        rid = request.request_id
        if not rid or request.capacity <= 0 or not request.prompt_ids:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id, capacity and prompt_ids are required"
            )
        vocab = self.runtime.vocab_size
        prompt = torch.tensor(list(request.prompt_ids), dtype=torch.int64)
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ids outside the draft vocabulary [0, {vocab})",
            )
        await self._call(context, self.runtime.open, rid, int(request.capacity))
        self.metrics.requests.inc()
        if prompt.numel() > 1:
            chunk = request.prefill_chunk or 128
            await self._call(
                context, self.runtime.prefill, rid, prompt[:-1], 0, chunk, rows=prompt.numel() - 1
            )
        return draft_pb2.OpenDraftResponse()

    async def Prefill(self, request, context) -> draft_pb2.PrefillDraftResponse:
        tokens = torch.tensor(list(request.token_ids), dtype=torch.int64)
        if tokens.numel():
            chunk = request.prefill_chunk or 128
            await self._call(
                context,
                self.runtime.prefill,
                request.request_id,
                tokens,
                request.start_position,
                chunk,
                rows=tokens.numel(),
            )
        return draft_pb2.PrefillDraftResponse()

    async def Propose(self, request, context) -> draft_pb2.ProposeResponse:
        try:
            layer = token_activation(request.request_id, request.rows, request.token_ids)
        except FrameError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for sig in request.prunes:
            await self._call(context, self.runtime.prune, request.request_id, prune_from_proto(sig))
        cand = await self._call(
            context,
            self.runtime.propose,
            layer,
            int(request.top_k),
            float(request.temperature),
            rows=len(layer),
        )
        return draft_pb2.ProposeResponse(
            parent_ids=cand.parent_ids.tolist(),
            token_ids=cand.tokens.tolist(),
            probs=cand.probs.tolist(),
        )

    async def Prune(self, request, context) -> pb.PruneResponse:
        await self._call(
            context, self.runtime.prune, request.request_id, prune_from_proto(request.prune)
        )
        return pb.PruneResponse()

    async def Release(self, request, context) -> pb.ReleaseResponse:
        released = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.runtime.release, request.request_id
        )
        return pb.ReleaseResponse(released=released)
