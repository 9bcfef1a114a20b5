"""What the Tinker API costs over molt's own calls: one supervised step through the SDK and ``molt tinker`` against the
same step on the same ``training.Model`` called directly, and one sample of 16 tokens through the SDK against the
same ``TorchEngine`` called directly. Same process, same tiny policy, alternating rounds (the median of each).

    python benchmarks/tinker_overhead.py [--steps 20] [--rounds 3]

The difference is the HTTP round trips, protobuf, the futures' polls and the training thread's hand-off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import numpy as np
    import tinker
    from tinker import types

    from molt_lightning.engines import TorchEngine
    from molt_lightning.engines.base import Sampling
    from molt_lightning.models.tiny import arithmetic_policy
    from molt_lightning.tinker.training import Model
    from molt_lightning.tinker.wire import Datum, ForwardBackward
    from tests.test_tinker import KEY, running

    folder = arithmetic_policy()
    with tempfile.TemporaryDirectory() as state, running(state) as (_, url):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        client = service.create_lora_training_client(base_model=folder, rank=16, seed=0).result()
        tok = client.get_tokenizer()
        ids = tok.encode("What is 123*45?CALC 123*45")
        batch = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                             loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})] * 8
        direct = Model("bench:train:0", folder, 16, seed=0)
        fb = ForwardBackward("bench:train:0", 0, "cross_entropy", {}, False,
                             [Datum(np.array(ids[:-1]), {"target_tokens": np.array(ids[1:]),
                                                         "weights": np.ones(len(ids) - 1, np.float32)})] * 8)
        sampler = client.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tok.encode("What is 123*45?"))
        engine = TorchEngine(seed=0)
        engine.launch(folder)
        params = types.SamplingParams(max_tokens=16, temperature=1.0, stop=[])

        def sdk_steps():
            for _ in range(args.steps):
                client.forward_backward(batch, "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=1e-4)).result()

        def direct_steps():
            for _ in range(args.steps):
                direct.forward_backward(fb)
                direct.optim_step({"learning_rate": 1e-4})

        def sdk_samples():
            for _ in range(args.steps):
                sampler.sample(prompt, 1, params).result()

        def direct_samples():
            for _ in range(args.steps):
                engine.call(engine.generate(prompt.to_ints(), Sampling(16, ignore_eos=True)))

        times = {name: [] for name in ("sdk step", "direct step", "sdk sample", "direct sample")}
        for fn, name in [(sdk_steps, "sdk step"), (sdk_samples, "sdk sample")]:
            fn()  # warm-up
        for _ in range(args.rounds):
            for fn, name in [(direct_steps, "direct step"), (sdk_steps, "sdk step"),
                             (direct_samples, "direct sample"), (sdk_samples, "sdk sample")]:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        engine.release()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"molt tinker overhead, {args.steps} calls x {args.rounds} rounds, tiny policy, CPU "
          f"({os.cpu_count()} cores)\n")
    print("| call | direct (ms) | through the SDK (ms) | ratio |\n|---|---|---|---|")
    for what in ("step", "sample"):
        d, s = med[f"direct {what}"], med[f"sdk {what}"]
        label = "forward_backward + optim_step, 8 datums" if what == "step" else "sample, 16 tokens"
        print(f"| {label} | {d:.1f} | {s:.1f} | {s / d:.2f}x |")


if __name__ == "__main__":
    main()
