"""The ``nccl`` weight channel of ``RemoteVLLMEngine``: the trainer broadcasts each bucket over NCCL to the workers of
one vLLM server started with its NCCL weight-transfer engine (``molt serve --nccl``: ``--weight-transfer-config
{"backend": "nccl"}``). GPUs on both sides; the server's workers must reach the trainer's ``master_address``.

vLLM's own trainer-side pieces do the NCCL work: ``nccl_common.trainer_init`` opens the group as rank 0 (vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator``), ``worker_init_payload(NCCLWeightTransferInitInfo(...))`` is the
body of ``/init_weight_transfer_engine`` (workers at ranks 1..N, N from ``/get_world_size``),
``NCCLWeightTransferUpdateInfo`` is each bucket's ``/update_weights`` body (names, dtype names, shapes), and
``packed_nccl_broadcast_producer`` sends the bucket (vLLM's packed wire format, its default buffers). Both sides of
each NCCL step run at once, as in vLLM's ``NCCLTrainerWeightTransferEngine``: the HTTP call (the workers wait in
NCCL) concurrently with the trainer's rendezvous or broadcast in a thread. That engine's ``send_weights`` sends a
whole model per round through a blocking client; here the remote engine keeps its own sequence (pause, load,
reset the prefix cache, tag the version, resume) and this module is only its "load" step, per staged bucket.

Staged buckets are host-memory copies (as the other channels' files: the last commit is kept for a server that
comes back); each moves to the trainer's GPU bucket by bucket for its broadcast.

A failed load drops the group, and so does a server that comes back after being down: the next load joins a new
one (``/init_weight_transfer_engine`` again, same port).

Untested here (no GPU in this project's CI): the NCCL group, the broadcast, a real server's NCCL engine (which loads
through vLLM's layerwise reload: a commit carrying only part of the model is not checked against it), rejoining
after a failure (whether the old rendezvous port is free again). The
tests (``tests/test_remote_nccl.py``) fake the HTTP server and replace ``open_group``/``broadcast`` with recording
stubs: they check the routes, their payloads and their order, and the error without CUDA.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from urllib.parse import urlparse

import torch

log = logging.getLogger(__name__)
NO_CUDA = ("channel nccl needs CUDA on the trainer and the server; use shm on one machine or http across machines "
           "(torch.cuda.is_available() is False here)")
SERVER_ARGS = ["--weight-transfer-config", '{"backend": "nccl"}']  # what `molt serve --nccl` adds for vLLM

Post = Callable[..., Awaitable[dict]]


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(NO_CUDA)


def address_toward(url: str) -> str:
    """This machine's address on the route to ``url``'s host (what the server's workers dial for the rendezvous)."""
    host = urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


class NcclChannel:
    """Trainer side (rank 0) of one server's NCCL weight-transfer group; ``call`` is the engine's HTTP call."""

    def __init__(self, call: Post, url: str, master_port: int, master_address: str | None = None,
                 timeout_s: float = 300.0):
        self.call, self.url, self.master_port, self.timeout_s = call, url, master_port, timeout_s
        self.master_address = master_address or address_toward(url)
        self.device: int | None = None
        self.group = None  # vLLM's PyNcclCommunicator once joined

    async def connect(self) -> None:
        """Join the server's workers (once, and again after ``reset``): ``/init_weight_transfer_engine`` while the
        trainer opens rank 0; both block until every rank has arrived."""
        if self.group is not None:
            return
        require_cuda()
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        self.device = torch.cuda.current_device()
        workers = int((await self.call("GET", "/get_world_size", timeout=self.timeout_s))["world_size"])
        info = NCCLWeightTransferInitInfo(master_address=self.master_address, master_port=self.master_port,
                                          rank_offset=1, world_size=1 + workers, packed=True)
        log.info("joining the NCCL weight group of %s at %s:%d (%d ranks)", self.url, self.master_address,
                 self.master_port, 1 + workers)
        self.group = await _together(
            self.call("POST", "/init_weight_transfer_engine", json={"init_info": worker_init_payload(info)},
                      timeout=self.timeout_s), self.open_group, info)

    async def load(self, buckets: list[Mapping[str, torch.Tensor]]) -> None:
        """``/start_weight_update``; per bucket ``/update_weights`` (its names, dtypes, shapes) while the bucket is
        broadcast; ``/finish_weight_update``. A failure drops the group: the next load joins again."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        await self.connect()
        try:
            await self.call("POST", "/start_weight_update", timeout=self.timeout_s)
            for bucket in buckets:
                info = NCCLWeightTransferUpdateInfo(names=list(bucket),
                                                    dtype_names=[str(t.dtype).removeprefix("torch.")
                                                                 for t in bucket.values()],
                                                    shapes=[list(t.shape) for t in bucket.values()])
                await _together(self.call("POST", "/update_weights", json={"update_info": asdict(info)},
                                          timeout=self.timeout_s), self.broadcast, bucket)
            await self.call("POST", "/finish_weight_update", timeout=self.timeout_s)
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Forget the group (the server failed or restarted); the next ``load`` joins a new one."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.destroy()
            except Exception as e:  # a broadcast may still hang in it: nothing more to do from here
                log.warning("could not tear down the NCCL weight group of %s: %s", self.url, e)

    # ----- the NCCL work, in a worker thread (the tests replace these two) -----
    def open_group(self, info):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self.device)  # vLLM's helper opens the group on the current device of this thread
        return trainer_init(info, rank=0)

    def broadcast(self, bucket: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        torch.cuda.set_device(self.device)
        on_gpu = ((name, t.to(self.device, non_blocking=True)) for name, t in bucket.items())
        packed_nccl_broadcast_producer(iterator=on_gpu, group=self.group, src=0, post_iter_func=lambda item: item[1])
        torch.cuda.current_stream().synchronize()


async def _together(request: Awaitable, work: Callable, *args):
    """Run an HTTP call and the NCCL step it meets inside NCCL at once; return the step's result. The first failure
    raises and cancels the call; a thread stuck in NCCL cannot be stopped (the caller drops the group)."""
    call, step = asyncio.ensure_future(request), asyncio.ensure_future(asyncio.to_thread(work, *args))
    step.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is not "never retrieved"
    try:
        return (await asyncio.gather(call, step))[1]
    except BaseException:
        call.cancel()
        raise
