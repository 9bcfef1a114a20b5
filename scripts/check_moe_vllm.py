"""Check once that vLLM serves the tiny MoE policy (``models.tiny.moe_policy``): it loads with ``enforce_eager`` in
float32 on the CPU, and its greedy continuations equal HF's. About 30 s (vLLM start-up). Usage:
``HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 python scripts/check_moe_vllm.py``. Not a test: the suite's vLLM tests
share one engine of the dense policy, and routing capture in vLLM is not done (see
``molt_lightning/policies/moe.py``)."""

from __future__ import annotations

import time


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from molt_lightning.models.tiny import moe_policy

    folder = moe_policy()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 73*41?", "What is 734*56?", "What is 12*9?")]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    t0 = time.perf_counter()
    llm = LLM(model=folder, enforce_eager=True, dtype="float32", seed=0, max_model_len=256)
    print(f"vLLM loaded {folder} in {time.perf_counter() - t0:.1f} s")
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, logprobs=0))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    same = 0
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        got = list(o.outputs[0].token_ids)
        same += ref[: len(got)] == got
        print(f"vllm {tok.decode(got)!r}\nhf   {tok.decode(ref)!r}")
    print(f"greedy continuations equal to HF's: {same}/{len(prompts)}")


if __name__ == "__main__":  # vLLM's engine core starts with spawn: this guard is required
    main()
