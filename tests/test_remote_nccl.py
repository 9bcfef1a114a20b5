"""The remote engine's ``nccl`` weight channel, without a GPU: the clear error where there is no CUDA, and, with the
HTTP server faked (a handler on a loopback port, ``helpers/loopback.py``) and the NCCL group and broadcast replaced by
recording stubs, the exact route sequence of a commit and its payloads. The real NCCL path (vLLM's group, its packed
broadcast, a server's NCCL engine) is untested here: this project has no GPU."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from starlette.responses import JSONResponse

from molt_lightning.engines.vllm import nccl as nccl_channel
from molt_lightning.engines.vllm.nccl import NcclChannel
from molt_lightning.engines.pool import EnginePool
from molt_lightning.engines.vllm.remote import RemoteVLLMEngine

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from loopback import Loopback, rpc_results  # noqa: E402

URL = "http://127.0.0.1:9"  # nothing is sent there: the engine fails before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_nccl_channel_fails_at_launch_and_at_first_sync_with_the_fix():
    engine = RemoteVLLMEngine(url=URL, channel="nccl")
    with pytest.raises(RuntimeError, match="channel nccl needs CUDA on the trainer and the server; use shm on one "
                                           "machine or http across machines"):
        asyncio.run(engine.open("unused"))

    async def never_called(*args, **kw):
        raise AssertionError("no route may be called without CUDA")

    with pytest.raises(RuntimeError, match="channel nccl needs CUDA"):
        asyncio.run(NcclChannel(never_called, URL, 29600, "127.0.0.1").load([{"w": torch.zeros(1)}]))


class FakeNcclServer:
    """The routes a commit calls, recorded in order with their JSON bodies. ``/update_weights`` answers only once
    the trainer has broadcast that bucket: a channel that waited for the answer before broadcasting would hang
    (here: time out), as the real workers would, which wait inside the NCCL receive."""

    def __init__(self, workers: int = 2):
        self.workers, self.calls, self.broadcasts, self.groups = workers, [], [], 0

    async def handle(self, request) -> JSONResponse:
        content = await request.body()
        body = json.loads(content) if content else None
        path = request.url.path
        self.calls.append((path, body))
        if path == "/update_weights":
            for _ in range(500):
                if len(self.broadcasts) == sum(p == "/update_weights" for p, _ in self.calls):
                    break
                await asyncio.sleep(0.01)
            else:
                return JSONResponse(status_code=500, content={"error": "the bucket was never broadcast"})
        if path == "/collective_rpc":
            return JSONResponse(rpc_results(body))
        if path == "/get_world_size":
            return JSONResponse({"world_size": self.workers})
        return JSONResponse({"success": True})

    def routes(self) -> list[str]:
        return [p for p, _ in self.calls if p not in ("/health", "/collective_rpc")]


@pytest.fixture
def fake(monkeypatch):
    server = FakeNcclServer()
    monkeypatch.setattr(nccl_channel, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def open_group(self, info):
        server.groups += 1
        return "group"

    def broadcast(self, bucket):
        assert self.group == "group", "a bucket was broadcast before the group was joined"
        server.broadcasts.append([(name, t.dtype, tuple(t.shape), t.clone()) for name, t in bucket.items()])

    monkeypatch.setattr(NcclChannel, "open_group", open_group)
    monkeypatch.setattr(NcclChannel, "broadcast", broadcast)
    with Loopback(server.handle) as http:
        server.url = http.url
        yield server


def _engine(server: FakeNcclServer) -> RemoteVLLMEngine:
    return RemoteVLLMEngine(url=server.url, channel="nccl", nccl_master_port=29611, nccl_master_address="10.0.0.7",
                            health_interval_s=3600)


BUCKETS = [
    {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2), "model.norm.weight": torch.ones(2)},
    {"lm_head.weight": torch.full((4, 2), 0.5, dtype=torch.bfloat16)},
]


def test_a_commit_joins_once_then_pauses_loads_each_bucket_over_nccl_resets_tags_and_resumes(fake):
    async def run():
        engine = _engine(fake)
        await engine.open("unused")
        start = len(fake.calls)
        for bucket in BUCKETS:
            await engine.stage_weights(bucket)
        for bucket in BUCKETS:  # the trainer's tensors change after staging: the staged copies must not
            for t in bucket.values():
                t.add_(100)
        await engine.commit_weights(3)
        first = fake.calls[start:]
        await engine.stage_weights({"model.norm.weight": torch.zeros(2)})
        await engine.commit_weights(4)
        await engine.close()
        return engine, first

    engine, first = asyncio.run(run())
    for bucket in BUCKETS:
        for t in bucket.values():
            t.sub_(100)
    update = ["/start_weight_update", "/update_weights", "/update_weights", "/finish_weight_update"]
    assert [p for p, _ in first] == ["/pause", "/get_world_size", "/init_weight_transfer_engine", *update,
                                     "/reset_prefix_cache", "/update_weight_version", "/resume"]
    assert fake.routes()[-7:] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                  "/reset_prefix_cache", "/update_weight_version", "/resume"]  # joined once only
    assert fake.groups == 1 and engine.version == 4
    bodies = dict(first[1:3])
    assert bodies["/init_weight_transfer_engine"] == {"init_info": {
        "master_address": "10.0.0.7", "master_port": 29611, "rank_offset": 1, "world_size": 1 + fake.workers,
        "packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}}
    sent = [body["update_info"] for p, body in first if p == "/update_weights"]
    assert sent == [{"names": ["model.embed_tokens.weight", "model.norm.weight"], "dtype_names": ["float32", "float32"],
                     "shapes": [[3, 2], [2]]},
                    {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]]}]
    assert [[(n, d, s) for n, d, s, _ in b] for b in fake.broadcasts[:2]] == [
        [(n, t.dtype, tuple(t.shape)) for n, t in bucket.items()] for bucket in BUCKETS]
    for bucket, broadcast in zip(BUCKETS, fake.broadcasts):
        for (_, _, _, got), want in zip(broadcast, bucket.values()):
            assert torch.equal(got, want)  # the values as staged, not as changed after
    tags = [b["new_version"] for p, b in fake.calls if p == "/update_weight_version"]
    assert tags == ["0", "3", "4"]


@pytest.mark.slow
def test_a_failed_broadcast_fails_the_commit_resumes_the_server_and_drops_the_group(fake, monkeypatch):
    def broken(self, bucket):
        raise RuntimeError("NCCL error: remote process exited")

    async def run():
        engine = _engine(fake)
        await engine.open("unused")
        await engine.stage_weights(BUCKETS[0])
        monkeypatch.setattr(NcclChannel, "broadcast", broken)
        with pytest.raises(RuntimeError, match="NCCL error"):
            await engine.commit_weights(1)
        assert engine._nccl.group is None  # dropped: the next load joins a new group
        await engine.close()

    asyncio.run(run())
    assert fake.routes()[-1] == "/resume"  # a failed load still resumes the server


def test_molt_serve_nccl_enables_vllms_nccl_weight_transfer_engine(monkeypatch, tmp_path):
    import molt_lightning.trainer.policy
    from molt_lightning.commands import serve

    seen = {}
    monkeypatch.setattr(molt_lightning.trainer.policy, "policy_folder", lambda p: p)
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: seen.update(cmd=cmd))
    serve.main(["--policy", str(tmp_path), "--nccl", "--", "--max-model-len", "64"])
    cmd = seen["cmd"]
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"} and cmd[-2:] == ["--max-model-len", "64"]
    serve.main(["--policy", str(tmp_path)])
    assert "--weight-transfer-config" not in seen["cmd"]


def test_a_pool_gives_each_remote_engine_its_own_rendezvous_port():
    pool = EnginePool(urls=["http://engine-1:8000", "http://engine-2:8000"], channel="nccl", nccl_master_port=29700,
                      nccl_master_address="10.0.0.7")
    assert [e.nccl_master_port for e in pool.engines] == [29700, 29701]
