"""``molt tinker --engine vllm``: samplers on vLLM engines (one engine core process each), frozen as on the torch
engine, and serving exactly the snapshot they were made from: a sampler's prompt logprobs equal the training client's
own ``forward`` logprobs of the same tokens (within float32 rounding), before and after further training."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker", reason="the tinker extra (make extra-tinker)")
from tinker import types  # noqa: E402

from molt_lightning.models.tiny import arithmetic_policy  # noqa: E402
from tests.test_tinker import KEY, running, sft_datum, train  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine core starts (~10-30 s)


@pytest.fixture(scope="module")
def vllm_served(tmp_path_factory):
    with running(tmp_path_factory.mktemp("tinker-vllm"), engine="vllm", engines_per_kind=1) as (server, url):
        yield server, url


def test_a_vllm_sampler_serves_its_snapshot_and_stays_frozen(vllm_served):
    server, url = vllm_served
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = client.create_lora_training_client(base_model=arithmetic_policy(), rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    text = "What is 12*34?CALC 12*34"
    data = [sft_datum(tok, text)]
    train(tc, data, 2)
    trainer_lp = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode(text))
    served = sampler.compute_logprobs(prompt).result()
    assert served[0] is None and np.allclose(served[1:], trainer_lp, atol=2e-3), (served[1:], trainer_lp)
    out = sampler.sample(types.ModelInput.from_ints(tok.encode("What is 12*34?")), 2,
                         types.SamplingParams(max_tokens=6, temperature=1.0)).result()
    assert all(s.sequence_id.endswith(":v2") and s.logprobs and len(s.logprobs) == len(s.tokens)
               for s in out.sequences)
    losses = train(tc, data, 3)
    assert losses[-1] < losses[0]
    assert sampler.compute_logprobs(prompt).result() == pytest.approx(served, nan_ok=True, abs=1e-6)
    assert type(server.pool.slots[0].engine).__name__ == "VLLMEngine" and all(server.pool.slots[0].verified)
    client.close("success").result()
